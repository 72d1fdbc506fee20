"""Self-attention's queries and keys normed and rotated in one pass (Triton): RMSNorm over the model's width,
then RoPE per head from the compiled runner's table (`wan.dit.rope_table`).

Compiled, inductor fused the norm and the rotation of q and k into one kernel that read each element's pair
under masks in float64 (93 us a call for a v2 1.3B chunk's 6,032 tokens on an H100, 13.4 ms a steady chunk),
and it kept the normed values in fp32 where the module rounds them to bf16: its q came out 0.37 % (relative L2)
from the eager path's. Here one program takes a token: one read of the row, as two power-of-two column tiles of pairs
(1,536 = 1,024 + 512; 5,120 = 4,096 + 1,024, where one padded tile left a quarter or three eighths of its lanes idle),
one write (14.6-16.7 us a call at the 1.3B's keys and queries on an H200, `STRIDED_COLS`), and the roundings are the
module's: 99.9998 % of the values equal the eager path's on that shape (BENCHMARKS.md).

Same formulas as the unfused eager path (`WanRMSNorm`, then `rope_apply`'s real float64 product): the mean of
squares in fp32 (each tile's sum, then their sum), rsqrt(+ eps), the product rounded to the input's dtype and
multiplied by the weight in that dtype; the pairs rotated in float64 and rounded to fp32, then to the attention's
dtype. The sum of squares is taken in another order and rsqrt is Triton's, so a value can move by one rounding of the
input's dtype.

With ``--attention fa3_fp8`` the same kernel writes the queries as FlashAttention-3's e4m3 codes (`norm_rope_codes`,
an op, `devices.lingbot_op`): each head at a fixed scale from its norm's weights (`head_bound_scale`), the rotated value
rounded to the query's dtype first, as the unfused path quantizes it. That saves the per-head amax and the cast, two
more passes over q (42 -> 31 us a call at the 1.3B chunk's shape on an H200, inside a CUDA graph). Into a K/V
cache of e4m3, or of the keys' own dtype, it writes the keys where the cache keeps the chunk's keys
(`norm_rope_into`), as the cache stores them: in e4m3 rounded to the keys' dtype, clamped to e4m3's range and cast,
at scale 1, the codes the cache's own cast gives. So the cache neither reads them again nor copies them.

Used on CUDA where Triton is installed, by blocks given the real table (compiled runners) outside sequence
parallel (`WanSelfAttention.rotates_in_norm`); under TRITON_INTERPRET=1 also on CPU tensors (the tests).
"""

import math
from typing import NamedTuple

import torch
from torch import nn

from .devices import lingbot_op, power_of_two_blocks, triton, triton_runs_on
from .fp8_attention import _TINY, FP8, FP8_MAX

