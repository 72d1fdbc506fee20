"""The native ComfyUI path (LingBot-World Model (native) + Image To Video (native) + core samplers) computes what
the pack's own sampling loop computes, in a real ComfyUI (CPU, tiny checkpoints).

Needs a ComfyUI checkout: COMFYUI_DIR=/path/to/ComfyUI, and COMFYUI_PYTHON for its interpreter (default: this
one). Skipped otherwise. The template run is in test_comfyui.py (it needs the server).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_harness import run_parity_script, scaled

ROOT = Path(__file__).resolve().parents[1]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")

pytestmark = pytest.mark.skipif(
    not (COMFYUI_DIR and (Path(COMFYUI_DIR) / "main.py").is_file()),
    reason="set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its python) to run the ComfyUI tests",
)


def run_parity(work: Path, *mode: str, timeout: float = 300) -> dict:
    return run_parity_script("comfyui_native_parity.py", work, *mode, cache=work / "cache", timeout=timeout)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    return run_parity(tmp_path_factory.mktemp("native"))


@pytest.mark.parametrize("kind", ["fp32", "nf4"])
def test_native_graph_latent_equals_the_packs_sampling_loop(parity, kind):
    """Two KSamplerAdvanced (euler, high expert then low at the split, ModelSamplingSD3 shift) on the native
    MODELs give the latent the pack's loop gives on the same sigmas: fp32 experts and the NF4 repack (kept
    4-bit), fp32 compute on both sides."""
    row = parity[kind]
    assert parity["shape"] == [16, 3, 6, 14]
    assert row["max_abs"] > 0.5, row  # a real latent, not zeros
    assert row["max_abs_diff"] <= 1e-5 * row["max_abs"], row


def test_core_lora_loader_patches_nf4_experts_at_dequantization(parity):
    """LoraLoaderModelOnly on the NF4 MODELs: the latent moves, and equals the pack's LoRA side path on the
    same LoRA; strength 0 changes nothing."""
    row = parity["lora"]
    assert row["change"] > 0.05, row
    assert row["max_abs_diff"] <= 1e-5 * row["max_abs"], row
    assert row["zero_strength_change"] == 0.0, row


def test_model_patcher_keeps_nf4_and_patches_once_in_every_load_mode(parity):
    """Every Linear of the NF4 expert stays packed uint8 under ModelPatcher; a LoRA'd forward is the same fully
    loaded, in lowvram mode (per-layer casting with ComfyUI's LowVramPatch) and after partially_unload (no
    double patch); unpatching leaves the plain model."""
    row = parity["patcher"]
    assert row["four_bit_layers"] == row["linear_layers"] > 0, row
    assert row["packed_dtypes"] == ["torch.uint8"], row
    assert row["lora_change"] > 0.05, row
    assert row["lowvram_diff"] <= 1e-6, row
    assert row["partially_unloaded_diff"] <= 1e-6, row
    assert row["unpatched_diff"] == 0.0, row


def test_attention_override_and_block_patches_reach_the_native_model(parity):
    """An attention override (as attention-patch nodes set it) and 'dit' double_block replace patches are called
    on every block; passing through changes nothing (the camera still reaches each patched block)."""
    row = parity["patches"]
    assert row["block"] >= 3 and row["attention"] >= 2 * row["block"], (
        row
    )  # self- and cross-attention per block
    assert row["max_abs_diff"] == 0.0, row


def test_bf16_experts_keep_cores_fp32_layers(parity):
    """Loaded as bf16, the blocks' weights are bf16 and the patch embedding stays in the fp32 core builds it in
    (its input is cast to fp32 in core's forward: a bf16 weight there failed on CUDA)."""
    assert parity["bf16"] == {"patch_embedding": "torch.float32", "block_linear": "torch.bfloat16"}


@pytest.mark.parametrize("variant", ["cam", "plain"])
def test_native_dit_matches_upstream_golden_forward(parity, variant):
    """The native DiT (core's Wan blocks + the camera layers, fp32) on tests/golden/dit.safetensors gives
    upstream's tiny cam and plain forwards (core computes RoPE in fp32 where upstream uses fp64: ulp-scale)."""
    row = parity["golden"][variant]
    assert row["max_abs"] > 1, row
    assert row["max_abs_diff"] <= 5e-6 * row["max_abs"], row


@pytest.mark.slow
def test_bench_native_runs_tiny(tmp_path):
    """benchmarks/bench_native.py at --scale tiny on the CPU (ComfyUI's python) ends with its JSON summary: both
    sides ran every step of both experts."""
    run = subprocess.run(
        [
            os.environ.get("COMFYUI_PYTHON", sys.executable),
            str(ROOT / "benchmarks" / "bench_native.py"),
            "--comfyui",
            COMFYUI_DIR,
            "--scale",
            "tiny",
            "--workdir",
            str(tmp_path / "w"),
            "--steps",
            "4",
            "--split",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=scaled(300),
        env={**os.environ, "LINGBOT_WORLD_CACHE": str(tmp_path / "cache")},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    s = json.loads(run.stdout.strip().splitlines()[-1])
    assert s["bench"] == "native" and s["steps"] == 4 and s["split"] == 2
    for side in ("native", "pack"):
        phases = s[side]["phases"]
        assert {k: v["steps"] for k, v in phases.items()} == {"high": 2, "low": 2}, s[side]
        assert all(v["step_s"] > 0 for v in phases.values())
    assert set(s["native"]["comfy_loading"]) == {"high", "low"}


@pytest.mark.slow
def test_core_torch_compile_runs_the_native_model(tmp_path):
    """Core TorchCompileModel (inductor, the whole diffusion model) on a native expert samples the eager latent."""
    row = run_parity(tmp_path, "compile", timeout=900)
    assert row["max_abs"] > 0.5, row
    assert row["max_abs_diff"] <= 1e-5 * row["max_abs"], row
