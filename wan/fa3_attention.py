"""FlashAttention-3 (`attention='fa3'` and `'fa3_fp8'`): Dao-AILab's Hopper kernels, through its
`flash_attn_interface` module (the `flash_attn_3` package, built from flash-attention's `hopper/` directory; it
is not on PyPI).

- ``fa3``: q, k and v in the compute dtype (bf16/fp16; an fp32 model's in bf16), FA3's warp-specialized kernel.
  Not bit-equal to SDPA (another kernel, another summation order), within the same bf16 rounding of the exact
  result.
- ``fa3_fp8``: q, k and v quantized to e4m3 with one scale per head (max|t| over the head's tokens / 448, on the
  device, fused into a compiled block); FA3's fp8 kernel takes the scales as its descale factors, rounds the
  softmax probabilities to e4m3 for the product with v and writes the output in bf16 (no fp8 output rounding,
  unlike cuDNN's kernel on Hopper). An fp8 K/V cache hands its e4m3 keys and values over as stored, at scale 1:
  they go without descales (FA3 takes a missing one as 1).
  Short key sets (the text's 512 in cross-attention) run ``fa3``: the quantization would cost more than it saves.
  A cache handed over whole (`CachedRows`, below) counts as its size.
  Where q and k are normed and rotated by `wan.qk_rope`'s kernel (compiled blocks), q comes out of that kernel as
  e4m3 codes (`HeadCodes`), each head at a fixed scale: a bound of |q| from its norm's weight (sqrt(width) times
  the head's largest |weight|, over 448; `qk_rope.head_bound_scale`) in place of the head's amax, which would take
  a pass over q before the cast. No code saturates, and e4m3's relative step is the same over its normal range, so
  the looser scale only costs precision for values below 2^-6 of it (at a v2 1.3B's width, 1/730 of an element of
  root-mean-square size).
  Lossy: the benchmark reports the deviation.

A K/V cache aligned to its end (`wan.fast.SelfKVCache`'s `right`) hands its keys and values over whole as
`CachedRows`, with the first row its queries read as a tensor on the device: FA3 takes that as its `cache_leftpad`
(`flash_attn_with_kvcache`, the kernel's varlen path) and reads the rows from there on, so the shapes and the
recorded graph are the same whatever the cache holds. Rows before it never enter the result.

FA3 3.0's entry point is a registered custom op with a fake implementation, so compiled blocks trace through it
without a graph break (an older build that calls its extension directly would break the graph there); its module
is looked up through `devices.kept_import`, since an import inside a compiled block breaks the graph too. FA3 runs
on compute capability 9.0 only (H100, H200, H20); `problem` refuses it elsewhere and names the fallback.
"""

import functools
from typing import NamedTuple

import torch

from . import fp8_attention
from .devices import card_problem, kept_import
from .fp8_attention import FP8, MIN_KEYS

MODULE = "flash_attn_interface"
PACKAGE = "flash_attn_3 (FlashAttention-3, built from flash-attention's hopper/ directory)"
EXACT = "use --attention sdpa (PyTorch's kernels, exact)"


def interface():
    try:
        return kept_import(MODULE)
    except (ImportError, OSError) as err:
        raise RuntimeError(
            f"FlashAttention-3 needs the {PACKAGE} package, whose {MODULE} module is not importable here: {err}"
        ) from err


class HeadCodes(NamedTuple):
    """Queries already in e4m3 (`wan.qk_rope.norm_rope_codes`): codes [L, heads, d] and fp32 scales [1, heads]."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes.float() * self.scale[0, :, None]).to(dtype)


class CachedRows(NamedTuple):
    """A K/V cache's keys or values [size, heads, d] handed over whole, read from row `start[0]` on (`start`: int32
    [1] on the device; module docstring). Backends other than FA3's read `rows()`, which waits for the device."""

    full: torch.Tensor
    start: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.full.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    def rows(self) -> torch.Tensor:
        return self.full[int(self.start[0]) :]

    def to(self, dtype: torch.dtype) -> "CachedRows":
        return CachedRows(self.full.to(dtype), self.start)