enabled = True  # the benchmarks' A/B switch (read at trace time: a compiled block guards on it)
MAX_PAIRS = 8192  # a row's pairs live in one program's registers

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _pairs(ptr, first, cols, BLOCK: tl.constexpr, STRIDED: tl.constexpr):
        """The first and second elements of the pairs in a row's columns [first, first + BLOCK), in their own dtype
        (x's go to fp32 next; the weights, read per row, stay as they are). `STRIDED`: each read on its own at a stride
        of two (L1 serves the second); else the tile read whole and split in registers."""
        if STRIDED:
            j = first // 2 + tl.arange(0, BLOCK // 2)
            mask = j < cols // 2
            return tl.load(ptr + 2 * j, mask=mask, other=0.0), tl.load(ptr + 2 * j + 1, mask=mask, other=0.0)
        e = first + tl.arange(0, BLOCK)
        return tl.split(tl.reshape(tl.load(ptr + e, mask=e < cols, other=0.0), [BLOCK // 2, 2]))

    @triton.jit
    def _normed(v, rstd, w, x_row):
        """RMSNorm of the first (or second) elements of a row's pairs: (v * rstd) in x's dtype, times the weight
        in x's dtype (an exact product, rounded once); in float64 for the rotation."""
        w = w.to(x_row.dtype.element_ty).to(tl.float32)
        return (
            ((v * rstd).to(x_row.dtype.element_ty).to(tl.float32) * w)
            .to(x_row.dtype.element_ty)
            .to(tl.float64)
        )

    @triton.jit
    def _stored(v, scale, x_row, out_ptr, CODES: tl.constexpr):
        """A rotated value (float64) as stored: rounded to fp32, then to out's dtype; `CODES`: rounded to x's dtype
        (the query the unfused path hands the attention), divided by its head's scale, clamped to e4m3's range and
        cast to e4m3 (nearest)."""
        v = v.to(tl.float32)
        if CODES:
            v = tl.clamp(v.to(x_row.dtype.element_ty).to(tl.float32) / scale, -448.0, 448.0)
        return v.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _rotate_tile(
        a,
        b,
        rstd,
        w_ptr,
        table_row,
        scale_ptr,
        x_row,
        out_row,
        first,
        cols,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        CODES: tl.constexpr,
        SCALED: tl.constexpr,
        STRIDED: tl.constexpr,
    ):
        """A tile's pairs (`_pairs` of x's row at column `first`) normed, rotated and stored into out's row."""
        w_a, w_b = _pairs(w_ptr, first, cols, BLOCK, STRIDED)
        a = _normed(a, rstd, w_a, x_row)
        b = _normed(b, rstd, w_b, x_row)
        j = first // 2 + tl.arange(0, BLOCK // 2)
        mask = j < cols // 2
        c = j % HALF  # the pair's frequency within its head
        cos = tl.load(table_row + 2 * c, mask=mask, other=0.0)
        sin = tl.load(table_row + 2 * c + 1, mask=mask, other=0.0)
        scale = 1.0
        if SCALED:
            scale = tl.load(scale_ptr + j // HALF, mask=mask, other=1.0)  # the pair's head's
        first_out = _stored(a * cos - b * sin, scale, x_row, out_row, CODES)
        second_out = _stored(a * sin + b * cos, scale, x_row, out_row, CODES)
        if STRIDED:
            tl.store(out_row + 2 * j, first_out, mask=mask)
            tl.store(out_row + 2 * j + 1, second_out, mask=mask)
        else:
            e = first + tl.arange(0, BLOCK)
            tl.store(out_row + e, tl.reshape(tl.join(first_out, second_out), [BLOCK]), mask=e < cols)

    @triton.jit
    def _rms_rope_rows(
        x_ptr,
        w_ptr,
        table_ptr,
        out_ptr,
        scale_ptr,
        cols,
        x_stride,
        eps,
        HALF: tl.constexpr,
        B0: tl.constexpr,
        B1: tl.constexpr,
        CODES: tl.constexpr,
        SCALED: tl.constexpr,
        STRIDED: tl.constexpr,
    ):
        """One row a program, held as up to two power-of-two column tiles (B0, B1; 0: none), so few lanes idle."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        out_row = out_ptr + row * cols
        table_row = table_ptr + row * (2 * HALF)
        a0, b0 = _pairs(x_row, 0, cols, B0, STRIDED)
        a0 = a0.to(tl.float32)
        b0 = b0.to(tl.float32)
        squares = tl.sum(a0 * a0 + b0 * b0, axis=0)
        if B1 > 0:
            a1, b1 = _pairs(x_row, B0, cols, B1, STRIDED)
            a1 = a1.to(tl.float32)
            b1 = b1.to(tl.float32)
            squares += tl.sum(a1 * a1 + b1 * b1, axis=0)
        rstd = tl.math.rsqrt(squares / cols + eps)
        _rotate_tile(
            a0,
            b0,
            rstd,
            w_ptr,
            table_row,
            scale_ptr,
            x_row,
            out_row,
            0,
            cols,
            HALF,
            B0,
            CODES,
            SCALED,
            STRIDED,
        )
        if B1 > 0:
            _rotate_tile(
                a1,
                b1,
                rstd,
                w_ptr,
                table_row,
                scale_ptr,
                x_row,
                out_row,
                B0,
                cols,
                HALF,
                B1,
                CODES,
                SCALED,
                STRIDED,
            )


def usable(x: torch.Tensor, table: torch.Tensor, head_dim: int) -> bool:
    """Whether `norm_rope` runs here for x [tokens, width] of heads `head_dim` wide and the RoPE table [tokens, 1,
    head_dim / 2, 2] (`rope_table`)."""
    return (
        enabled
        and triton_runs_on(x)
        and x.dim() == 2
        and x.numel() > 0
        and head_dim % 2 == 0
        and x.shape[1] % head_dim == 0
        and x.shape[1] // 2 <= MAX_PAIRS
        and table.device == x.device
        and not table.is_complex()
        and table.dtype == torch.float64
        and table.dim() == 4
        and table.shape[0] == x.shape[0]
        and table.shape[1] == 1
        and table.shape[2] * 2 == head_dim
        and table.shape[-1] == 2
    )


# Rows up to this wide read their pairs at a stride of two and run 2 warps; wider ones read whole tiles with 4 warps.
# An H200's sweep in CUDA graphs (BENCHMARKS.md): at 1,536 columns the keys 18.4 -> 14.6 us, the queries' codes 21.7 ->
# 16.7 (strided, 2 warps); at 5,120 the keys 91.9 -> 49.6, the queries' codes 102.5 -> 62.3 (whole tiles, 4 warps).
STRIDED_COLS = 2048
# wider rows (none of the models') take 8 warps, so a thread holds no more than at 8,192 columns with 4
WIDE_COLS = 8192


def _launch(x, weight, table, out, scale, eps: float) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    narrow = cols <= STRIDED_COLS
    b0, b1 = power_of_two_blocks(cols, 2)
    _rms_rope_rows[(rows,)](
        x,
        weight,
        table.contiguous(),
        out,
        out if scale is None else scale,  # absent: any pointer (its load is compiled out)
        cols,
        x.stride(0),
        eps,
        HALF=table.shape[2],
        B0=b0,
        B1=b1,
        CODES=out.dtype == FP8,
        SCALED=scale is not None,
        STRIDED=narrow,
        num_warps=2 if narrow else 4 if cols <= WIDE_COLS else 8,
    )
    return out


def norm_rope(norm: nn.Module, x: torch.Tensor, table: torch.Tensor, out_dtype) -> torch.Tensor:
    """RoPE(norm(x)) [tokens, width] in `out_dtype` (the attention's) for a `WanRMSNorm` `norm`, as `rope_apply` of
    norm(x) viewed as [tokens, heads, d] with `table`. An fp8 K/V cache's e4m3 keys come from `norm_rope_into`."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return _launch(x, norm.weight, table, out, None, norm.eps)


class KeySlot(NamedTuple):
    """Where a K/V cache keeps a chunk's keys (`Bidirectional.key_slot`): the layer's whole cache (contiguous, its
    rows as wide as the keys: [rows, heads, head_dim]) and the chunk's first row. The whole cache and a row, not a
    slice of it: compiled with dynamic shapes (live play's growing chunks), inductor handed an op a view of a slice at
    a symbolic row without the row's offset."""

    cache: torch.Tensor
    start: int


def norm_rope_into(norm: nn.Module, x: torch.Tensor, table: torch.Tensor, slot: KeySlot) -> None:
    """`norm_rope(norm, x, table, slot.cache.dtype)` written into the cache's rows from `slot.start` on (a K/V
    cache's slots of the chunk: the keys land where the cache keeps them, as it stores them, with no copy). The
    cache is e4m3 or x's dtype: the casts the cache's own store makes."""
    cache = slot.cache
    if not cache.is_contiguous() or cache[0].numel() != x.shape[1] or cache.dtype not in (FP8, x.dtype):
        raise ValueError(
            f"norm_rope_into: expected a contiguous e4m3 or {x.dtype} cache of rows {x.shape[1]} wide, got "
            f"{list(cache.shape)} {cache.dtype}"
        )
    if slot.start < 0:
        raise ValueError(f"norm_rope_into: the chunk's first row must not be negative, got {slot.start}")
    torch.ops.lingbot.qk_rope_into(x, norm.weight, table, norm.eps, cache, slot.start)


def _codes(
    x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """e4m3 codes of the rotated rows at each head's `scale` ([1, heads]; None: 1)."""
    return _launch(x, weight, table, torch.empty(x.shape, dtype=FP8, device=x.device), scale, eps)


def _into(
    x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, eps: float, cache: torch.Tensor, start: int
) -> None:
    """The rotated rows written into `cache`'s rows from `start` on, in its dtype (e4m3: at scale 1)."""
    out = cache.view(cache.shape[0], -1)[start : start + x.shape[0]]
    if out.shape != x.shape:
        raise ValueError(f"qk_rope_into: rows {start}..{start + x.shape[0]} of a cache of {cache.shape[0]}")
    _launch(x, weight, table, out, None, eps)


# `torch.ops.lingbot.qk_rope_codes` and `qk_rope_into`: opaque to torch.compile, as `wan.fp8_inputs`'s kernels are (an
# e4m3 cast traced as a user kernel can fail inductor's own Triton compile). `qk_rope_into` declares that it writes
# `cache`, so inductor hands it the K/V cache itself (no copy of the cache, none of the keys).
lingbot_op("qk_rope_codes", _codes, lambda x, weight, table, scale, eps: x.new_empty(x.shape, dtype=FP8))
lingbot_op("qk_rope_into", _into, lambda x, weight, table, eps, cache, start: None, mutates_args=("cache",))


def head_bound_scale(norm: nn.Module, heads: int) -> torch.Tensor:
    """fp32 [1, heads]: each head's bound of |RoPE(norm(x))| over 448. The norm divides a row by its root mean
    square, so no element exceeds sqrt(width) times its weight, and the rotation keeps each pair's length: no value
    of head h exceeds sqrt(width) * max|w| over h's weights."""
    w = norm.weight.detach().float().abs().view(heads, -1).amax(dim=1)
    return (w * math.sqrt(norm.weight.shape[0])).clamp_min(_TINY).div(FP8_MAX).reshape(1, heads)


def norm_rope_codes(norm: nn.Module, x: torch.Tensor, table: torch.Tensor, heads: int):
    """(e4m3 codes [tokens, width], fp32 scales [1, heads]) of `norm_rope(norm, x, table, x.dtype)` at a fixed scale
    per head (`head_bound_scale`): FlashAttention-3's fp8 queries (`wan.fa3_attention.HeadCodes`) in the same pass."""
    scale = head_bound_scale(norm, heads)
    return torch.ops.lingbot.qk_rope_codes(x, norm.weight, table, scale, norm.eps), scale
