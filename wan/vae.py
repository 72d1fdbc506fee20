"""The Wan2.1 video VAE (z = 16, 8x spatial / 4x temporal compression) with causal 3D convolutions.

Module and parameter names follow upstream `Wan2.1_VAE.pth` exactly (`encoder.downsamples.0.residual.2.weight`,
`decoder.head.2.weight`, `conv1.weight`, ...), so its state dict (or ComfyUI's `wan_2.1_vae.safetensors`,
same names) loads without renaming. Upstream runs the VAE in fp32: its wrapper asks for
`autocast(dtype=torch.float)`, which CUDA autocast rejects and disables, so every op runs in the
parameter dtype (fp32 weights). Here the compute dtype is simply the parameter dtype.

Time is streamed the way upstream does it: encode takes the first frame, then 4-frame chunks; decode
takes one latent frame at a time. Every causal conv keeps the last CACHE_T input frames of the
stream in a per-call cache dict, so chunked processing equals one causal conv over the whole
sequence. Memory-saving departures that keep every value equal: spatial resampling runs frame by
frame, norm/SiLU/residual adds work in place, after a temporal upsample the decoder continues in
sub-chunks of `chunk_frames` frames (the cache makes that exact), and decoded chunks are written
into one preallocated output instead of repeated concatenation. Decode can also run in spatial
tiles, each streamed through all frames with its own cache and blended linearly in the overlaps.

A faster, lossy decode is an option (`decode_dtype`): a copy of the decoder in bf16 or fp16 with its conv
weights channels-last (NDHWC, what tensor-core conv kernels read), beside the exact path in the VAE's own
dtype, which stays the default. That copy has opt-in levers (`DecoderLevers`): sub-pixel upsampling and
torch.compile'd blocks.
"""

import math
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import tap_conv
from .devices import channels_last_3d_strides

CACHE_T = 2  # frames of history a k=3 causal conv needs

# Upstream per-channel latent statistics (Wan2_1_VAE): latent = (mu - mean) / std.
LATENT_MEAN = (
    -0.7571,
    -0.7089,
    -0.9113,
    0.1075,
    -0.1745,
    0.9653,
    -0.1517,
    1.5508,
    0.4134,
    -0.0715,
    0.5517,
    -0.3632,
    -0.1922,
    -0.9497,
    0.2503,
    -0.2921,
)
LATENT_STD = (
    2.8184,
    1.4541,
    2.3275,
    2.6558,
    1.2196,
    1.7708,
    2.6052,
    2.0743,
    3.2687,
    2.1526,
    2.8652,
    1.5579,
    1.6382,
    1.1253,
    2.8251,
    1.9160,
)

# Upstream `_video_vae` configuration of Wan2.1_VAE.pth.
WAN21_VAE_CONFIG = dict(
    dim=96,
    z_dim=16,
    dim_mult=(1, 2, 4, 4),
    num_res_blocks=2,
    attn_scales=(),
    temperal_downsample=(False, True, True),
)

SPATIAL_STRIDE = 8
TEMPORAL_STRIDE = 4
DEFAULT_OVERLAP = 16  # latent pixels (128 output pixels) shared by neighbouring decode tiles, ~the decoder's receptive radius
AUTO_SAFETY = 1.25  # headroom over the analytic peak for conv workspaces and allocator fragmentation
# The encode's working memory beside the VAE and its fp32 input video, fitted to the allocated peaks of untiled
# 480p and 720p x 81 encodes of the full-size fp32 VAE on an H200 (within 2 %; the run planner's figure): the
# encoder's chunk activations and causal caches per latent pixel of a tile (at the VAE's dtype), and 2 bytes per
# input element. 'auto' encode tiling picks with this figure, so the tile it picks is one the planner counts.
ENCODE_BYTES_PER_LATENT_PIXEL = 17_690 * SPATIAL_STRIDE**2
ENCODE_BYTES_PER_INPUT_ELEMENT = 2
ENCODE_SAFETY = 1.06  # 'auto' encode tiling's headroom over that measured figure (allocator fragmentation)

# Decode dtypes by the name the front ends take; "fp32" is the exact path (upstream's).
DECODE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Cache = dict  # module -> its streamed state (last input frames); one dict per encode/decode stream


class CausalConv3d(nn.Conv3d):
    """Conv3d padded causally in time (2*pad frames in front, none behind), zero-padded in space.

    With a cache, the front padding is replaced by the previous chunk's last frames, so a stream of
    chunks gives the same result as one causal conv over the concatenated sequence.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.time_pad = 2 * self.padding[0]
        self.space_pad = (0, self.padding[1], self.padding[2])

    def forward(self, x: torch.Tensor, cache: Cache | None = None, pre=None) -> torch.Tensor:
        # `pre` (norm + SiLU) is applied here so its output can be freed before the conv runs.
        if pre is not None:
            x = pre(x)
        if self.time_pad > 0:
            prev = None if cache is None else cache.get(self)
            parts = [x] if prev is None else [prev, x]
            missing = self.time_pad - (0 if prev is None else prev.shape[2])
            if missing > 0:
                zeros = x.new_zeros(*x.shape[:2], missing, *x.shape[3:])
                parts.insert(0, zeros.contiguous(memory_format=_format(x)))
            x = torch.cat(parts, dim=2)
            del parts, prev
            if cache is not None:
                # Zero frames kept here stand for the zero padding the next call would add anyway.
                cache[self] = x[:, :, -CACHE_T:].clone()
        return F.conv3d(x, self.weight, self.bias, self.stride, self.space_pad, self.dilation, self.groups)


class RMS_norm(nn.Module):  # noqa: N801  (upstream name, kept for readers comparing the two)
    """L2-normalise over channels, times sqrt(dim) and a learned gain (upstream `RMS_norm`, no bias)."""

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.normalize(x, dim=1)
        return y.mul_(self.scale).mul_(self.gamma.to(y.dtype))


def _norm_silu(norm: RMS_norm):
    return lambda x: F.silu(norm(x), inplace=True)


def _format(x: torch.Tensor) -> torch.memory_format:
    """channels_last_3d for a 5-D tensor laid out NDHWC (the fast decoder's), else contiguous."""
    cl = x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last_3d)
    return torch.channels_last_3d if cl else torch.contiguous_format


