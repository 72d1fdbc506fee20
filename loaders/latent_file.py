"""The final latent as a ComfyUI `.latent` file (what core Save Latent writes and Load Latent reads):
safetensors with `latent_tensor` [1, 16, T, h, w] in ComfyUI's un-normalised Wan2.1 convention, plus the
`latent_format_version_0` marker that tells Load Latent not to rescale it. Written atomically."""

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .video import check_output

VERSION_MARKER = "latent_format_version_0"


def save_comfy_latent(samples: torch.Tensor, path, overwrite: bool = False) -> Path:
    """samples: ComfyUI-convention [1, 16, T, h, w]. Returns the written path."""
    path = check_output(path, overwrite)
    if samples.dim() != 5 or samples.shape[0] != 1:
        raise ValueError(f"samples: expected [1, C, T, h, w], got {list(samples.shape)}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tensors = {
            "latent_tensor": samples.detach().float().cpu().contiguous(),
            VERSION_MARKER: torch.tensor([]),
        }
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
