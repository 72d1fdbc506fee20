"""Self-attention's queries and keys normed and rotated in one pass (Triton): RMSNorm over the model's width,
then RoPE per head from the compiled runner's table (`wan.dit.rope_table`).

Compiled, inductor fused the norm and the rotation of q and k into one kernel that read each element's pair
under masks in float64 (93 us a call for a v2 1.3B chunk's 6,032 tokens on an H100, 13.4 ms a steady chunk),
and it kept the normed values in fp32 where the module rounds them to bf16: its q came out 0.37 % (relative L2)
from the eager path's. Here one program takes a token: one read of the row in pairs, one write (22 us a call,
q and k apart), and the roundings are the module's: 99.9998 % of the values equal the eager path's on that
shape (BENCHMARKS.md).

Same formulas as the unfused eager path (`WanRMSNorm`, then `rope_apply`'s real float64 product): the mean of
squares in fp32, rsqrt(+ eps), the product rounded to the input's dtype and multiplied by the weight in that
dtype; the pairs rotated in float64 and rounded to fp32, then to the attention's dtype. The sum of squares is
taken in another order and rsqrt is Triton's, so a value can move by one rounding of the input's dtype.

Used on CUDA where Triton is installed, by blocks given the real table (compiled runners) outside sequence
parallel (`WanSelfAttention.rotates_in_norm`); under TRITON_INTERPRET=1 also on CPU tensors (the tests).
"""

import torch
from torch import nn

from .devices import triton, triton_runs_on

enabled = True  # the benchmarks' A/B switch (read at trace time: a compiled block guards on it)
MAX_PAIRS = 8192  # a row's pairs live in one program's registers

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _normed(v, rstd, w_ptrs, mask, x_row):
        """RMSNorm of the first (or second) elements of a row's pairs: (v * rstd) in x's dtype, times the weight
        in x's dtype (an exact product, rounded once); in float64 for the rotation."""
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(x_row.dtype.element_ty).to(tl.float32)
        return (
            ((v * rstd).to(x_row.dtype.element_ty).to(tl.float32) * w)
            .to(x_row.dtype.element_ty)
            .to(tl.float64)
        )

    @triton.jit
    def _rms_rope_rows(
        x_ptr, w_ptr, table_ptr, out_ptr, cols, x_stride, eps, HALF: tl.constexpr, PAIRS: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        out_row = out_ptr + row * cols
        table_row = table_ptr + row * (2 * HALF)
        j = tl.arange(0, PAIRS)
        mask = j < cols // 2
        a = tl.load(x_row + 2 * j, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + 2 * j + 1, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(a * a + b * b, axis=0) / cols + eps)
        a = _normed(a, rstd, w_ptr + 2 * j, mask, x_row)
        b = _normed(b, rstd, w_ptr + 2 * j + 1, mask, x_row)
        c = j % HALF  # the pair's frequency within its head
        cos = tl.load(table_row + 2 * c, mask=mask, other=0.0)
        sin = tl.load(table_row + 2 * c + 1, mask=mask, other=0.0)
        tl.store(out_row + 2 * j, (a * cos - b * sin).to(tl.float32).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(
            out_row + 2 * j + 1, (a * sin + b * cos).to(tl.float32).to(out_ptr.dtype.element_ty), mask=mask
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


def warps(cols: int) -> int:
    return 4 if cols <= 2048 else 8


def norm_rope(norm: nn.Module, x: torch.Tensor, table: torch.Tensor, out_dtype) -> torch.Tensor:
    """RoPE(norm(x)) [tokens, width] in `out_dtype` for a `WanRMSNorm` `norm`, as `rope_apply` of norm(x)
    viewed as [tokens, heads, d] with `table`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    half = table.shape[2]
    out = torch.empty(rows, cols, dtype=out_dtype, device=x.device)
    pairs = 1 << max(4, (cols // 2 - 1).bit_length())
    table = table.contiguous()
    _rms_rope_rows[(rows,)](
        x, norm.weight, table, out, cols, x.stride(0), norm.eps, HALF=half, PAIRS=pairs, num_warps=warps(cols)
    )
    return out
