"""The reliability check, as a user meets it through `generate`: each bad checkpoint file, camera array,
argument or output path ends in one `error:` line naming it, exit code 2, no traceback, nothing written,
and nothing loaded first. The loaders' own tests cover each fault in depth; this proves the CLI path."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import unreadable
from helpers import EXPERT, RunsCode, args_for, expect_clear_error, link_copy
from lingbot_world import cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("embedding_cache")


def replace_file(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def safetensors_bytes(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


CKPT_CASES = {
    "empty expert": (EXPERT, b"", "model.safetensors"),
    "truncated expert": (EXPERT, None, "model.safetensors"),
    "overflowing header": (EXPERT, (1 << 40).to_bytes(8, "little") + b"{}", "model.safetensors"),
    "missing quant parts": (EXPERT, "drop_quant", "model.safetensors"),
    "wrong shape": (EXPERT, "wrong_shape", "model.safetensors"),
    "garbage config.json": ("high_noise_model_bnb_nf4/config.json", b"{not json", "config.json"),
    "pickled VAE that runs code": ("Wan2.1_VAE.pth", pickle.dumps(RunsCode()), "Wan2.1_VAE.pth"),
    "text encoder given as VAE": ("Wan2.1_VAE.pth", "t5_as_vae", "Wan2.1_VAE.pth"),
    "VAE given as text encoder": (
        "models_t5_umt5-xxl-enc-bf16.pth",
        "vae_as_t5",
        "models_t5_umt5-xxl-enc-bf16.pth",
    ),
}


def damage(root: Path, how, rel: str) -> None:
    path = root / rel
    original = path.resolve()
    if isinstance(how, bytes):
        return replace_file(path, how)
    if how is None:  # cut in the middle of the data
        return replace_file(path, original.read_bytes()[: original.stat().st_size // 2])
    if how == "t5_as_vae":
        path.unlink()
        return path.symlink_to((root / "models_t5_umt5-xxl-enc-bf16.pth").resolve())
    if how == "vae_as_t5":
        path.unlink()
        return path.symlink_to((root / "Wan2.1_VAE.pth").resolve())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(original))
    if how == "drop_quant":
        tensors = {k: v for k, v in tensors.items() if "absmax" not in k}
    else:  # wrong_shape: a bias one element short
        key = next(k for k in tensors if k.endswith("self_attn.q.bias"))
        tensors[key] = tensors[key][:-1].clone()
    path.unlink()
    save_file(tensors, str(path))


@pytest.mark.parametrize("case", CKPT_CASES)
def test_bad_checkpoint_files(case, nf4_ckpt, tmp_path, capsys, nothing_loads):
    rel, how, needle = CKPT_CASES[case]
    ckpt = link_copy(nf4_ckpt, tmp_path / "ckpt")
    damage(ckpt, how, rel)
    out = tmp_path / "o.mp4"
    err = expect_clear_error(capsys, args_for(ckpt, ROOT / "examples" / "00", out), out, needle)
    assert "weights_only=False" not in err and "\x1b[" not in err  # never the unsafe advice or colour codes


POSES = np.load(ROOT / "examples" / "00" / "poses.npy")
INTRINSICS = np.load(ROOT / "examples" / "00" / "intrinsics.npy")


def _nan_poses():
    poses = POSES.copy()
    poses[3, 0, 3] = np.nan
    return {"poses.npy": poses}


def _inf_poses():
    poses = POSES.copy()
    poses[1, 2, 3] = np.inf
    return {"poses.npy": poses}


def _focal(value):
    k = INTRINSICS.copy()
    k[:, 0] = value
    return {"intrinsics.npy": k}


CAMERA_CASES = {
    "NaN pose": (_nan_poses, "poses.npy"),
    "inf pose": (_inf_poses, "poses.npy"),
    "short poses": (lambda: {"poses.npy": POSES[:, :3]}, "poses.npy"),
    "mismatched shapes": (lambda: {"intrinsics.npy": INTRINSICS[:, :3]}, "intrinsics.npy"),
    "zero focal length": (lambda: _focal(0.0), "intrinsics.npy"),
    "negative focal length": (lambda: _focal(-5.0), "intrinsics.npy"),
    "pickled array": (lambda: {"poses.npy": np.array([RunsCode()], dtype=object)}, "poses.npy"),
}


@pytest.mark.parametrize("case", CAMERA_CASES)
def test_bad_camera_arrays(case, nf4_ckpt, tmp_path, capsys, nothing_loads):
    make, needle = CAMERA_CASES[case]
    folder = tmp_path / "cam"
    folder.mkdir()
    arrays = {"poses.npy": POSES, "intrinsics.npy": INTRINSICS, **make()}
    for name, arr in arrays.items():
        np.save(folder / name, arr, allow_pickle=arr.dtype == object)
    out = tmp_path / "o.mp4"
    expect_clear_error(capsys, args_for(nf4_ckpt, folder, out), out, needle)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--action_string", "w-10,q-3"], "--action_string"),
        (["--action_string", "w-ten"], "--action_string"),
        (["--size", "99999*99999"], "--size"),
        (["--frame_num", "1605"], "--frame_num"),
    ],
)
def test_bad_actions_and_sizes(extra, needle, nf4_ckpt, tmp_path, capsys, nothing_loads):
    args = args_for(nf4_ckpt, ROOT / "examples" / "00", tmp_path / "o.mp4", *extra)
    if "--action_string" in extra:
        i = args.index("--frame_num")
        del args[i : i + 2]
    with_value = expect_clear_error(capsys, args, tmp_path / "o.mp4")
    assert needle in with_value or needle.strip("-") in with_value, with_value


@pytest.mark.skipif(sys.platform != "linux", reason="chmod 000 / capabilities as on Linux")
def test_unreadable_checkpoint_is_reported(nf4_ckpt, tmp_path):
    """chmod 000 on an expert, run as a user would (a process that may not read it): a clear error."""
    ckpt = link_copy(nf4_ckpt, tmp_path / "ckpt")
    target = ckpt / EXPERT
    target.unlink()
    shutil.copy(nf4_ckpt / EXPERT, target)
    target.chmod(0)
    out = tmp_path / "o.mp4"
    env = {**os.environ, "LINGBOT_WORLD_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, str(ROOT / "lingbot.py"), *args_for(ckpt, ROOT / "examples" / "00", out)]
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=unreadable.preexec()
        )
    finally:
        target.chmod(0o644)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{target} (cannot be read (permission denied))" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not out.exists()


@pytest.mark.slow
def test_ten_runs_in_one_process_keep_memory_flat(nf4_ckpt, tmp_path):
    """Ten generations in one process (as a ComfyUI queue or a batch script would): anonymous RSS after
    the tenth is within 100 MB of where it was after the first."""
    from lingbot_world.loaders.monitor import rss_anon, trim_heap

    def run(i):
        out = tmp_path / f"o{i}.mp4"
        args = args_for(nf4_ckpt, ROOT / "examples" / "00", out, "--t5_mode", "inprocess", "--seed", str(i))
        assert cli.main(args) == 0
        out.unlink()

    run(0)
    trim_heap()
    start = rss_anon()
    for i in range(1, 10):
        run(i)
    trim_heap()
    assert rss_anon() - start < 100 * (1 << 20), (start, rss_anon())
