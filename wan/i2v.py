"""Input assembly for LingBot-World image-to-video sampling (upstream WanI2V.generate's preprocessing).

Sizes, first-frame mask, seeded noise and the VAE input video, reproduced with upstream's formulas.
"""

import math
import random
import sys

import numpy as np
import torch
import torch.nn.functional as F

from .config import PATCH_SIZE, VAE_STRIDE

LATENT_CHANNELS = 16
MIN_IMAGE_SIDE = 16


def latent_size(
    image_h: int, image_w: int, max_area: int, vae_stride=VAE_STRIDE, patch_size=PATCH_SIZE
) -> tuple[int, int, int, int]:
    """(lat_h, lat_w, h, w) for an image_h x image_w input and a pixel budget `max_area`, as upstream.

    The float64 evaluation is kept on purpose: for a 480x832 image at 480*832 the square root lands at
    479.99999999999994, so upstream produces 464x832, and so does this.
    """
    for name, v in (("image_h", image_h), ("image_w", image_w), ("max_area", max_area)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    aspect_ratio = image_h / image_w
    lat_h = round(np.sqrt(max_area * aspect_ratio) // vae_stride[1] // patch_size[1] * patch_size[1])
    lat_w = round(np.sqrt(max_area / aspect_ratio) // vae_stride[2] // patch_size[2] * patch_size[2])
    if lat_h < patch_size[1] or lat_w < patch_size[2]:
        raise ValueError(
            f"max_area={max_area} with aspect {image_h}x{image_w} gives an empty latent ({lat_h}x{lat_w}); "
            "raise max_area"
        )
    return lat_h, lat_w, lat_h * vae_stride[1], lat_w * vae_stride[2]


def explicit_size(
    width: int, height: int, vae_stride=VAE_STRIDE, patch_size=PATCH_SIZE
) -> tuple[int, int, int, int]:
    """(lat_h, lat_w, h, w) for an exact output size; both sides must be positive multiples of 16."""
    for name, v, m in (
        ("width", width, vae_stride[2] * patch_size[2]),
        ("height", height, vae_stride[1] * patch_size[1]),
    ):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0 or v % m:
            raise ValueError(f"{name} must be a positive multiple of {m}, got {v!r}")
    return height // vae_stride[1], width // vae_stride[2], int(height), int(width)


def pad_frame_num(frame_num: int) -> int:
    """Smallest 4n+1 >= frame_num (the VAE packs 4 frames per latent after the first)."""
    if frame_num < 1:
        raise ValueError(f"frame_num: expected a positive integer, got {frame_num}")
    return frame_num + (-(frame_num - 1)) % VAE_STRIDE[0]


def frame_num_issue(frame_num: int) -> str | None:
    """None if frame_num is 4n+1; else what upstream does with it and the nearest valid counts.

    Upstream computes lat_f = (F-1)//4 + 1 for the noise but builds the mask from F+3 frames viewed as
    groups of 4, so any other count stops it with a reshape error before sampling.
    """
    s = VAE_STRIDE[0]
    expected = "frame_num: expected a positive integer of the form 4n+1"
    if isinstance(frame_num, bool) or not isinstance(frame_num, (int, np.integer)) or frame_num < 1:
        return f"{expected}, got {frame_num!r}"
    if (frame_num - 1) % s == 0:
        return None
    upper = pad_frame_num(frame_num)
    return (
        f"{expected} (e.g. {upper - s} or {upper}), got {frame_num}; upstream LingBot-World fails on it "
        f"(its first-frame mask of {frame_num + s - 1} frames cannot be split into groups of {s})"
    )


def latent_frames(frame_num: int) -> int:
    """Latent frame count (F-1)//4 + 1 for a 4n+1 pixel frame count; raises ValueError for any other."""
    issue = frame_num_issue(frame_num)
    if issue:
        raise ValueError(issue)
    return (frame_num - 1) // VAE_STRIDE[0] + 1


def seq_len(lat_f: int, lat_h: int, lat_w: int, patch=PATCH_SIZE, sp_size: int = 1) -> int:
    """DiT token count, rounded up to a multiple of the sequence-parallel size (upstream ignores patch[0])."""
    n = lat_f * lat_h * lat_w // (patch[1] * patch[2])
    return int(math.ceil(n / sp_size)) * sp_size


def first_frame_mask(frame_num: int, lat_h: int, lat_w: int, device=None) -> torch.Tensor:
    """[4, lat_f, lat_h, lat_w] float32: 1 where the conditioning image is given (frame 0), else 0."""
    latent_frames(frame_num)  # validates
    msk = torch.ones(1, frame_num, lat_h, lat_w, device=device)
    msk[:, 1:] = 0
    # Frame 0 stands for 4 pixel frames (the VAE's causal first chunk), so it is repeated 4x before folding.
    msk = torch.cat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
    msk = msk.view(1, msk.shape[1] // 4, 4, lat_h, lat_w)
    return msk.transpose(1, 2)[0]


def resolve_seed(seed: int) -> int:
    """Upstream's rule: a negative seed means a random one in [0, sys.maxsize]."""
    return seed if seed >= 0 else random.randint(0, sys.maxsize)


def seed_issue(seed) -> str | None:
    """None for a usable seed (an integer in [0, 2**64)); else what is wrong with it."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        return f"expected an integer in [0, 2**64), got {seed!r}"
    return None


def make_noise(seed: int, lat_f: int, lat_h: int, lat_w: int, device=None) -> torch.Tensor:
    """Initial latent noise fp32 [16, lat_f, lat_h, lat_w] from a generator on `device`, as upstream.

    The values depend on the device's generator: CUDA noise differs from CPU noise for the same seed.
    """
    issue = seed_issue(seed)
    if issue:
        raise ValueError(f"seed: {issue} (use resolve_seed for -1)")
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(int(seed))
    return torch.randn(
        LATENT_CHANNELS, lat_f, lat_h, lat_w, dtype=torch.float32, generator=g, device=device or "cpu"
    )


def vae_input(image: torch.Tensor, frame_num: int, h: int, w: int) -> torch.Tensor:
    """[3, F, h, w] on CPU: the image bicubic-resized to h x w (no clamping, as upstream), then F-1 zero frames."""
    if not isinstance(image, torch.Tensor) or image.dim() != 3 or image.shape[0] != 3:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"image must be a [3, H, W] tensor in [-1, 1], got {shape}")
    latent_frames(frame_num)  # validates
    first = F.interpolate(image[None].cpu(), size=(h, w), mode="bicubic").transpose(0, 1)
    return torch.cat([first, torch.zeros(3, frame_num - 1, h, w, dtype=first.dtype)], dim=1)


def image_to_tensor(image) -> torch.Tensor:
    """PIL image -> float32 [3, H, W] in [-1, 1], bit-identical to TF.to_tensor(img.convert('RGB')).sub_(0.5).div_(0.5)."""
    try:
        rgb = image.convert("RGB")
    except (AttributeError, ValueError, OSError) as e:
        raise ValueError(
            f"image must be a PIL image convertible to RGB, got {type(image).__name__}: {e}"
        ) from e
    if min(rgb.size) < MIN_IMAGE_SIDE:
        raise ValueError(
            f"image must be at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} pixels, got {rgb.size[0]}x{rgb.size[1]} (WxH)"
        )
    arr = torch.from_numpy(np.array(rgb, dtype=np.uint8))  # [H, W, 3]
    return arr.permute(2, 0, 1).contiguous().float().div(255).sub_(0.5).div_(0.5)


def parse_hw(text: str, name: str = "size") -> tuple[int, int]:
    """'480*832' (or 480x832) -> (480, 832), both positive; errors name `name`."""
    try:
        h, w = (int(v) for v in text.lower().replace("x", "*").split("*"))
    except ValueError:
        raise ValueError(f"{name} must look like 480*832, got {text!r}") from None
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return h, w


def parse_max_area(text: str) -> int:
    """'480*832' (or 480x832) -> the pixel budget, as upstream's --size."""
    h, w = parse_hw(text, "max_area")
    return h * w
