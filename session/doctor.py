"""`lingbot.py doctor`: is this machine (and, given one, this checkpoint folder) ready to generate?

Each check returns a `Check` (name, ok, what was found or what to fix); `main` prints the checklist and
returns 1 when any check failed (a --device that names no CUDA device is a ValueError first).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def no_gpu_reason() -> str:
    """Why PyTorch sees no GPU, told apart: a CPU-only build (a GPU build is needed), or a GPU build that
    finds no device (the driver, CUDA_VISIBLE_DEVICES or the container's flags hide it)."""
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    if cuda is None and hip is None:
        return (
            f"PyTorch {torch.__version__} is a CPU-only build; install a CUDA build (on Linux the default "
            "`pip install torch`, or a given CUDA version from https://download.pytorch.org/whl/cu1XX) "
            "and an NVIDIA driver"
        )
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"PyTorch {torch.__version__} is a GPU build ({build}) but sees no GPU: check that the driver is "
        f"loaded (nvidia-smi), CUDA_VISIBLE_DEVICES (now {'unset' if visible is None else repr(visible)}) "
        "and, in a container, that it was started with the GPUs (docker run --gpus all)"
    )


def check_gpu(device: str = "cuda") -> Check:
    if not torch.cuda.is_available():
        return Check("GPU", False, f"{no_gpu_reason()}; or run with --device cpu (very slow)")
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    driver = getattr(torch.cuda, "driver_version", None)
    extra = f", driver {driver()}" if callable(driver) else ""
    return Check(
        "GPU", True, f"{props.name}, {props.total_memory / GIB:.1f} GiB, CUDA {torch.version.cuda}{extra}"
    )


def check_free_memory(device: str = "cuda") -> Check:
    from .planner import free_memory

    vram, ram = free_memory(device if torch.cuda.is_available() else "cpu")
    parts = [f"VRAM {vram / GIB:.1f} GiB free" if vram is not None else "VRAM: no GPU"]
    parts.append(f"RAM {ram / GIB:.1f} GiB available" if ram is not None else "RAM: unknown")
    ok = ram is None or ram >= 2 * GIB
    hint = "" if ok else "; close other programs: the pipeline needs a few GiB of RAM"
    return Check("free memory", ok, ", ".join(parts) + hint)


def check_pinned() -> Check:
    if not torch.cuda.is_available():
        return Check("pinned memory", False, "no GPU: pinned host memory needs CUDA")
    try:
        t = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        ok = t.is_pinned()
        del t
    except RuntimeError as e:
        return Check(
            "pinned memory", False, f"allocating 64 MiB of pinned memory failed: {e}; check ulimit -l"
        )
    return Check("pinned memory", ok, "64 MiB pinned and released" if ok else "allocation is not pinned")


def check_bitsandbytes(device: str = "cuda") -> Check:
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        return Check("bitsandbytes", False, f"not importable ({e}); pip install bitsandbytes")
    if not torch.cuda.is_available():
        return Check(
            "bitsandbytes", False, f"{bnb.__version__} installed, but no GPU to run its 4-bit kernels"
        )
    try:
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        layer = layer.to(device)
        x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
        y = layer(x)
        torch.cuda.synchronize(device)
        if y.shape != (4, 64) or not torch.isfinite(y).all():
            return Check("bitsandbytes", False, "the NF4 matmul returned a wrong or non-finite result")
    except Exception as e:  # any failure here means the CUDA kernels are unusable
        return Check(
            "bitsandbytes", False, f"{bnb.__version__}: a 4-bit Linear4bit matmul failed on {device}: {e}"
        )
    return Check("bitsandbytes", True, f"{bnb.__version__}: NF4 Linear4bit matmul runs on {device}")


def check_pyav() -> Check:
    try:
        import av
    except ImportError:
        return Check("PyAV", False, "not installed: pip install av (needed to write MP4)")
    return Check("PyAV", True, av.__version__)


def check_checkpoints(ckpt_dir, assets_dir=None) -> list:
    """Every checkpoint file validated from its headers: the two experts, the chunked model (a Fast or v2
    folder, or a base-cam folder holding a Fast one: both are checked), the text encoder and the VAE
    (from `assets_dir` where the folder lacks them, as `fast --assets_dir`)."""
    from ..loaders.checkpoints import resolve_checkpoint_dir
    from ..loaders.fast_checkpoint import fast_model_dir, is_model_folder, layout_kind, resolve_fast_dir
    from ..loaders.text_encoder import read_encoder_config
    from ..loaders.vae import check_vae

    root = Path(ckpt_dir).expanduser().resolve()
    # the chunked model's own folder, or a v2 folder (its DiT in transformers/): no base experts
    fast_folder = root.is_dir() and (
        is_model_folder(root) or (layout_kind(fast_model_dir(root)) or "").startswith("v2")
    )
    out, files = [], None
    if not fast_folder:
        try:
            files = resolve_checkpoint_dir(root)
        except (ValueError, OSError) as e:
            out.append(Check("checkpoints", False, str(e)))
        else:
            experts = f"{files.experts['high'].name} + {files.experts['low'].name}"
            out.append(Check("experts", True, f"{experts}, control {files.control_type}"))
    if fast_folder or fast_model_dir(root) != root:
        try:
            fast = resolve_fast_dir(root, assets_dir=assets_dir and Path(assets_dir).expanduser().resolve())
        except (ValueError, OSError) as e:
            out.append(Check("Fast model", False, str(e)))
        else:
            out.append(
                Check("Fast model", True, f"{fast.model.name}: {fast.kind.name}, control {fast.control_type}")
            )
            files = files or fast
    if files is None:
        return out
    for name, path, fn in (
        ("text encoder", files.text_encoder, read_encoder_config),
        ("VAE", files.vae, check_vae),
    ):
        try:
            fn(path)
            out.append(Check(name, True, str(path.name)))
        except (ValueError, OSError, KeyError) as e:
            out.append(Check(name, False, f"{path}: {e}"))
    return out


def check_device(device: str) -> torch.device:
    """doctor's --device: a CUDA device this machine could have (cuda or cuda:N); a ValueError naming it
    otherwise, before any check runs."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"--device: doctor checks a CUDA device (cuda or cuda:N), got {device!r}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and dev.index is not None and dev.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..{count - 1})")
    return dev


def run_checks(ckpt_dir=None, device: str = "cuda", assets_dir=None) -> list:
    gpu = check_gpu(device)
    checks = [gpu, check_free_memory(device), check_pinned(), check_bitsandbytes(device), check_pyav()]
    if ckpt_dir is not None:
        checks += check_checkpoints(ckpt_dir, assets_dir)
    return checks


def report(checks: list) -> str:
    lines = [f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in checks]
    bad = [c.name for c in checks if not c.ok]
    lines.append("all checks passed" if not bad else f"{len(bad)} to fix: {', '.join(bad)}")
    return "\n".join(lines)


def main(ckpt_dir=None, device: str = "cuda", assets_dir=None) -> int:
    check_device(device)
    checks = run_checks(ckpt_dir, device, assets_dir)
    print(report(checks))
    return 0 if all(c.ok for c in checks) else 1
