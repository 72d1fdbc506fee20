"""Inputs the CLI and the library once took without a word, now refused before any model loads: camera
arrays of different lengths, a non-finite cache threshold, an empty preset, a quantize destination inside
its source, --allow_act2cam without key files, outputs that are devices or the run's own inputs, a Fast
folder's damaged shard and a bad device in `doctor`, and a sink without a window. Each: exit 2 (or the
library's error), the flag or file named, nothing written."""

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import args_for, fast_args
from lingbot_world import cli
from lingbot_world.loaders import synthetic
from lingbot_world.loaders.camera_files import CameraInput, load_camera_dir
from lingbot_world.loaders.fast_checkpoint import FAST_DIR
from lingbot_world.loaders.video import check_output
from lingbot_world.session import doctor
from lingbot_world.wan.camera import camera_conditioning
from lingbot_world.wan.fast import FastConfig
from lingbot_world.wan.speed import SpeedOptions

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "00"
pytestmark = pytest.mark.usefixtures("embedding_cache")


def refused(capsys, argv, *needles) -> str:
    """exit 2, one `error:` line naming every needle, no traceback."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if not x.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def nothing_written(folder: Path, *paths: Path) -> None:
    for p in paths:
        assert not p.exists(), p
    assert not [p for p in folder.rglob(".*") if "partial" in p.name or "replaced" in p.name]


def camera_folder(folder: Path, poses: int, intrinsics: int) -> Path:
    folder.mkdir()
    np.save(folder / "poses.npy", np.load(EXAMPLE / "poses.npy")[:poses])
    np.save(folder / "intrinsics.npy", np.load(EXAMPLE / "intrinsics.npy")[:intrinsics])
    return folder


# ---- 5: camera arrays of different lengths ----------------------------------------------------------


def test_camera_folder_with_too_few_intrinsics_rows(tmp_path, nf4_ckpt, capsys, nothing_loads):
    folder = camera_folder(tmp_path / "cam", 961, 5)
    for load in (load_camera_dir, CameraInput.from_dir):
        with pytest.raises(ValueError) as err:
            load(folder)
        message = str(err.value)
        assert str(folder / "intrinsics.npy") in message and str(folder / "poses.npy") in message
        assert "5 rows" in message and "961" in message
    out = tmp_path / "o.mp4"
    refused(capsys, args_for(nf4_ckpt, folder, out), "intrinsics.npy", "961")
    nothing_written(tmp_path, out)
    # what upstream accepts still loads: one row for every frame, or a row per pose and more
    assert len(load_camera_dir(camera_folder(tmp_path / "one", 961, 1))["intrinsics"]) == 1
    assert len(load_camera_dir(camera_folder(tmp_path / "more", 9, 961))["poses"]) == 9


def test_camera_conditioning_refuses_too_few_intrinsics_rows():
    poses, K = np.load(EXAMPLE / "poses.npy")[:9], np.load(EXAMPLE / "intrinsics.npy")
    with pytest.raises(ValueError, match="intrinsics has 5 rows but poses has 9"):
        camera_conditioning(poses, K[:5], 9, 16, 16, 2, 2)
    cam, frames = camera_conditioning(poses, K[:1], 9, 16, 16, 2, 2)
    assert frames == 9 and torch.equal(cam, camera_conditioning(poses, K[:9], 9, 16, 16, 2, 2)[0])


# ---- 6: a non-finite cache threshold -----------------------------------------------------------------


def test_infinite_cache_threshold(tmp_path, nf4_ckpt, capsys, nothing_loads):
    for threshold in (float("inf"), (0.1, float("inf"))):
        with pytest.raises(ValueError, match="cache_threshold must be a finite number"):
            SpeedOptions(cache="easycache", cache_threshold=threshold)
    out = tmp_path / "o.mp4"
    for values in (["inf"], ["0.1", "inf"]):
        argv = args_for(nf4_ckpt, None, out, "--cache", "easycache", "--cache_threshold", *values)
        refused(capsys, argv, "--cache_threshold", "finite")
    nothing_written(tmp_path, out)


# ---- 7: an empty camera preset ------------------------------------------------------------------------


@pytest.mark.parametrize("command, flag", [("generate", "--camera_preset"), ("camera", "--preset")])
def test_empty_camera_preset(command, flag, tmp_path, nf4_ckpt, capsys, nothing_loads):
    out, png = tmp_path / "o.mp4", tmp_path / "p.png"
    argv = args_for(nf4_ckpt, None, out) if command == "generate" else ["camera", "--preview", str(png)]
    for text in ("", "  "):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*argv, flag, text])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: empty" in err and "Traceback" not in err, err
    nothing_written(tmp_path, out, png)


# ---- 8: quantize into its own source ----------------------------------------------------------------


def test_quantize_refuses_a_destination_inside_its_source(tmp_path, capsys):
    src = synthetic.write_diffusers_expert(tmp_path / "fast", synthetic.tiny_config(), seed=1, shards=2)
    before = sorted(p.name for p in src.iterdir())
    dst = src / "nf4"
    line = refused(capsys, ["quantize", str(src), str(dst), "--device", "cpu"], str(dst), str(src))
    assert "inside the source folder" in line
    # the other way round: the source inside the destination
    line = refused(capsys, ["quantize", str(src), str(tmp_path), "--device", "cpu", "--overwrite"], str(src))
    assert "would replace the source" in line
    assert sorted(p.name for p in src.iterdir()) == before
    nothing_written(tmp_path, dst)


# ---- 9: --allow_act2cam without key files --------------------------------------------------------------


def test_allow_act2cam_without_key_files(tmp_path, nf4_ckpt, capsys, nothing_loads):
    folder = camera_folder(tmp_path / "cam", 961, 961)
    out = tmp_path / "o.mp4"
    argv = args_for(nf4_ckpt, folder, out, "--allow_act2cam")
    refused(capsys, argv, "--allow_act2cam", str(folder), "wasd_action.npy", "ijkl_action.npy")
    nothing_written(tmp_path, out)
    # with an action string (which implies --allow_act2cam, as upstream) the keys come from the string: said
    plan = [a for a in argv if a != "--frame_num" and a != "9"]
    plan[0] = "plan"
    assert cli.main([*plan, "--action_string", "w-8"]) == 0
    said = capsys.readouterr().out
    assert f"--allow_act2cam: the keys come from --action_string, not from {folder}/wasd_action.npy" in said


# ---- 10: outputs that are devices or the run's own inputs ----------------------------------------------


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def still_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(path.lstat().st_mode)


def link_copy(src: Path, dst: Path) -> Path:
    """The checkpoint folder as symlinks: a test that went wrong could not touch the shared fixture."""
    dst.mkdir()
    for entry in src.iterdir():
        (dst / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return dst


def test_check_output_refuses_non_regular_files_and_inputs(tmp_path):
    pipe = fifo(tmp_path / "pipe.mp4")
    with pytest.raises(ValueError, match="not a regular file"):
        check_output(pipe, overwrite=True)
    image = shutil.copy(EXAMPLE / "image.jpg", tmp_path / "in.jpg")
    with pytest.raises(ValueError, match="--image"):
        check_output(image, overwrite=True, inputs=[("--image", image)])
    link = tmp_path / "link.json"
    link.symlink_to(image)  # a report written through the link would land on the image
    with pytest.raises(ValueError, match="--image"):
        check_output(link, overwrite=True, inputs=[("--image", image)])
    assert still_fifo(pipe) and Path(image).read_bytes() == (EXAMPLE / "image.jpg").read_bytes()
    new = tmp_path / "new.mp4"  # a new file beside an input is fine
    assert check_output(new, inputs=[("--image", image), ("--ckpt_dir", tmp_path)]) == new


def test_generate_outputs_never_replace_a_device_or_an_input(tmp_path, nf4_ckpt, capsys, nothing_loads):
    ckpt = link_copy(nf4_ckpt, tmp_path / "ckpt")
    image = Path(shutil.copy(EXAMPLE / "image.jpg", tmp_path / "in.jpg"))
    pipe = fifo(tmp_path / "pipe.mp4")
    out = tmp_path / "o.mp4"
    vae = ckpt / "Wan2.1_VAE.pth"

    def argv(output, *extra):
        args = args_for(ckpt, None, output, "--overwrite", *extra)
        args[args.index("--image") + 1] = str(image)
        return args

    refused(capsys, argv(pipe), str(pipe), "not a regular file")
    refused(capsys, argv(vae), str(vae), "--ckpt_dir")
    refused(capsys, argv(out, "--report", str(image)), "--image")
    refused(capsys, argv(out, "--save_latent", str(out)), "--output")
    assert still_fifo(pipe) and vae.is_symlink() and vae.resolve() == (nf4_ckpt / vae.name).resolve()
    assert image.read_bytes() == (EXAMPLE / "image.jpg").read_bytes()
    nothing_written(tmp_path, out)
    # demo passes its --output through the same check
    refused(
        capsys, ["demo", "--workdir", str(nf4_ckpt.parent), "--output", str(pipe), "--overwrite"], str(pipe)
    )
    assert still_fifo(pipe)


def test_camera_and_quantize_outputs_never_replace_a_device_or_an_input(tmp_path, capsys):
    folder = camera_folder(tmp_path / "cam", 961, 961)
    poses = (folder / "poses.npy").read_bytes()
    pipe = fifo(tmp_path / "pipe.png")
    draw = ["camera", "--action_path", str(folder), "--overwrite", "--preview"]
    refused(capsys, [*draw, str(folder / "poses.npy")], "--action_path")
    refused(capsys, [*draw, str(pipe)], "not a regular file")
    refused(
        capsys, ["camera", "--preset", "pan left 30 17f", "--preview", str(pipe), "--overwrite"], str(pipe)
    )
    assert (folder / "poses.npy").read_bytes() == poses and still_fifo(pipe)
    src = synthetic.write_diffusers_expert(tmp_path / "fast", synthetic.tiny_config(), seed=1)
    refused(capsys, ["quantize", str(src), str(pipe), "--device", "cpu", "--overwrite"], str(pipe))
    assert still_fifo(pipe)
    nothing_written(tmp_path)


# ---- 11, 12: a Fast folder's damaged shard in doctor, doctor's device, a sink without a window --------


def test_doctor_checks_the_fast_shards(fast_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    good = {c.name: c for c in doctor.check_checkpoints(fast_ckpt)}
    assert all(c.ok for c in good.values()) and "Fast model" in good and "experts" in good
    base = tmp_path / "base"
    link_copy(fast_ckpt, base)
    (base / FAST_DIR).unlink()
    shutil.copytree(fast_ckpt / FAST_DIR, base / FAST_DIR)
    shard = sorted((base / FAST_DIR).glob("*-00002-of-00002.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for folder in (base, base / FAST_DIR):  # the base-cam folder, and the Fast folder itself
        checks = {c.name: c for c in doctor.check_checkpoints(folder)}
        assert not checks["Fast model"].ok and str(shard) in checks["Fast model"].detail
        assert "truncated" in checks["Fast model"].detail
        assert cli.main(["doctor", "--ckpt_dir", str(folder)]) == 1
        assert "[FAIL] Fast model" in capsys.readouterr().out


def test_doctor_names_a_bad_device(monkeypatch, capsys):
    def checked(*a, **k):
        raise AssertionError("the checks ran before the device was checked")

    monkeypatch.setattr(doctor, "run_checks", checked)
    for device in ("xyz", "cpu"):
        refused(capsys, ["doctor", "--device", device], "--device", repr(device))


def test_sink_needs_a_window(fast_ckpt, tmp_path, capsys, nothing_loads):
    with pytest.raises(ValueError, match="sink_size: .*local_attn_size"):
        FastConfig(sink_size=3).validate()
    FastConfig(local_attn_size=6, sink_size=3).validate()
    out = tmp_path / "o.mp4"
    refused(capsys, fast_args(fast_ckpt, EXAMPLE, out, "--sink_size", "3"), "--sink_size", "local_attn_size")
    nothing_written(tmp_path, out)
