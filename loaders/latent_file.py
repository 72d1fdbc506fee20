"""The final latent as a ComfyUI `.latent` file (what core Save Latent writes and Load Latent reads):
safetensors with `latent_tensor` [1, 16, T, h, w] in ComfyUI's un-normalised Wan2.1 convention, plus the
`latent_format_version_0` marker that tells Load Latent not to rescale it. Written atomically."""

from pathlib import Path

import torch
from safetensors.torch import save

from .video import check_output, write_atomic

VERSION_MARKER = "latent_format_version_0"


def save_comfy_latent(samples: torch.Tensor, path, overwrite: bool = False) -> Path:
    """samples: ComfyUI-convention [1, 16, T, h, w]. Returns the written path."""
    path = check_output(path, overwrite)
    if samples.dim() != 5 or samples.shape[0] != 1:
        raise ValueError(f"samples: expected [1, C, T, h, w], got {list(samples.shape)}")
    tensors = {"latent_tensor": samples.detach().float().cpu().contiguous(), VERSION_MARKER: torch.tensor([])}
    # serialized here and written by Python: a write error (a full disk) is an OSError naming the file
    return write_atomic(path, save(tensors), overwrite)
