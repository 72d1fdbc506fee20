"""Wan2.1 VAE checkpoint -> ready `WanVAE`: upstream `Wan2.1_VAE.pth` or ComfyUI's `wan_2.1_vae.safetensors`.

Both files use upstream's key names (ComfyUI's Wan VAE keeps them); ComfyUI's copy is bf16, upstream's
fp32. The model is built on the meta device and its parameters are assigned straight from the file
(mmap for .pth), so no dense init or second copy is made. Every key and shape is checked before
anything is read, and other VAEs (Wan2.2's z=48 one, the diffusers layout) are named as such.
"""

from pathlib import Path

import torch

from ..wan.vae import WAN21_VAE_CONFIG, WanVAE
from .interrupts import InterruptGuard
from .tensor_file import CheckpointError, TensorFile, name_list

MARKER = "decoder.middle.0.residual.0.gamma"  # present in every Wan-family VAE in upstream layout
WAN22_MARKER = "decoder.upsamples.0.upsamples.0.residual.2.weight"  # Wan2.2 VAE's nested up blocks


def _identify(path: Path, shapes: dict) -> str:
    """Key prefix of the Wan2.1 VAE inside the file ('' for a plain VAE file); raises for anything else."""
    hits = [k for k in shapes if k.endswith(MARKER)]
    if not hits:
        if "decoder.conv_in.weight" in shapes or any(k.endswith("decoder.conv_in.weight") for k in shapes):
            raise CheckpointError(
                f"{path} uses the diffusers (AutoencoderKL*) layout, not the Wan2.1 VAE's upstream layout; "
                "use Wan2.1_VAE.pth or ComfyUI's wan_2.1_vae.safetensors"
            )
        raise CheckpointError(
            f"{path} is not a Wan VAE checkpoint (no '{MARKER}'); its keys start: {name_list(shapes, 5)}"
        )
    prefix = min(hits, key=len)[: -len(MARKER)]
    z = (shapes.get(prefix + "conv2.weight") or (None,))[0]
    if prefix + WAN22_MARKER in shapes or z == 48:
        raise CheckpointError(
            f"{path} is a Wan2.2 VAE (z_dim 48, 16x spatial compression); LingBot-World needs the "
            "Wan2.1 VAE (z_dim 16): Wan2.1_VAE.pth or wan_2.1_vae.safetensors"
        )
    return prefix


def check_vae(path, config: dict | None = None) -> tuple[TensorFile, str, dict]:
    """Check a Wan2.1 VAE file from its keys and shapes alone (nothing read): -> (file, key prefix,
    WanVAE kwargs). `config` = WanVAE kwargs; by default upstream's, with the base width read from
    `encoder.conv1.weight` (small test VAEs)."""
    path = Path(path)
    ckpt = TensorFile(path, "Wan2.1 VAE", "Wan2.1_VAE.pth or wan_2.1_vae.safetensors", allow_unmapped=True)
    prefix = _identify(path, ckpt.shapes)
    found = {k[len(prefix) :]: s for k, s in ckpt.shapes.items() if k.startswith(prefix)}

    if config is None:
        conv1 = found.get("encoder.conv1.weight")
        config = {**WAN21_VAE_CONFIG, "dim": conv1[0]} if conv1 and conv1[0] > 0 else WAN21_VAE_CONFIG
    with torch.device("meta"):
        model = WanVAE(**config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = expected.keys() - found.keys(), found.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the Wan2.1 VAE: {len(missing)} missing keys [{name_list(missing)}], "
            f"{len(unexpected)} unexpected keys [{name_list(unexpected)}]"
        )
    for k, shape in expected.items():
        if found[k] != shape:
            raise CheckpointError(
                f"{path}: tensor '{prefix}{k}' has shape {list(found[k])}, expected {list(shape)}"
            )
        if not ckpt.dtype(prefix + k).is_floating_point:
            raise CheckpointError(
                f"{path}: tensor '{prefix}{k}' is {ckpt.dtype(prefix + k)}, expected a floating-point dtype"
            )
    return ckpt, prefix, config


def load_vae(path, device="cpu", dtype: torch.dtype = torch.float32, config: dict | None = None) -> WanVAE:
    """Load a Wan2.1 VAE onto `device` in `dtype` (upstream runs fp32); `config` as in `check_vae`."""
    ckpt, prefix, config = check_vae(path, config)
    with torch.device("meta"):
        model = WanVAE(**config)
    with InterruptGuard():  # Ctrl-C inside safetensors' read must stay a KeyboardInterrupt
        state = {k: ckpt.get(prefix + k).to(device=device, dtype=dtype) for k in model.state_dict()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
