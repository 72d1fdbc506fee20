"""The pack against upstream LingBot-World, through golden data upstream's own code produced.

tests/golden/*.safetensors come from tests/golden/make_golden.py (its docstring has the command);
they hold upstream's UniPC trajectories, camera tensors for examples/00 (Cam, Act, act2cam from files
and from an action string, at 464x832 and 720x1280), a tiny cam / plain DiT forward and a tiny VAE
encode/decode, with the tiny weights. The scheduler and camera code are bit-identical to upstream
(where the files were made; ulp-close on other machines); the DiT and VAE (fp32 here; accumulation
order differs) get tight tolerances, ~5x the differences measured when the files were made (DiT 1e-6,
VAE encode 7e-7, decode 4e-5).
"""

import functools
import hashlib
import json
from pathlib import Path

import pytest
import torch
from lingbot_world.loaders.camera_files import CameraInput
from lingbot_world.wan import vae as V
from lingbot_world.wan.camera import (
    camera_conditioning,
    interpolate_poses,
    relative_poses,
    scale_intrinsics,
)
from lingbot_world.wan.dit import WanModel
from lingbot_world.wan.schedulers import FlowUniPCScheduler
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLE = ROOT / "examples" / "00"
REGENERATE = "regenerate with tests/golden/make_golden.py (see its docstring)"


@functools.cache
def golden(name: str) -> tuple[dict, dict]:
    """(metadata, tensors) of tests/golden/<name>.safetensors."""
    with safe_open(GOLDEN / f"{name}.safetensors", "pt") as f:
        return json.loads(f.metadata()["golden"]), {k: f.get_tensor(k) for k in f.keys()}


def _params(name: str, field: str) -> list:
    with safe_open(GOLDEN / f"{name}.safetensors", "pt") as f:
        items = json.loads(f.metadata()["golden"])[field]
    return [pytest.param(item, id=item["key"]) for item in items]


# Bit-identity was verified on the machine that made the golden data (make_golden.py runs upstream's code
# there). Another CPU or torch build rounds a few fp32 ops differently by one ulp (measured: ARM, and
# ATEN_CPU_CAPABILITY=default, but also other AVX512 Xeons and torch builds, so the CPU's instruction set
# does not tell), and upstream's code is not here to run on this machine; so the "exact" checks allow
# ulp-scale differences on every machine, and name the largest difference when a value goes beyond.
ULP_TOL = 1e-6


def _assert_equal(ours: torch.Tensor, want: torch.Tensor, what: str):
    assert ours.dtype == want.dtype and ours.shape == want.shape, (
        f"{what}: {ours.dtype} {list(ours.shape)} vs upstream {want.dtype} {list(want.shape)}"
    )
    if torch.equal(ours, want):
        return
    diff = (ours.double() - want.double()).abs()
    if ours.is_floating_point() and bool((diff <= ULP_TOL * (1 + want.double().abs())).all()):
        return
    i = int(diff.argmax())
    pytest.fail(
        f"{what}: not ulp-close to upstream; {int((diff > 0).sum())} of {diff.numel()} values "
        f"differ, max |diff| {float(diff.max()):.3g} at flat index {i} "
        f"(ours {ours.flatten()[i].item()!r}, upstream {want.flatten()[i].item()!r})"
    )


# --- UniPC --------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", _params("unipc", "runs"))
def test_unipc_bit_identical_to_upstream(run):
    _, g = golden("unipc")
    key = run["key"]
    ours = FlowUniPCScheduler(run["steps"], run["shift"], "cpu")
    _assert_equal(ours.timesteps, g[f"{key}/timesteps"], "timesteps")
    _assert_equal(ours.sigmas, g[f"{key}/sigmas"], "sigmas")
    x = g[f"{key}/x_init"]
    assert x.dtype == getattr(torch, run["dtype"])
    model_outputs, samples = g[f"{key}/model_outputs"], g[f"{key}/samples"]
    assert len(model_outputs) == len(samples) == run["steps"]
    for k, t in enumerate(ours.timesteps):
        x = ours.step(model_outputs[k], t, x)
        _assert_equal(x, samples[k], f"UniPC {key} sample after step {k} (t={int(t)})")


# --- camera -------------------------------------------------------------------------------------


def test_golden_camera_inputs_are_the_shipped_example():
    meta, _ = golden("camera")
    for name, digest in meta["example_sha256"].items():
        got = hashlib.sha256((EXAMPLE / name).read_bytes()).hexdigest()
        assert got == digest, (
            f"examples/00/{name} changed since the camera golden data was made; {REGENERATE}"
        )


