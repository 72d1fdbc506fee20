"""Run for tests/test_fp8_gelu.py and tests/test_qk_rope.py (conftest's `interpreted_kernels`) under
TRITON_INTERPRET=1 (Triton's interpreter, on CPU tensors; it must be set before Triton is imported, hence a process
of its own): the fused GELU + e4m3 kernel (`wan.fp8_gelu`) against the unfused path, alone and inside a tiny fp8
model's forward; the q/k RMSNorm + RoPE kernel (`wan.qk_rope`) against the norm and `rope_apply`, alone and in a
self-attention's forward. Prints one JSON line of measurements; the tests judge them."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lingbot import load_pack  # noqa: E402

load_pack()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from helpers import TinyRun  # noqa: E402
from lingbot_world.wan import dit, fp8, fp8_gelu, qk_rope  # noqa: E402


@triton.jit
def _cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)


def interpreted_e4m3(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 as the interpreter casts (its own rounding, not the GPU's), to compare codes like for like."""
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn)
    _cast[(triton.cdiv(q.numel(), 1024),)](q, out, q.numel(), BLOCK=1024)
    return out


def rows_case(h: torch.Tensor) -> dict:
    codes, scale = fp8_gelu.gelu_quantize_rows(h)
    y = F.gelu(h, approximate="tanh").float()
    ref_codes, ref_scale = fp8.quantize_rows(y)
    like_for_like = interpreted_e4m3((y / ref_scale[:, None]).clamp(-448, 448))
    return {
        "usable": fp8_gelu.usable(h),
        "shape": list(codes.shape),
        "dtype": str(codes.dtype),
        "scale_max_rel": float(((scale - ref_scale).abs() / ref_scale).max()),
        "codes_equal": float((codes.float() == like_for_like.float()).float().mean()),
    }


g = torch.Generator().manual_seed(0)
wide = torch.randn(6, 300, generator=g) * torch.logspace(-3, 2, 6)[:, None]  # rows from 1e-3 to 1e2
wide[2] = 0  # an all-zero row: scale 1e-12 / 448, codes 0
cases = {
    "bf16": rows_case(wide.bfloat16()),
    "fp32": rows_case(wide),
    "strided": rows_case(torch.randn(40, 96, generator=g).bfloat16()[:, :80]),
    "pow2": rows_case((torch.randn(8, 64, generator=g) * 4).bfloat16()),
}
zero_codes, zero_scale = fp8_gelu.gelu_quantize_rows(torch.zeros(1, 32))
cases["zero_row"] = {"codes_max": float(zero_codes.float().abs().max()), "scale": float(zero_scale[0])}


def rope_case(dtype, strided: bool = False, heads: int = 4, d: int = 24, grid: tuple = (2, 3, 5)) -> dict:
    """The q/k kernel on x [tokens, heads * d] against WanRMSNorm then `rope_apply` with the compiled table, and a
    self-attention's forward with and without it (`WanSelfAttention.rotates_in_norm`). `strided`: x is a view whose
    rows lie further apart than their width."""
    tokens = grid[0] * grid[1] * grid[2]
    attn = dit.init_random_(dit.WanSelfAttention(heads * d, heads), seed=3).requires_grad_(False)
    attn.norm_q.weight.data = 1 + 0.3 * torch.randn(heads * d, generator=g)
    table = dit.rope_table(grid, dit.rope_freqs(d))
    x = (torch.randn(tokens, heads * d + 32 * strided, generator=g) * 3).to(dtype)[:, : heads * d]
    fused = qk_rope.norm_rope(attn.norm_q, x, table, dtype)
    ref = dit.rope_apply(attn.norm_q(x).view(tokens, heads, d), grid, table, dtype).flatten(1)
    ulp = torch.finfo(dtype).eps
    with torch.no_grad():
        layer = attn(x, grid, table, dtype)
        qk_rope.enabled = False
        unfused = attn(x, grid, table, dtype)
        qk_rope.enabled = True
    return {
        "usable": qk_rope.usable(x, table, d),
        "stride": x.stride(0),
        "shape": list(fused.shape),
        "equal": float((fused == ref).float().mean()),
        # the largest difference in units of the largest value's rounding
        "max_ulps": float((fused.float() - ref.float()).abs().max() / (ref.float().abs().max() * ulp)),
        "forward_rel": float((layer - unfused).float().norm() / unfused.float().norm()),
    }


run, calls = TinyRun(layers=2), []
real = fp8_gelu.gelu_quantize_rows
fp8_gelu.gelu_quantize_rows = lambda h: calls.append(tuple(h.shape)) or real(h)
fused = run.forward()
fp8_gelu.enabled = False
unfused = run.forward()
fp8_gelu.enabled = True
ffn = run.model.blocks[0].ffn
forward = {
    "kernel_calls": calls,
    "ffn_dim": ffn[0].weight.shape[0],
    "rel_deviation": float((fused - unfused).norm() / unfused.norm()),
    "finite": bool(torch.isfinite(fused).all()),
}
usable = {
    "widest": fp8_gelu.usable(torch.empty(1, fp8_gelu.MAX_COLS)),
    "too_wide": fp8_gelu.usable(torch.empty(1, fp8_gelu.MAX_COLS + 16)),
    "3d": fp8_gelu.usable(torch.empty(1, 2, 64)),
    "no_rows": fp8_gelu.usable(torch.empty(0, 64)),
}
# the interpreter casts to fp16 through numpy (to nearest, as a GPU does) but to bf16 toward zero: fp16 shows the
# roundings, bf16 only roughly
rope_cases = {
    "fp32": rope_case(torch.float32),
    "fp16": rope_case(torch.float16),
    "fp16_strided": rope_case(torch.float16, strided=True),
    "bf16": rope_case(torch.bfloat16),
}
table, freqs = dit.rope_table((2, 3, 5), dit.rope_freqs(24)), dit.rope_freqs(24)
zero = qk_rope.norm_rope(dit.WanRMSNorm(96), torch.zeros(30, 96), table, torch.float32)
rope_cases["zero_rows"] = {"finite": bool(torch.isfinite(zero).all()), "max_abs": float(zero.abs().max())}
rope_cases["usable"] = {
    "complex": qk_rope.usable(torch.empty(30, 96), dit.rope_positions((2, 3, 5), freqs), 24),
    "other_length": qk_rope.usable(torch.empty(31, 96), table, 24),
    "3d": qk_rope.usable(torch.empty(30, 4, 24), table, 24),
    "other_head_dim": qk_rope.usable(torch.empty(30, 96), table, 32),
    "table": qk_rope.usable(torch.empty(30, 96), table, 24),
}
print(json.dumps({"cases": cases, "forward": forward, "usable": usable, "rope_cases": rope_cases}))