def _per_frame(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply a 2D op to every frame of [b, c, t, h, w] without materialising all frames' temporaries."""
    out = None
    for i in range(x.shape[2]):
        y = fn(x[:, :, i])
        if out is None:
            cl = not y.is_contiguous() and y.is_contiguous(memory_format=torch.channels_last)
            out = torch.empty(
                y.shape[0],
                y.shape[1],
                x.shape[2],
                *y.shape[2:],
                dtype=y.dtype,
                device=y.device,
                memory_format=torch.channels_last_3d if cl else torch.contiguous_format,
            )
        out[:, :, i] = y
        del y
    return out


class Resample(nn.Module):
    """2x spatial (and optionally 2x temporal) up- or downsampling; upstream `Resample`."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        if mode not in ("upsample2d", "upsample3d", "downsample2d", "downsample3d"):
            raise ValueError(f"Resample mode must be up/downsample2d/3d, got {mode!r}")
        self.mode = mode
        if mode.startswith("upsample"):
            # index 0 is upstream's parameter-free nearest-exact Upsample
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim // 2, 3, padding=1))
        else:
            # index 0 is upstream's ZeroPad2d((0, 1, 0, 1))
            self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim, 3, stride=2))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=(0, 0, 0))

    def _spatial(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.resample[1]
        if self.mode.startswith("upsample"):
            # nearest upsampling copies values, so it runs in the tensor's own dtype (upstream's round trip
            # through fp32, its "bfloat16 support" fix, gives the same values)
            return conv(F.interpolate(x, scale_factor=(2.0, 2.0), mode="nearest-exact"))
        return conv(F.pad(x, (0, 1, 0, 1)))

    def forward(self, x: torch.Tensor, cache: Cache, spatial=None) -> torch.Tensor:
        # `spatial`: a replacement for `_spatial` (the fast decoder's sub-pixel upsample), same values
        if self.mode == "upsample3d":
            # The first chunk passes without temporal upsampling (1 latent frame -> 1 frame). Later
            # chunks run the time conv causally over the frames after the first, with zero history
            # at the start (upstream's 'Rep' marker), and interleave its two channel halves in time.
            if self in cache:
                b, c, t, h, w = x.shape
                x = self.time_conv(x, cache)
                x = x.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
            else:
                cache[self] = None
        x = _per_frame(spatial or self._spatial, x)
        if self.mode == "downsample3d":
            # The first chunk's frame passes as is; later chunks see the previous chunk's last frame
            # in front and are halved in time by the stride-2 conv.
            prev = cache.get(self)
            cache[self] = x[:, :, -1:].clone()
            if prev is not None:
                x = self.time_conv(torch.cat([prev, x], dim=2))
        return x


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        # indices as upstream: norm, SiLU, conv, norm, SiLU, Dropout (p=0), conv
        self.residual = nn.Sequential(
            RMS_norm(in_dim, images=False),
            nn.SiLU(),
            CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMS_norm(out_dim, images=False),
            nn.SiLU(),
            nn.Identity(),
            CausalConv3d(out_dim, out_dim, 3, padding=1),
        )
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        r = self.residual
        y = r[2](x, cache, pre=_norm_silu(r[0]))
        y = r[6](y, cache, pre=_norm_silu(r[3]))
        return y.add_(self.shortcut(x))


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMS_norm(dim)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def _frame(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).flatten(2).transpose(1, 2).unsqueeze(1)
        q, k, v = qkv.contiguous().chunk(3, dim=-1)  # [b, 1, h*w, c] each
        del qkv
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.squeeze(1).transpose(1, 2).reshape(b, c, h, w))

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        return _per_frame(self._frame, x).add_(x)


def _run(layers: nn.Sequential, x: torch.Tensor, cache: Cache, levers=None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, cache) if levers is None else levers(layer, x, cache)
    return x


class Encoder3d(nn.Module):
    def __init__(self, dim, z_dim, dim_mult, num_res_blocks, attn_scales, temperal_downsample):
        super().__init__()
        dims = [dim * u for u in (1, *dim_mult)]
        scale = 1.0
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(dim_mult) - 1:
                blocks.append(Resample(out_dim, "downsample3d" if temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.downsamples = nn.Sequential(*blocks)
        self.middle = nn.Sequential(
            ResidualBlock(out_dim, out_dim), AttentionBlock(out_dim), ResidualBlock(out_dim, out_dim)
        )
        self.head = nn.Sequential(
            RMS_norm(out_dim, images=False), nn.SiLU(), CausalConv3d(out_dim, z_dim, 3, padding=1)
        )

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = self.conv1(x, cache)
        x = _run(self.downsamples, x, cache)
        x = _run(self.middle, x, cache)
        return self.head[2](x, cache, pre=_norm_silu(self.head[0]))


class Decoder3d(nn.Module):
    def __init__(self, dim, z_dim, dim_mult, num_res_blocks, attn_scales, temperal_upsample):
        super().__init__()
        dims = [dim * u for u in (dim_mult[-1], *dim_mult[::-1])]
        scale = 1.0 / 2 ** (len(dim_mult) - 2)
        self.conv1 = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(
            ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]), ResidualBlock(dims[0], dims[0])
        )
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                in_dim //= 2  # every Resample halves the channels
            for _ in range(num_res_blocks + 1):
                blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(dim_mult) - 1:
                blocks.append(Resample(out_dim, "upsample3d" if temperal_upsample[i] else "upsample2d"))
                scale *= 2.0
        self.upsamples = nn.Sequential(*blocks)
        self.head = nn.Sequential(
            RMS_norm(out_dim, images=False), nn.SiLU(), CausalConv3d(out_dim, 3, 3, padding=1)
        )
        self.levers = None  # a fast copy's `DecoderLevers` (compiled blocks, sub-pixel upsampling), else None

    def stream(self, x: torch.Tensor, cache: Cache, chunk_frames: int = 2) -> Iterator[torch.Tensor]:
        """Decode one chunk of latent frames, yielding output frames in order, `chunk_frames` at most
        past each temporal upsample (bounds the full-resolution activations)."""
        x = self.conv1(x, cache)
        x = _run(self.middle, x, cache, self.levers)
        yield from self._up(x, 0, cache, chunk_frames)

    def _up(self, x, start, cache, chunk_frames):
        for i in range(start, len(self.upsamples)):
            layer = self.upsamples[i]
            x = layer(x, cache) if self.levers is None else self.levers(layer, x, cache)
            if isinstance(layer, Resample) and layer.mode == "upsample3d" and x.shape[2] > chunk_frames:
                for s in range(0, x.shape[2], chunk_frames):
                    yield from self._up(x[:, :, s : s + chunk_frames], i + 1, cache, chunk_frames)
                return
        if self.levers is not None:
            yield self.levers.head(self.head, x, cache)
        else:
            yield self.head[2](x, cache, pre=_norm_silu(self.head[0]))


# The fast decoder's opt-in levers (`ChunkDecoder(compile=..., subpixel=...)`); the exact decoder never runs them.

# phase a (and b): the 3x3 kernel rows (columns) that land on input rows i-1+a and i+a
_PHASE_TAPS = (((0,), (1, 2)), ((0, 1), (2,)))


def subpixel_weight(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A nearest 2x upsample then a 3x3 conv (padding 1) [out, in, 3, 3] is one 2x2 conv (padding 1) with 4x
    the output channels on the low-resolution input (`subpixel_up`): output pixel (2i+a, 2j+b) reads input
    rows i-1+a, i+a and columns j-1+b, j+b only, so the 3x3 taps landing on one input pixel add up (16
    multiply-adds per output pixel instead of 36). -> (weight [4*out, in, 2, 2] in phase order (a, b), bias
    [4*out]), the sums taken in float64 and returned in fp32."""
    w = weight.double()
    phases = [
        torch.stack(
            [
                torch.stack([w[:, :, list(ru)][:, :, :, list(cv)].sum((2, 3)) for cv in _PHASE_TAPS[b]], -1)
                for ru in _PHASE_TAPS[a]
            ],
            -2,
        )
        for a in (0, 1)
        for b in (0, 1)
    ]
    return torch.cat(phases).float(), None if bias is None else bias.float().repeat(4)


def subpixel_up(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[n, c, h, w] -> [n, out, 2h, 2w]: `conv3x3(nearest_2x(x))` computed as `subpixel_weight`'s 2x2 conv on x
    and its four phases interleaved (in x's memory format)."""
    n, _, h, w = x.shape
    o = F.conv2d(x, weight, bias, padding=1)  # [n, 4*out, h+1, w+1]
    cl = not o.is_contiguous() and o.is_contiguous(memory_format=torch.channels_last)
    o = o.unflatten(1, (2, 2, -1))
    pieces = [[o[:, a, b, :, a : a + h, b : b + w] for b in (0, 1)] for a in (0, 1)]
    if torch.compiler.is_compiling():  # one gather kernel
        return torch.stack([torch.stack(row, -1) for row in pieces], 3).flatten(4, 5).flatten(2, 3)
    fmt = torch.channels_last if cl else torch.contiguous_format
    out = o.new_empty(n, o.shape[3], 2 * h, 2 * w).contiguous(memory_format=fmt)
    for a in (0, 1):
        for b in (0, 1):
            out[:, :, a::2, b::2] = pieces[a][b]
    return out


def _fused_norm_silu(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """RMS_norm (gain = gamma * sqrt(dim), fp32) + SiLU in fp32: one pass when compiled."""
    return F.silu(F.normalize(x.float(), dim=1) * gain).to(x.dtype)


def _next_cache(cache: torch.Tensor, x: torch.Tensor, padded: torch.Tensor | None = None) -> torch.Tensor:
    """The last CACHE_T frames of the cached frames then x (`padded`: those two concatenated, where made). With
    exactly CACHE_T new frames (every sub-chunk past the temporal upsamples) that is x itself, not a copy."""
    if x.shape[2] == CACHE_T:
        return x
    if padded is None:
        padded = torch.cat([cache, x], dim=2)
    # dense: the next call takes it as it is
    return padded[:, :, -CACHE_T:].clone(memory_format=_format(padded))


def _causal_pad(x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cached frames then x, the next cache): what `CausalConv3d` does once its cache exists."""
    padded = torch.cat([cache, x], dim=2)
    return padded, _next_cache(cache, x, padded)


# residual convs with fewer channels run as one 2-D conv over their time taps (`_tap_conv`)
TAP_CONV_BELOW = 128


def _tap_conv(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A residual block's or the head's 3x3x3 conv (padding 0, 1, 1) on its causally padded input
    [1, c, t+2, H, W]. cuDNN's 3-D kernels are slow at the full-resolution stage's 96 channels: an H100 took
    1.90 ms per 2 frames at 464x832, three 2-D convs, one per time tap, summed, 1.42 ms, and one 2-D conv over
    the three taps' frames side by side in the channels (3c in, the taps' weights likewise) 1.05 ms. So a
    channels-last input with fewer than TAP_CONV_BELOW channels goes that way: one GEMM, one rounding. Equal up
    to rounding. Other convs (the head's, whose output channels differ from its input's, and the wider stages')
    take cuDNN's 3-D conv."""
    c = w.shape[0]
    if c >= TAP_CONV_BELOW or c != w.shape[1] or h.stride(1) != 1:
        return F.conv3d(h, w, b, padding=(0, 1, 1))
    frames = h[0].transpose(0, 1)  # [t+2, c, H, W], channels-last
    t = frames.shape[0] - 2
    taps = torch.cat([frames[k : k + t] for k in range(3)], dim=1)  # [t, 3c, H, W]: output frame j's inputs
    weight = torch.cat(w.unbind(2), dim=1).contiguous(memory_format=torch.channels_last)  # [c, 3c, 3, 3]
    y = F.conv2d(taps, weight, b, padding=1)
    return y.unsqueeze(0).transpose(1, 2)  # [1, c, t, H, W] with channels-last-3d's strides, dim 0's included


def _causal_conv(x, cache, w, b) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual block's or the head's causal conv of x after its cache -> (out, the next cache). A weight packed
    by `tap_conv.pack` (`DecoderLevers` packs where `tap_conv.usable`) runs as that Triton kernel, which reads the
    cache and x where they are: no concatenation, no stacked taps."""
    if w.dim() == 2:
        return tap_conv.causal_conv(cache, x, w, b), _next_cache(cache, x)
    h, cache = _causal_pad(x, cache)
    return _tap_conv(h, w, b), cache


def _residual_step(x, c1, c2, g1, w1, b1, g2, w2, b2, ws, bs):
    """`ResidualBlock.forward` with both caches present, as a pure function -> (out, new c1, new c2)."""
    y, c1 = _causal_conv(_fused_norm_silu(x, g1), c1, w1, b1)
    y, c2 = _causal_conv(_fused_norm_silu(y, g2), c2, w2, b2)
    return y + (x if ws is None else F.conv3d(x, ws, bs)), c1, c2


def _upsample_step(x, cache, tw, tb, w, b, subpixel: bool):
    """`Resample.forward` (upsample2d, or upsample3d once its time conv's cache exists) on all frames at once
    -> (out, the time conv's new cache or None)."""
    fmt = _format(x)
    if cache is not None:
        h, cache = _causal_pad(x, cache)
        n, c, t, hh, ww = x.shape
        x = (
            F.conv3d(h, tw, tb)
            .reshape(n, 2, c, t, hh, ww)
            .permute(0, 2, 3, 1, 4, 5)
            .reshape(n, c, 2 * t, hh, ww)
        )
    frames = x[0].transpose(0, 1)  # [t, c, h, w]
    if subpixel:
        y = subpixel_up(frames, w, b)
    else:
        y = F.conv2d(F.interpolate(frames, scale_factor=(2.0, 2.0), mode="nearest-exact"), w, b, padding=1)
    # unsqueeze first: dim 0's stride then is channels-last-3d's, so `DecoderLevers._canonical` copies nothing
    return y.unsqueeze(0).transpose(1, 2).contiguous(memory_format=fmt), cache


def _head_step(x, cache, gain, w, b):
    return _causal_conv(_fused_norm_silu(x, gain), cache, w, b)


def _attention_step(x, gain, w_qkv, b_qkv, w_proj, b_proj, half_scores: bool):
    """`AttentionBlock.forward` as a pure function of x [b, c, t, h, w] and its weights (the 1x1 convs' as [out,
    in]): per frame the RMS norm in fp32, q, k and v, the attention as two GEMMs with the scores in fp32 (`half_scores`:
    as the fp32 output of the half-precision GEMM, `scores_in_fp32`; else from fp32 copies of q and k), the scale and
    the softmax in fp32, the projection and the residual. SDPA's memory-efficient kernel, the only one that takes a
    384-wide head, took 3x as long for one latent frame's 6,032 pixels on an H200 (BENCHMARKS.md)."""
    b, c, t, h, w = x.shape
    frames = x.permute(0, 2, 3, 4, 1).reshape(b * t, h * w, c)
    out = []
    for f in frames.unbind(0):  # one frame's scores at a time, as the block's own per-frame loop
        q, k, v = F.linear((F.normalize(f.float(), dim=-1) * gain).to(x.dtype), w_qkv, b_qkv).chunk(3, dim=-1)
        scores = (
            torch.mm(q, k.t(), out_dtype=torch.float32) if half_scores else torch.mm(q.float(), k.float().t())
        )
        p = torch.softmax(scores * c**-0.5, dim=-1).to(x.dtype)
        out.append(F.linear(p @ v, w_proj, b_proj))
    y = torch.stack(out).view(b, t, h, w, c).permute(0, 4, 1, 2, 3)  # channels-last-3d strides
    return (y + x).contiguous(memory_format=_format(x))


def scores_in_fp32(x: torch.Tensor) -> bool:
    """Whether a half-precision GEMM on x's device writes fp32 out (`torch.mm`'s `out_dtype`: CUDA, torch 2.8+)."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and torch.version.hip is None):
        return False
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def _call_step(step, *args):
    return step(*args)


def decoder_runner(device):
    """The compiled runner of the decoder steps shared by every fast decoder of the process, or None (eager)
    with one log line when the compiler is unavailable on `device`."""
    from .speed import shared_runner

    return shared_runner(_call_step, device, what="the VAE decoder")


def _matrix(conv: nn.Conv2d) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1x1 conv's weight as an [out, in] matrix, and its bias."""
    return conv.weight.reshape(conv.weight.shape[0], -1), conv.bias


class DecoderLevers:
    """Speed levers of a fast decoder copy (`WanVAE.decoder_in`), called by `Decoder3d` in place of each
    layer of `middle` and `upsamples` and of the head.

    subpixel: each upsample's nearest 2x + 3x3 conv as the equal 2x2 sub-pixel conv (`subpixel_up`), its
    weights folded from the VAE's own (`source`) in float64 before the cast: 16 multiply-adds per output
    pixel instead of 36, and the 4x upsampled input is never made. Equal up to rounding.
    compile: the residual blocks, the upsamples and the head run as torch.compile'd pure functions of their
    input, causal caches and weights that return the new caches (`_residual_step`, `_upsample_step`,
    `_head_step`): each RMS norm + SiLU (in fp32) and the cache concatenation become one pass before the
    conv instead of about seven; with channels-last weights the full-resolution stage's convs run as one 2-D
    conv over their time taps stacked in the channels (`_tap_conv`); on a Hopper GPU that stage's convs and
    the head's run as `tap_conv`'s kernel instead (no concatenation), their weights packed here once; the
    middle's attention runs as two GEMMs with fp32 scores (`_attention_step`). A
    stream's first latent frame (no caches yet, 1 frame per stage) runs eagerly; from the second on every call
    has the same shapes and strides (one graph per block shape and frame size, about 10, compiled during the
    first chunk, none after). The upsamples then run all of a sub-chunk's frames at once instead of frame by
    frame (without subpixel, the 2x input of 2 frames instead of 1 at a time).
    """

    def __init__(self, decoder: Decoder3d, source: Decoder3d | None, runner):
        self.runner = runner
        dtype = decoder.conv1.weight.dtype
        cl = not decoder.conv1.weight.is_contiguous()  # channels-last weights: channels-last activations
        self.fmt = torch.channels_last_3d if cl else torch.contiguous_format
        self.gains = {m: m.gamma.float() * m.scale for m in decoder.modules() if isinstance(m, RMS_norm)}
        self.spatial = {}  # upsampling Resample -> its sub-pixel conv (weight, bias)
        # compiled attention blocks -> their norm's gain [c], 1x1 convs' weights as [out, in] with biases, and
        # whether the scores come as the fp32 output of the half-precision GEMM
        self.attention = {
            m: (
                self.gains[m.norm].flatten(),
                *_matrix(m.to_qkv),
                *_matrix(m.proj),
                scores_in_fp32(m.proj.weight),
            )
            for m in decoder.modules()
            if isinstance(m, AttentionBlock) and runner is not None
        }
        # compiled residual and head convs that run as `tap_conv`'s kernel -> their packed weights
        self.packed = {}
        if runner is not None:
            convs = [decoder.head[2]]
            for m in decoder.modules():
                if isinstance(m, ResidualBlock):
                    convs += [m.residual[2], m.residual[6]]
            self.packed = {conv: tap_conv.pack(conv.weight) for conv in convs if tap_conv.usable(conv.weight)}
        if source is not None:
            for m, src in zip(decoder.modules(), source.modules(), strict=True):
                if isinstance(m, Resample) and m.mode.startswith("upsample"):
                    device = m.resample[1].weight.device
                    w, b = subpixel_weight(src.resample[1].weight, src.resample[1].bias)
                    w = w.to(device, dtype).contiguous(
                        memory_format=torch.channels_last if cl else torch.contiguous_format
                    )
                    self.spatial[m] = (w, None if b is None else b.to(device, dtype))

    def _run(self, step, *args):
        # graphs are keyed by exact strides, size-1 dims' included: every 5-D tensor goes in with the strides
        # `fmt` gives its sizes (a sub-chunk or a cache is a strided view), so each block shape has one graph
        args = [self._canonical(a) if isinstance(a, torch.Tensor) and a.dim() == 5 else a for a in args]
        return self.runner(step, *args)

    def _canonical(self, a: torch.Tensor) -> torch.Tensor:
        _, c, t, h, w = a.shape
        cl = self.fmt == torch.channels_last_3d
        want = channels_last_3d_strides(a.shape) if cl else (c * t * h * w, t * h * w, h * w, w, 1)
        if a.stride() == want:
            return a
        if all(s == z or size == 1 for s, z, size in zip(a.stride(), want, a.shape, strict=True)):
            # a sub-chunk's view, off only in size-1 dims: the same elements, no copy
            return a.as_strided(a.shape, want)
        return a.clone(memory_format=self.fmt)

    def __call__(self, layer: nn.Module, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        if isinstance(layer, ResidualBlock):
            r, sc = layer.residual, layer.shortcut
            if self.runner is None or r[2] not in cache:
                return layer(x, cache)
            g1, g2 = self.gains[r[0]], self.gains[r[3]]
            ws, bs = getattr(sc, "weight", None), getattr(sc, "bias", None)
            args = (
                x,
                cache[r[2]],
                cache[r[6]],
                g1,
                self.packed.get(r[2], r[2].weight),
                r[2].bias,
                g2,
                self.packed.get(r[6], r[6].weight),
                r[6].bias,
                ws,
                bs,
            )
            y, cache[r[2]], cache[r[6]] = self._run(_residual_step, *args)
            return y
        if isinstance(layer, Resample):
            sub, tc = self.spatial.get(layer), getattr(layer, "time_conv", None)
            if self.runner is not None and (tc is None or tc in cache):
                w, b = sub or (layer.resample[1].weight, layer.resample[1].bias)
                if tc is None:
                    return self._run(_upsample_step, x, None, None, None, w, b, sub is not None)[0]
                y, cache[tc] = self._run(
                    _upsample_step, x, cache[tc], tc.weight, tc.bias, w, b, sub is not None
                )
                return y
            return layer(x, cache, None if sub is None else lambda f: subpixel_up(f, *sub))
        if layer in self.attention:
            return self._run(_attention_step, x, *self.attention[layer])
        return layer(x, cache)

    def head(self, head: nn.Sequential, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        conv = head[2]
        if self.runner is None or conv not in cache:
            return conv(x, cache, pre=_norm_silu(head[0]))
        weight = self.packed.get(conv, conv.weight)
        y, cache[conv] = self._run(_head_step, x, cache[conv], self.gains[head[0]], weight, conv.bias)
        return y


def latent_stats(device, mean=LATENT_MEAN, std=LATENT_STD) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, std), float32 [z, 1, 1, 1] on `device` (the Wan2.1 VAE's by default)."""
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1, 1)  # noqa: E731
    return as_tensor(mean), as_tensor(std)


def normalize_latent(mu: torch.Tensor, mean=LATENT_MEAN, std=LATENT_STD) -> torch.Tensor:
    """Encoder mean -> upstream's normalised latent, (mu - mean) * (1 / std) in fp32 as upstream rounds it."""
    m, s = latent_stats(mu.device, mean, std)
    return ((mu - m) * (1.0 / s)).float()


def to_comfy_latent(latent: torch.Tensor, mean=LATENT_MEAN, std=LATENT_STD) -> torch.Tensor:
    """Normalised [16, T, h, w] -> ComfyUI's un-normalised Wan2.1 LATENT samples [1, 16, T, h, w]."""
    m, s = latent_stats(latent.device, mean, std)
    return (latent.float() * s + m)[None]


def from_comfy_latent(samples: torch.Tensor, mean=LATENT_MEAN, std=LATENT_STD) -> torch.Tensor:
    """ComfyUI's un-normalised [16, T, h, w] -> normalised, as `WanVAE.decode` takes it."""
    m, s = latent_stats(samples.device, mean, std)
    return (samples.float() - m) / s


class WanVAE(nn.Module):
    """Upstream `WanVAE_` with Wan2_1_VAE's encode/decode (normalised latents, clamped output)."""

    def __init__(
        self,
        dim: int = 96,
        z_dim: int = 16,
        dim_mult=(1, 2, 4, 4),
        num_res_blocks: int = 2,
        attn_scales=(),
        temperal_downsample=(False, True, True),
        latent_mean=LATENT_MEAN,
        latent_std=LATENT_STD,
    ):
        super().__init__()
        if len(latent_mean) != z_dim or len(latent_std) != z_dim:
            raise ValueError(
                f"latent_mean/latent_std need {z_dim} values (z_dim), got {len(latent_mean)}/{len(latent_std)}"
            )
        self.z_dim = z_dim
        self.latent_mean = tuple(latent_mean)
        self.latent_std = tuple(latent_std)
        self.encoder = Encoder3d(dim, z_dim * 2, dim_mult, num_res_blocks, attn_scales, temperal_downsample)
        self.conv1 = CausalConv3d(z_dim * 2, z_dim * 2, 1)
        self.conv2 = CausalConv3d(z_dim, z_dim, 1)
        self._decoder_args = (
            dim,
            z_dim,
            dim_mult,
            num_res_blocks,
            attn_scales,
            tuple(temperal_downsample)[::-1],
        )
        self.decoder = Decoder3d(*self._decoder_args)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.conv1.weight.device

    def decoder_in(
        self, dtype: torch.dtype, channels_last: bool = True, compile: bool = False, subpixel: bool = False
    ) -> Decoder3d:
        """A copy of the decoder in `dtype` on the VAE's device (its conv weights channels-last if asked), for
        the fast, lossy decode; the VAE keeps its own. Built on the meta device and given the cast weights,
        so no second full-precision copy is made. `compile`, `subpixel`: its `DecoderLevers`."""
        with torch.device("meta"):
            decoder = Decoder3d(*self._decoder_args)
        state = {}
        for k, v in self.decoder.state_dict().items():
            v = v.to(dtype)
            if channels_last and v.dim() in (4, 5) and k.endswith("weight"):
                v = v.contiguous(
                    memory_format=torch.channels_last if v.dim() == 4 else torch.channels_last_3d
                )
            state[k] = v
        decoder.load_state_dict(state, strict=True, assign=True)
        if compile or subpixel:
            runner = decoder_runner(self.device) if compile else None
            decoder.levers = DecoderLevers(decoder, self.decoder if subpixel else None, runner)
        return decoder.eval().requires_grad_(False)

    def latent_stats(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel (mean, std), float32 [z, 1, 1, 1] on `device`: normalised latent = (mu - mean) / std."""
        return latent_stats(device, self.latent_mean, self.latent_std)

    def _stats(self, device):
        """(mean, 1 / std): upstream scales by the reciprocal, which rounds differently from dividing."""
        mean, std = self.latent_stats(device)
        return mean, 1.0 / std

    def to_comfy_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return to_comfy_latent(latent, self.latent_mean, self.latent_std)

    def from_comfy_latent(self, samples: torch.Tensor) -> torch.Tensor:
        return from_comfy_latent(samples, self.latent_mean, self.latent_std)

    @torch.no_grad()
    def encode(self, video: torch.Tensor, tile=None, overlap: int = DEFAULT_OVERLAP) -> torch.Tensor:
        """[3, F, H, W] in [-1, 1], F = 4n+1, H and W multiples of 8 -> normalised latent [z, n+1, H/8, W/8] fp32.

        tile: None (whole frame), 'auto' (from free VRAM; whole frame on CPU) or (tile_h, tile_w) in
        latent pixels (8 video pixels each); neighbouring tiles share `overlap` latent pixels, blended
        linearly in the latent. Each tile streams through all frames with its own cache and only its
        pixels are moved to the device. Untiled (one tile) gives exactly today's result.
        """
        check_video(video)
        s = SPATIAL_STRIDE
        h, w = video.shape[2] // s, video.shape[3] // s
        if tile == "auto":
            tile = pick_encode_tile(video.shape[1], h, w, free_vram(self.device), overlap, self.dtype)
        if tile is None:
            return normalize_latent(self._encode_tile(video)[0], self.latent_mean, self.latent_std)
        check_tile(tile, overlap)
        ys, xs = tile_spans(h, tile[0], overlap), tile_spans(w, tile[1], overlap)
        if len(ys) * len(xs) == 1:
            return normalize_latent(self._encode_tile(video)[0], self.latent_mean, self.latent_std)
        t = (video.shape[1] - 1) // TEMPORAL_STRIDE + 1
        mu = torch.zeros(self.z_dim, t, h, w, dtype=torch.float32, device=self.device)
        weight_sum = torch.zeros(h, w, dtype=torch.float32, device=self.device)
        for iy, (y0, y1) in enumerate(ys):
            for ix, (x0, x1) in enumerate(xs):
                wmap = torch.outer(_ramp(ys, iy, 1), _ramp(xs, ix, 1)).to(self.device)
                weight_sum[y0:y1, x0:x1] += wmap
                part = self._encode_tile(video[:, :, y0 * s : y1 * s, x0 * s : x1 * s])[0]
                mu[:, :, y0:y1, x0:x1] += part.float().mul_(wmap)
                del part
        mu /= weight_sum
        return normalize_latent(mu.to(self.dtype), self.latent_mean, self.latent_std)

    def _encode_tile(self, video: torch.Tensor) -> torch.Tensor:
        """[3, F, H, W] -> unnormalised mu [1, z, n+1, H/8, W/8] in the model dtype, one causal stream."""
        x = video.to(self.device, self.dtype).unsqueeze(0)
        cache: Cache = {}
        # first frame alone, then 4-frame chunks, each giving one latent frame
        chunks = [self.encoder(x[:, :, :1], cache)]
        for s in range(1, x.shape[2], TEMPORAL_STRIDE):
            chunks.append(self.encoder(x[:, :, s : s + TEMPORAL_STRIDE], cache))
        del cache, x
        mu = self.conv1(torch.cat(chunks, dim=2))[:, : self.z_dim]
        del chunks
        return mu

    @torch.no_grad()
    def decode(
        self,
        latent: torch.Tensor,
        tile=None,
        overlap: int = DEFAULT_OVERLAP,
        chunk_frames: int = 2,
        out_device=None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Normalised latent [z, T, h, w] -> video [3, 4(T-1)+1, 8h, 8w] fp32 clamped to [-1, 1].

        tile: None (whole frame), 'auto' (from free VRAM; whole frame on CPU) or (tile_h, tile_w) in
        latent pixels; neighbouring tiles share `overlap` latent pixels, blended linearly. Each tile
        streams through all frames with its own cache. out_device: where the video is assembled
        (default: the model's device). dtype: the fast decoder's (see `ChunkDecoder`); None: exact.
        """
        with self.chunk_decoder(tile, overlap, chunk_frames, out_device, dtype) as decoder:
            return decoder.decode(latent, last=True)

    def chunk_decoder(self, *args, **kwargs) -> "ChunkDecoder":
        """`ChunkDecoder(self, *args, **kwargs)`: decodes a latent handed over in consecutive pieces of latent
        frames (the causal caches carried between them), the concatenated output equal to one `decode`."""
        return ChunkDecoder(self, *args, **kwargs)

    def decode_bytes_per_latent_pixel(self, chunk_frames: int = 2, dtype: torch.dtype | None = None) -> int:
        """Analytic peak decode memory per latent pixel of a tile (model dtype, output buffer excluded).

        All terms scale with the tile area: every cached causal conv keeps CACHE_T input frames at
        its resolution for the whole stream; the widest conv holds its input (c frames), the
        cache-padded input (c + 2), its output (c) and the new cache (2); and each temporal upsample
        whose output is split into sub-chunks stays alive while they run (c = chunk_frames).
        Full Wan2.1 config, c = 2: 151,328 cache + 61,440 activation elements (~0.85 MB fp32). dtype: the
        decoder's (the fast decoder's; default the model's): every term scales with its size.
        """
        dec = self.decoder
        cache_elems = held = peak = 0
        area, frames = 1, 1
        for block in (dec.conv1, *dec.middle, *dec.upsamples, dec.head):
            for m in block.modules():
                if isinstance(m, CausalConv3d) and m.time_pad > 0:
                    cache_elems += CACHE_T * m.in_channels * area
                    peak = max(peak, m.in_channels * area)
            if isinstance(block, Resample):
                area *= 4
                if block.mode == "upsample3d":
                    frames *= 2
                    if frames > chunk_frames:
                        held += frames * block.resample[1].out_channels * area
                        frames = chunk_frames
        act_elems = (3 * min(chunk_frames, frames) + CACHE_T) * peak + held
        return (cache_elems + act_elems) * (dtype or self.dtype).itemsize


class ChunkDecoder:
    """Decodes one latent handed over in consecutive pieces of latent frames, as a causal stream.

    Each call takes the next latent frames [z, n, h, w] (any n >= 1; LingBot-World-Fast hands over
    3 per chunk) and returns their video frames: 4(n-1)+1 for the first call, 4n after it, so chunks
    of 3 give 9, 12, 12, ... frames. Every tile keeps its causal-conv cache between calls, so the
    concatenated output equals `WanVAE.decode` of the whole latent with the same tile settings,
    bit for bit. The tile grid ('auto' included) is fixed by the first call and every later call
    must have the same h, w. `close()` (or leaving a `with` block) frees the caches. `stream` hands the
    same frames out latent frame by latent frame (1 frame, then 4 each), as soon as each is decoded.

    dtype: None decodes with the VAE's own decoder (exact); another dtype (bf16, fp16) with a copy of
    the decoder in it, channels-last unless `channels_last` is False (faster on tensor cores, lossy).
    The latent's de-normalisation and `conv2` run in the VAE's dtype either way; frames come out fp32.
    compile, subpixel: the fast decoder's `DecoderLevers` (torch.compile'd blocks; sub-pixel upsampling),
    off by default; they need a `dtype` (the exact decoder has none).
    """

    def __init__(
        self,
        vae: WanVAE,
        tile=None,
        overlap: int = DEFAULT_OVERLAP,
        chunk_frames: int = 2,
        out_device=None,
        dtype: torch.dtype | None = None,
        channels_last: bool = True,
        compile: bool = False,
        subpixel: bool = False,
    ):
        if (compile or subpixel) and dtype is None:
            raise ValueError(
                "ChunkDecoder: compile and subpixel are levers of the fast decoder; they need a dtype"
            )
        if not isinstance(chunk_frames, int) or chunk_frames < 1:
            raise ValueError(f"chunk_frames must be an int >= 1, got {chunk_frames!r}")
        if tile is not None and tile != "auto":
            check_tile(tile, overlap)
        if dtype is not None and dtype not in DECODE_DTYPES.values():
            raise ValueError(
                f"decode dtype must be one of {', '.join(map(str, DECODE_DTYPES.values()))}, got {dtype}"
            )
        self.vae, self.tile, self.overlap, self.chunk_frames = vae, tile, overlap, chunk_frames
        self.out_device = torch.device(out_device) if out_device is not None else vae.device
        exact = dtype is None or (dtype == vae.dtype and not (channels_last or compile or subpixel))
        self.dtype = vae.dtype if exact else dtype
        self.decoder = vae.decoder if exact else vae.decoder_in(dtype, channels_last, compile, subpixel)
        self.channels_last = not exact and channels_last
        self.latent_frames = 0  # latent frames decoded so far
        self.frames = 0  # video frames returned so far
        self.closed = False
        self._size = None  # (h, w) of the latent, fixed by the first call
        self._tiles = []  # [((y0, y1), (x0, x1), wmap or None, cache)] per tile
        self._weight_sum = None

    def __enter__(self) -> "ChunkDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free the caches (and a fast decoder's weights); the decoder takes no more chunks."""
        self._tiles, self._weight_sum, self.closed, self.decoder = [], None, True, None

    def _plan(self, h: int, w: int, frames: int) -> None:
        vae, tile, s = self.vae, self.tile, SPATIAL_STRIDE
        if tile == "auto":
            budget = free_vram(vae.device)
            if budget is not None and self.out_device == vae.device:
                budget -= 3 * frames * h * w * s**2 * 4  # the fp32 output video
            bpp = vae.decode_bytes_per_latent_pixel(self.chunk_frames, self.dtype)
            tile = pick_tile(vae, h, w, budget, self.overlap, self.chunk_frames, bytes_per_pixel=bpp)
        if tile is None:
            ys, xs = [(0, h)], [(0, w)]
        else:
            check_tile(tile, self.overlap)
            ys, xs = tile_spans(h, tile[0], self.overlap), tile_spans(w, tile[1], self.overlap)
        self.tile, self._size = tile, (h, w)
        if len(ys) * len(xs) > 1:
            self._weight_sum = torch.zeros(h * s, w * s, dtype=torch.float32, device=self.out_device)
        for iy, span_y in enumerate(ys):
            for ix, span_x in enumerate(xs):
                wmap = None
                if self._weight_sum is not None:
                    wmap = torch.outer(_ramp(ys, iy, s), _ramp(xs, ix, s)).to(self.out_device)
                    self._weight_sum[span_y[0] * s : span_y[1] * s, span_x[0] * s : span_x[1] * s] += wmap
                self._tiles.append((span_y, span_x, wmap, {}))

    def _start(self, latent: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Check the next latent frames; -> (the decoder's input [1, z, n, h, w], video frames they give)."""
        if self.closed:
            raise ValueError("ChunkDecoder.decode: the decoder is closed (start a new chunk_decoder)")
        vae = self.vae
        check_latent(latent, vae.z_dim)
        n, h, w = latent.shape[1:]
        first = self._size is None
        frames = TEMPORAL_STRIDE * n - (TEMPORAL_STRIDE - 1 if first else 0)
        if first:
            self._plan(h, w, frames)
        elif (h, w) != self._size:
            raise ValueError(
                f"ChunkDecoder.decode: latent chunk is {h}x{w} latent pixels but the stream started at "
                f"{self._size[0]}x{self._size[1]}; every chunk of one video has the same size"
            )
        mean, inv_std = vae._stats(latent.device)
        z = vae.conv2((latent.float() / inv_std + mean).to(vae.device, vae.dtype).unsqueeze(0))
        if self.dtype != vae.dtype:
            z = z.to(
                self.dtype,
                memory_format=torch.channels_last_3d if self.channels_last else torch.preserve_format,
            )
        return z, frames

    def _tile_frames(self, z: torch.Tensor, t: int, tile, part: torch.Tensor, f: int) -> int:
        """Stream latent frame t of one tile through its cache into `part` (the tile's view of the output)
        from frame f on (weighted, added, when tiles blend); -> the next frame index."""
        (y0, y1), (x0, x1), wmap, cache = tile
        for piece in self.decoder.stream(z[:, :, t : t + 1, y0:y1, x0:x1], cache, self.chunk_frames):
            k = piece.shape[2]
            piece = piece[0].to(part.device, torch.float32)
            if wmap is None:
                part[:, f : f + k] = piece
            else:
                part[:, f : f + k] += piece.mul_(wmap)
            f += k
            del piece
        return f

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self._weight_sum is not None:
            out /= self._weight_sum
        return out.clamp_(-1, 1)

    def _view(self, out: torch.Tensor, tile) -> torch.Tensor:
        (y0, y1), (x0, x1), *_ = tile
        s = SPATIAL_STRIDE
        return out[..., y0 * s : y1 * s, x0 * s : x1 * s]

    def _output(self, frames: int) -> torch.Tensor:
        h, w = self._size
        s = SPATIAL_STRIDE
        return torch.zeros(3, frames, h * s, w * s, dtype=torch.float32, device=self.out_device)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, last: bool = False) -> torch.Tensor:
        """The next normalised latent frames [z, n, h, w] -> their video frames [3, F, 8h, 8w] fp32 in
        [-1, 1], F = 4(n-1)+1 on the first call and 4n after it. `last`: no chunk follows, so each tile's
        cache is freed as soon as the tile is done (one tile's cache alive at a time, not all of them) and
        the decoder closes."""
        z, frames = self._start(latent)
        n = latent.shape[1]
        out = self._output(frames)
        for tile in self._tiles:
            part, f = self._view(out, tile), 0
            for t in range(n):
                f = self._tile_frames(z, t, tile, part, f)
            if f != frames:  # the decoder's temporal upsampling is what gives 4 frames per latent frame
                raise RuntimeError(
                    f"ChunkDecoder: decoder gave {f} frames for {n} latent frames, expected {frames}"
                )
            if last:
                tile[3].clear()
        del z
        self.latent_frames += n
        self.frames += frames
        out = self._finish(out)
        if last:
            self.close()
        return out

    @torch.no_grad()
    def stream(self, latent: torch.Tensor) -> Iterator[torch.Tensor]:
        """Like `decode`, but hands the frames out per latent frame as each is decoded (every tile's part
        of it): [3, 1, 8h, 8w] for the stream's very first latent frame, [3, 4, 8h, 8w] for each after.
        Concatenated they equal `decode`'s result bit for bit (each tile's cache streams the same frames
        in the same order). Stop iterating early and the stream is left mid-chunk: close it."""
        z, _ = self._start(latent)
        for t in range(latent.shape[1]):
            frames = 1 if self.latent_frames == 0 else TEMPORAL_STRIDE
            out = self._output(frames)
            for tile in self._tiles:
                if self._tile_frames(z, t, tile, self._view(out, tile), 0) != frames:
                    raise RuntimeError(
                        f"ChunkDecoder: decoder did not give {frames} frames for a latent frame"
                    )
            self.latent_frames += 1
            self.frames += frames
            yield self._finish(out)


def decoder_levers(dtype: torch.dtype | None, compile: bool) -> dict:
    """The `ChunkDecoder` levers a front end's compile switch turns on: for the fast decoder (a `dtype`)
    compiled blocks with sub-pixel upsampling (compiled, its arithmetic differs from the eager fast decoder's
    anyway); none for the exact decoder (None), which stays exact."""
    return {"compile": True, "subpixel": True} if compile and dtype is not None else {}


def decode_dtype(name: str, device) -> torch.dtype | None:
    """The decode a front end's name asks for: None for 'fp32' (the exact decode, the VAE's own decoder),
    else the fast decoder's dtype; ValueError (naming `vae_dtype` and the fallback) where `device` lacks it.
    Both run on the CPU too, slowly: the speed is for GPU tensor cores."""
    if name not in DECODE_DTYPES:
        raise ValueError(f"vae_dtype: expected one of {', '.join(DECODE_DTYPES)}, got {name!r}")
    device = torch.device(device)
    if (
        name == "bf16"
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ValueError(
            f"vae_dtype: {torch.cuda.get_device_name(device)} has no bf16 (it needs an Ampere or newer GPU); "
            "use fp16 (as fast, same memory) or fp32"
        )
    return None if name == "fp32" else DECODE_DTYPES[name]


def _ramp(spans: list[tuple[int, int]], i: int, s: int) -> torch.Tensor:
    """1D blend weights (output pixels) of tile i: linear over each overlap with a neighbour, else 1."""
    a, b = spans[i]
    pos = torch.arange(a * s, b * s, dtype=torch.float32) + 0.5
    w = torch.ones_like(pos)
    if i > 0 and spans[i - 1][1] > a:  # overlap with the previous tile: [a, prev_end)
        w = torch.minimum(w, (pos - a * s) / ((spans[i - 1][1] - a) * s))
    if i + 1 < len(spans) and spans[i + 1][0] < b:  # overlap with the next tile: [next_start, b)
        w = torch.minimum(w, (b * s - pos) / ((b - spans[i + 1][0]) * s))
    return w


def tile_spans(size: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """Evenly spread [start, end) windows of `tile` covering `size`, neighbours sharing >= `overlap`."""
    if tile >= size:
        return [(0, size)]
    n = math.ceil((size - overlap) / (tile - overlap))
    starts = [round(i * (size - tile) / (n - 1)) for i in range(n)]
    return [(s, s + tile) for s in starts]


def free_vram(device) -> int | None:
    """Bytes this process can still allocate on a CUDA device (None on CPU): free memory plus the
    allocator's unused reserve, bounded by torch.cuda.set_per_process_memory_fraction if set."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:  # the fraction getter needs an explicit index
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    avail = free + torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        avail = min(avail, int(get_fraction(device) * total) - allocated)
    return max(avail, 0)


def pick_tile(
    vae: WanVAE,
    h: int,
    w: int,
    budget: int | None,
    overlap: int = DEFAULT_OVERLAP,
    chunk_frames: int = 2,
    bytes_per_pixel: int | None = None,
    what: str = "decode",
    safety: float = AUTO_SAFETY,
):
    """(tile_h, tile_w) latent pixels whose estimated decode peak (times `safety`) fits `budget` bytes,
    choosing the tile grid that decodes the least total area; None when the whole frame fits or no budget is
    known (CPU). If nothing fits, the smallest sensible tile (2*overlap + 8) is returned with a warning.
    `bytes_per_pixel` replaces the decode estimate (`pick_encode_tile` passes the encode's).
    """
    if budget is None:
        return None
    if bytes_per_pixel is None:
        bytes_per_pixel = vae.decode_bytes_per_latent_pixel(chunk_frames)
    area = max(budget, 0) / (bytes_per_pixel * safety)
    if h * w <= area:
        return None

    def side(size, n):  # tile length that covers `size` with n tiles sharing `overlap`
        return size if n == 1 else math.ceil((size + (n - 1) * overlap) / n)

    smallest = 2 * overlap + 8  # below this a tile is mostly overlap
    best = None
    for ny in range(1, h + 1):
        th = side(h, ny)
        if ny > 1 and th < smallest:
            break
        for nx in range(1, w + 1):
            tw = side(w, nx)
            if nx > 1 and tw < smallest:
                break
            if th * tw <= area:  # more columns would only add overlap work
                if best is None or ny * nx * th * tw < best[0]:
                    best = (ny * nx * th * tw, th, tw)
                break
    if best is None:
        smallest = (min(h, 2 * overlap + 8), min(w, 2 * overlap + 8))
        warnings.warn(
            f"VAE {what}: {budget / 2**30:.1f} GiB free is below the estimate even for tile {smallest}",
            stacklevel=2,
        )
        return smallest
    return best[1], best[2]


def encode_work_bytes(frames: int, h: int, w: int, tile, dtype: torch.dtype = torch.float32) -> int:
    """Peak bytes an encode of a [3, frames, 8h, 8w] video holds beside the VAE and the video itself (the
    measured ENCODE_BYTES_* figure): the encoder's activations and caches over one tile (`tile` (tile_h,
    tile_w) latent pixels; None: the whole frame) and, tiled, the fp32 latent accumulator, its weight sum and
    one tile's latent and weighted copy. One figure for 'auto' tiling and the run planner."""
    z, t = WAN21_VAE_CONFIG["z_dim"], (frames - 1) // TEMPORAL_STRIDE + 1
    area = h * w if tile is None else min(tile[0], h) * min(tile[1], w)
    work = ENCODE_BYTES_PER_INPUT_ELEMENT * 3 * frames * h * w * SPATIAL_STRIDE**2
    work += ENCODE_BYTES_PER_LATENT_PIXEL * dtype.itemsize // 4 * area
    if tile is not None:
        work += 4 * (z * t * h * w + h * w + 2 * z * t * area + area)
    return work


def pick_encode_tile(
    frames: int, h: int, w: int, budget: int | None, overlap: int = DEFAULT_OVERLAP, dtype=torch.float32
):
    """The tile 'auto' encodes a [3, frames, 8h, 8w] video with, `budget` bytes free beside the VAE and the
    video (None: untiled): `pick_tile` on `encode_work_bytes`, so the tile's figure fits the budget wherever
    the smallest tile's does."""
    if budget is None:
        return None
    fixed = encode_work_bytes(frames, h, w, (0, 0), dtype)  # what a tiled encode holds whatever the tile
    per_pixel = encode_work_bytes(frames, h, w, (1, 1), dtype) - fixed
    return pick_tile(
        None, h, w, budget - fixed, overlap, bytes_per_pixel=per_pixel, what="encode", safety=ENCODE_SAFETY
    )


def check_tile(tile, overlap: int) -> None:
    ok = (
        isinstance(tile, (tuple, list))
        and len(tile) == 2
        and all(isinstance(t, int) and t >= 2 for t in tile)
    )
    if not ok:
        raise ValueError(f"tile must be None, 'auto' or (tile_h, tile_w) latent pixels >= 2, got {tile!r}")
    if not isinstance(overlap, int) or not 0 <= overlap < min(tile):
        raise ValueError(
            f"overlap must be an int in [0, min(tile)) latent pixels, got {overlap!r} for tile {tuple(tile)}"
        )


def check_video(video) -> None:
    if not isinstance(video, torch.Tensor):
        raise ValueError(f"video must be a torch.Tensor [3, F, H, W], got {type(video).__name__}")
    if video.dim() != 4 or video.shape[0] != 3:
        raise ValueError(f"video must be [3, F, H, W] (3 RGB channels first), got shape {list(video.shape)}")
    frames, height, width = video.shape[1:]
    if (frames - 1) % TEMPORAL_STRIDE:
        raise ValueError(f"video frame count must be 4n+1 (1, 5, 9, ..., 81), got {frames}")
    for name, v in (("height", height), ("width", width)):
        if v % SPATIAL_STRIDE or v < 2 * SPATIAL_STRIDE:
            raise ValueError(f"video {name} must be a multiple of 8 and at least 16, got {v}")
    if not video.is_floating_point():
        raise ValueError(f"video must be a float tensor in [-1, 1], got dtype {video.dtype}")
    if not torch.isfinite(video).all():
        raise ValueError("video contains NaN or Inf values")


def check_latent(latent, z_dim: int) -> None:
    if not isinstance(latent, torch.Tensor):
        raise ValueError(f"latent must be a torch.Tensor [{z_dim}, T, h, w], got {type(latent).__name__}")
    if latent.dim() != 4 or latent.shape[0] != z_dim:
        raise ValueError(
            f"latent must be [{z_dim}, T, h, w] (Wan2.1 VAE, z_dim {z_dim}), got shape {list(latent.shape)}"
        )
    if min(latent.shape[1:]) < 1 or min(latent.shape[2:]) < 2:
        raise ValueError(f"latent needs T >= 1 and h, w >= 2, got shape {list(latent.shape)}")
    if not latent.is_floating_point():
        raise ValueError(f"latent must be a float tensor, got dtype {latent.dtype}")
    if not torch.isfinite(latent).all():
        raise ValueError("latent contains NaN or Inf values")


def init_random_(vae: nn.Module, seed: int = 0) -> nn.Module:
    """Seeded random weights for tests, benchmarks and the demo (real use loads a checkpoint): conv weights
    with std 1/sqrt(fan_in), biases 0.1*N(0,1), RMS gains 1 + 0.1*N(0,1). Works on a meta-built
    module after `to_empty`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * r)
            elif p.dim() > 1:
                p.copy_(r / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * r)
    return vae
