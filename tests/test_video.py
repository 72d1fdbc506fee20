import numpy as np
import pytest
import torch
from lingbot_world.loaders.video import read_mp4_info, write_mp4
from lingbot_world.wan.pipeline import frames_to_uint8


def frames(n=9, h=48, w=64):
    ramp = np.linspace(0, 255, n, dtype=np.float32)
    return np.broadcast_to(ramp[:, None, None, None], (n, h, w, 3)).astype(np.uint8).copy()


def test_writes_decodable_mp4_with_expected_frames_size_fps(tmp_path):
    out = write_mp4(frames(), tmp_path / "a.mp4", fps=16)
    assert read_mp4_info(out) == {"frames": 9, "width": 64, "height": 48, "fps": 16.0}
    assert [p.name for p in tmp_path.iterdir()] == ["a.mp4"]  # no temporary file left behind


def test_never_overwrites_without_permission(tmp_path):
    target = tmp_path / "mine.mp4"
    target.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_mp4(frames(), target)
    assert target.read_bytes() == b"user data"
    write_mp4(frames(), target, overwrite=True)
    assert read_mp4_info(target)["frames"] == 9


def test_failure_leaves_no_partial_file(tmp_path, monkeypatch):
    import av

    real_from_ndarray = av.VideoFrame.from_ndarray
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-encode
        return real_from_ndarray(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", flaky)
    with pytest.raises(KeyboardInterrupt):
        write_mp4(frames(), tmp_path / "b.mp4")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "bad, message",
    [(np.zeros((9, 48, 64, 3), np.float32), "uint8"), (np.zeros((9, 47, 64, 3), np.uint8), "even")],
)
def test_bad_frames_are_rejected(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        write_mp4(bad, tmp_path / "c.mp4")


def test_missing_output_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        write_mp4(frames(), tmp_path / "nope" / "d.mp4")


def test_frames_to_uint8_matches_upstream_scaling():
    video = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0, 3.0]).view(3, 1, 1, 2)  # [3, F=1, H=1, W=2]
    out = frames_to_uint8(video)
    assert out.shape == (1, 1, 2, 3) and out.dtype == torch.uint8
    # clamp to [-1, 1], (x + 1) / 2 * 255, truncate
    assert out[0, 0, :, 0].tolist() == [0, 0]
    assert out[0, 0, :, 1].tolist() == [127, 254]
    assert out[0, 0, :, 2].tolist() == [255, 255]