def head_quantize(t) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(e4m3 codes [L, heads, d], fp32 [1, heads] scales): one scale per head; `HeadCodes` as they are; an fp8
    cache's values as stored, at scale 1, with no scale (FA3 takes a missing descale as 1: no tensor of ones).
    `CachedRows` stay so, their codes over the whole cache (the rows before `start` are zeros: no scale changes)."""
    if isinstance(t, HeadCodes):
        return t
    if isinstance(t, CachedRows):
        codes, scale = head_quantize(t.full)
        return CachedRows(codes, t.start), scale
    if t.dtype == FP8:
        return t.contiguous(), None
    return fp8_attention.quantize(t, per_head=True)


def flash(q, k, v, **descales) -> torch.Tensor:
    """FA3 over [L, heads, d] (batch 1), keys and values as tensors or `CachedRows`; its output [Lq, heads, d]."""
    fa = interface()
    if isinstance(k, CachedRows):
        # num_splits 1: one pass over the keys, as flash_attn_func makes it (this entry would pick splits itself)
        out = fa.flash_attn_with_kvcache(
            q.unsqueeze(0),
            k.full.unsqueeze(0),
            v.full.unsqueeze(0),
            cache_leftpad=k.start,
            num_splits=1,
            **descales,
        )
    else:
        out = fa.flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), **descales)
    out = out[0] if isinstance(out, tuple) else out  # some versions return (out, softmax_lse)
    return out[0]


HALF = (torch.bfloat16, torch.float16)  # FA3's kernels take these; an fp32 model's attention runs in bf16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``fa3`` backend: inputs cast to `dtype` (bf16 where `dtype` is not a half type; an fp8 cache's values
    too, `CachedRows` whole), [Lq, heads, d] out in `dtype`."""
    work = dtype if dtype in HALF else torch.bfloat16
    q = q.decoded(work) if isinstance(q, HeadCodes) else q
    return flash(*(t.to(work) for t in (q, k, v))).to(dtype)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``fa3_fp8`` backend (module docstring); [Lq, heads, d] out in `dtype`."""
    if k.shape[0] < MIN_KEYS:
        return attention(q, k, v, dtype)
    (q8, qs), (k8, ks), (v8, vs) = (head_quantize(t) for t in (q, k, v))
    return flash(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs).to(dtype)


def fallback(name: str, device) -> str:
    """What to use instead of backend `name` on `device`: SDPA, and for an fp8 backend cuDNN's fp8 attention where
    that runs."""
    if name.endswith("fp8") and fp8_attention.attention_problem(device) is None:
        return "use --attention fp8 (cuDNN's fp8 attention) or sdpa (exact)"
    return EXACT


def problem(name: str, device) -> str | None:
    """Why FlashAttention-3 backend `name` ('fa3' or 'fa3_fp8') cannot run on `device` (None: it can), naming the
    fallback."""
    return card_problem(
        device,
        lambda kind: (
            f"attention '{name}' runs FlashAttention-3's kernels on a Hopper GPU (compute capability 9.0); this "
            f"run is on {kind}. Instead: {fallback(name, kind)}"
        ),
        functools.partial(_cuda_problem, name),
    )


@functools.cache
def _cuda_problem(name: str, index: int) -> str | None:
    device = f"cuda:{index}"
    card = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return (
            f"attention '{name}': FlashAttention-3 runs on Hopper GPUs (compute capability 9.0) only; {card} is "
            f"{major}.{minor}. Instead: {fallback(name, device)}"
        )
    try:
        interface()
    except RuntimeError as err:
        return f"attention '{name}': {err}. Instead: {fallback(name, device)}"
    try:  # a build may leave out a dtype or head size: the model's (head_dim 128) kernels once
        x = torch.ones(MIN_KEYS, 1, 128, device=device)
        # the cache entry too (the compiled chunk loops' `CachedRows`): a build without its varlen kernels lacks it
        rows = CachedRows(x, torch.zeros(1, dtype=torch.int32, device=device))
        for k in (x, rows):
            attention(x, k, k, torch.bfloat16)  # bf16: fa3, and fa3_fp8's short key sets
            if name == "fa3_fp8":
                attention_fp8(x, k, k, torch.bfloat16)
        torch.cuda.synchronize(index)
    except Exception as err:  # the extension declines in several exception types
        first = (str(err).strip().splitlines() or [""])[0][:300]
        return (
            f"attention '{name}': this FlashAttention-3 build does not run here ({first}). "
            f"Instead: {fallback(name, device)}"
        )
    return None
