"""Wan2.1 VAE loader and decode nodes, and the LATENT convention shared with ComfyUI.

A LATENT's "samples" hold ComfyUI's Wan2.1 convention, un-normalised VAE space [B, 16, T, h, w]
(what core VAE Encode gives and core VAE Decode takes); our pipeline works on normalised latents,
so the sampler and the decoder convert at the boundary.
"""

from dataclasses import dataclass

import folder_paths
import torch

from ..loaders.vae import load_vae
from ..wan.vae import (
    DECODE_DTYPES,
    SPATIAL_STRIDE,
    TEMPORAL_STRIDE,
    WanVAE,
    decode_dtype,
    encode_work_bytes,
    normalize_latent,
    to_comfy_latent,
)
from . import memory
from .models import CATEGORY, resolve_model

VAE = "LINGBOT_VAE"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class VAEHandle:
    """What flows on a LINGBOT_VAE link: the model, kept on the CPU between uses."""

    model: WanVAE
    device: torch.device

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """For wan.pipeline.sample: on the VAE device only while encoding."""
        frames, h, w = video.shape[1:]
        work = encode_work_bytes(frames, h // SPATIAL_STRIDE, w // SPATIAL_STRIDE, None, self.model.dtype)
        with memory.on_device(self.model, self.device, work):  # room for a whole-frame encode if it can
            return self.model.encode(video, tile="auto").to("cpu")  # tiles when less is free

    def to_comfy_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return self.model.to_comfy_latent(latent)

    def decode(self, latent: torch.Tensor, tile, vae_dtype: str = "fp32") -> torch.Tensor:
        """Normalised [16, T, h, w] -> video [3, F, H, W] in [-1, 1] on the intermediate device. vae_dtype:
        'fp32' decodes with the VAE as loaded (exact), 'bf16'/'fp16' with the fast decoder."""
        dtype = decode_dtype(vae_dtype, self.device)
        z_t, h, w = latent.shape[1:]
        out = 3 * (TEMPORAL_STRIDE * (z_t - 1) + 1) * h * w * SPATIAL_STRIDE**2 * 4
        work = self.model.decode_bytes_per_latent_pixel(2, dtype) * h * w + out  # whole-frame decode
        if dtype is not None:  # the fast decoder's copy of the weights
            work += sum(p.numel() for p in self.model.decoder.parameters()) * dtype.itemsize
        with memory.on_device(self.model, self.device, work):
            return self.model.decode(latent, tile=tile, out_device=memory.intermediate_device(), dtype=dtype)


class CoreVAE:
    """A core `VAE` (VAELoader with wan_2.1_vae.safetensors) behind the interface the sampler uses.
    ComfyUI keeps Wan latents un-normalised; the pipeline works on upstream's normalised ones."""

    def __init__(self, vae):
        channels, dim = getattr(vae, "latent_channels", None), getattr(vae, "latent_dim", None)
        ratio = getattr(vae, "upscale_index_formula", None)
        if channels != 16 or dim != 3 or ratio != (TEMPORAL_STRIDE, SPATIAL_STRIDE, SPATIAL_STRIDE):
            raise ValueError(
                f"vae: expected the Wan2.1 video VAE (16 latent channels, 4x8x8 stride, e.g. wan_2.1_vae.safetensors), "
                f"got a VAE with {channels} channels, {dim}-D latents, stride {ratio}"
            )
        self.vae = vae

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[3, F, H, W] in [-1, 1] -> normalised latent [16, T, h, w] fp32 (CPU), as `WanVAE.encode`."""
        pixels = video.float().add(1.0).div(2.0).permute(1, 2, 3, 0).cpu()  # [F, H, W, 3] in 0..1
        return normalize_latent(self.vae.encode(pixels)[0].float().cpu())

    def to_comfy_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return to_comfy_latent(latent)


def sampler_vae(vae):
    """The sampler's `vae` input: our LINGBOT_VAE as is, a core VAE wrapped."""
    return vae if isinstance(vae, VAEHandle) else CoreVAE(vae)


class LingBotVAELoader:
    DESCRIPTION = "Loads the Wan2.1 VAE (upstream Wan2.1_VAE.pth or ComfyUI's wan_2.1_vae.safetensors)."
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (VAE,)
    RETURN_NAMES = ("vae",)
    OUTPUT_TOOLTIPS = ("The VAE, kept on the CPU and moved to the GPU only to encode or decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae_name": (
                    folder_paths.get_filename_list("vae"),
                    {
                        "tooltip": "Wan2.1 VAE from models/vae (z_dim 16; the Wan2.2 5B VAE does not fit).",
                    },
                ),
                "dtype": (
                    list(DTYPES),
                    {
                        "default": "fp32",
                        "tooltip": "fp32 as upstream; bf16 halves its memory at a small cost in accuracy.",
                    },
                ),
            },
        }

    def load(self, vae_name, dtype):
        model = load_vae(resolve_model("vae", vae_name), device="cpu", dtype=DTYPES[dtype])
        return (VAEHandle(model, memory.vae_device()),)


class LingBotVAEDecode:
    DESCRIPTION = "Decodes a LingBot-World (or any Wan2.1) video latent into frames, tiled to fit the GPU."
    CATEGORY = CATEGORY
    FUNCTION = "decode"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    OUTPUT_TOOLTIPS = ("Video frames [F, H, W, 3] in 0..1; feed Create Video + Save Video.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": (VAE, {"tooltip": "From LingBot VAE Loader."}),
                "samples": (
                    "LATENT",
                    {"tooltip": "Video latent [B, 16, T, h, w]; batches are decoded in turn."},
                ),
                "tiling": (
                    ["auto", "none", "custom"],
                    {
                        "default": "auto",
                        "tooltip": "auto: tiles sized from free VRAM (whole frames on CPU). none: whole frames. "
                        "custom: the tile size below.",
                    },
                ),
                "tile_height": (
                    "INT",
                    {
                        "default": 64,
                        "min": 24,
                        "max": 1024,
                        "step": 8,
                        "tooltip": "custom tile height in latent pixels (x8 output pixels); tiles overlap by 16.",
                    },
                ),
                "tile_width": (
                    "INT",
                    {
                        "default": 64,
                        "min": 24,
                        "max": 1024,
                        "step": 8,
                        "tooltip": "custom tile width in latent pixels (x8 output pixels).",
                    },
                ),
            },
            # optional, so saved workflows and API prompts from before it keep loading (default exact)
            "optional": {
                "vae_dtype": (
                    list(DECODE_DTYPES),
                    {
                        "default": "fp32",
                        "tooltip": "fp32: the VAE as loaded, exact (upstream's decode). bf16/fp16: a channels-last copy "
                        "of the decoder in that precision, faster on a GPU and half the decode memory, "
                        "not bit-exact (fp16 is the closer of the two; bf16 needs an Ampere or newer GPU).",
                    },
                ),
            },
        }

    def decode(self, vae, samples, tiling, tile_height, tile_width, vae_dtype="fp32"):
        latents = samples["samples"]
        if latents.dim() != 5:
            raise ValueError(
                f"samples: expected a video latent [B, 16, T, h, w], got shape {list(latents.shape)}"
            )
        tile = {"auto": "auto", "none": None}.get(tiling, (tile_height, tile_width))
        decode_dtype(vae_dtype, vae.device)  # refused before anything is decoded
        frames = []
        for latent in latents:
            video = vae.decode(vae.model.from_comfy_latent(latent), tile, vae_dtype)
            frames.append(((video + 1) / 2).permute(1, 2, 3, 0))
            del video
        return (torch.cat(frames).to(memory.intermediate_device()),)