@pytest.mark.parametrize("variant", _params("camera", "variants"))
def test_camera_bit_identical_to_upstream(variant):
    _, g = golden("camera")
    key, h, w = variant["key"], variant["height"], variant["width"]
    string = variant["action_string"]
    source = CameraInput.from_dir(EXAMPLE, action_string=string, act2cam_files=variant["act2cam"])
    assert source.act2cam == variant["act2cam"]
    control = "act" if variant["kind"] == "act" else "cam"
    # An action string sets the length itself; the other inputs ask for upstream's 81 frames.
    poses, actions, frames = source.plan(None if string is not None else variant["frame_num"])
    assert frames == variant["frame_num"]
    assert control == "cam" or actions is not None  # the Act model reads action.npy

    if variant["act2cam"]:
        _assert_equal(torch.from_numpy(poses), g[f"{key}/c2w"], "act2cam trajectory (float64 c2w)")
        used = poses
    else:
        used = poses[:frames]
    lat_f = (frames - 1) // 4 + 1
    c2w = relative_poses(interpolate_poses(used, (len(used) - 1) // 4 + 1))
    _assert_equal(c2w, g[f"{key}/latent_c2w"], "latent-frame relative poses")
    K = scale_intrinsics(torch.from_numpy(source.intrinsics).float(), h, w)[0]
    _assert_equal(K, g[f"{key}/K"], "scaled intrinsics")

    cam, used_frames = camera_conditioning(
        poses,
        source.intrinsics,
        frames,
        h,
        w,
        variant["lat_h"],
        variant["lat_w"],
        control_type=control,
        actions=actions,
        dtype=torch.float32,
        act2cam=source.act2cam,
    )
    assert used_frames == frames
    assert list(cam.shape) == variant["shape"] and cam.shape[2] == lat_f
    index = g[f"{key}/index"]
    _assert_equal(cam.flatten()[index], g[f"{key}/values"], f"{key} camera tensor (sampled elements)")
    per_cf = cam.sum(dim=(3, 4), dtype=torch.float64)[0]  # [C, F]
    del cam
    # float64 sums over ~1e5 elements each: their ulp-level differences add up
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(per_cf.sum(1), g[f"{key}/channel_sums"], **tol)
    torch.testing.assert_close(per_cf.sum(0), g[f"{key}/frame_sums"], **tol)


def test_camera_pack_is_the_bf16_of_upstream():
    # CameraInput.pack (what the nodes and CLI call) returns the bf16 cast of upstream's tensor.
    meta, g = golden("camera")
    variant = next(v for v in meta["variants"] if v["key"] == "act2cam_string_464x832")
    key = variant["key"]
    source = CameraInput.from_dir(EXAMPLE, action_string=variant["action_string"])
    size = (variant["lat_h"], variant["lat_w"], variant["height"], variant["width"])
    cam, frames = source.pack("cam", None, size, "cpu")
    assert frames == variant["frame_num"] and list(cam.shape) == variant["shape"]
    index = g[f"{key}/index"]
    _assert_equal(cam.flatten()[index], g[f"{key}/values"].to(torch.bfloat16), f"{key} packed bf16")


# --- DiT ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cam", "plain"])
def test_tiny_dit_matches_upstream_fp32(name):
    meta, g = golden("dit")
    model = WanModel(control_type="cam" if name == "cam" else None, **meta["config"]).eval()
    weights = {k.removeprefix("weights/"): v.float() for k, v in g.items() if k.startswith("weights/")}
    expected = model.state_dict().keys()
    extra = set(weights) - set(expected)
    assert all("cam" in k or "c2ws" in k for k in extra), f"non-camera weights left unused: {extra}"
    assert bool(extra) == (name == "plain")
    model.load_state_dict({k: weights[k] for k in expected}, strict=True)
    model.compute_dtype = torch.float32  # upstream run in fp32 (its attention in fp32 too)
    with torch.no_grad():
        out = model(g["x"], g[f"t_{name}"], g["context"], y=g["y"], cam=g["cam"] if name == "cam" else None)
    want = g[f"out_{name}"]
    assert out.shape == want.shape and out.dtype == torch.float32
    assert want.abs().max() > 1  # a real signal, not a zeroed head
    torch.testing.assert_close(out, want, rtol=5e-6, atol=5e-6)


# --- VAE ----------------------------------------------------------------------------------------


def test_tiny_vae_matches_upstream():
    # Upstream Wan2_1_VAE (its latent mean/std scaling and output clamp) in fp32 with the stored tiny
    # weights; only accumulation order may differ.
    meta, g = golden("vae")
    vae = V.WanVAE(**{**V.WAN21_VAE_CONFIG, "dim": meta["dim"]}).eval()
    weights = {k.removeprefix("weights/"): v.float() for k, v in g.items() if k.startswith("weights/")}
    vae.load_state_dict(weights, strict=True)
    with torch.no_grad():
        z = vae.encode(g["video"])
        x = vae.decode(g["latent"])
    assert z.shape == g["encoded"].shape and z.dtype == torch.float32
    torch.testing.assert_close(z, g["encoded"], rtol=0, atol=1e-5)
    assert x.shape == g["decoded"].shape and x.dtype == torch.float32
    torch.testing.assert_close(x, g["decoded"], rtol=0, atol=1e-4)
    assert abs(x.abs().mean().item() - g["decoded"].abs().mean().item()) < 1e-6
    assert bool((g["decoded"].abs() == 1).any())  # the clamp is exercised


def test_golden_files_are_small():
    sizes = {
        p.name: p.stat().st_size for p in GOLDEN.iterdir() if p.suffix in (".safetensors", ".npz", ".json")
    }
    assert set(sizes) >= {"unipc.safetensors", "camera.safetensors", "dit.safetensors", "vae.safetensors"}
    assert sum(sizes.values()) < 2 * 1024 * 1024, sizes
