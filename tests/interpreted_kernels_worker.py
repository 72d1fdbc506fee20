"""Run for tests/test_fp8_gelu.py, tests/test_qk_rope.py, tests/test_fp8_inputs.py and tests/test_tap_conv.py (conftest's
`interpreted_kernels`) under TRITON_INTERPRET=1 (Triton's interpreter, on CPU tensors; it must be set before Triton is imported, hence a process
of its own): the fused GELU + e4m3 kernel (`wan.fp8_gelu`) against the unfused path, alone and inside a tiny fp8
model's forward; the q/k RMSNorm + RoPE kernel (`wan.qk_rope`) against the norm and `rope_apply`, alone and in a
self-attention's forward, and its e4m3 queries against the same quotient cast the interpreter's way; the blocks' update + norm + e4m3 kernel and the row quantization (`wan.fp8_inputs`) against
the unfused path, alone and in a forward; the fast decoder's causal conv (`wan.tap_conv`) against the 3-D conv, alone
and in a tiny decoder. Prints one JSON line of measurements; the tests judge them."""

import functools
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
from helpers import TinyRun, channels_last_3d  # noqa: E402
from lingbot_world.wan import dit, fast, fp8, fp8_gelu, fp8_inputs, qk_rope, tap_conv  # noqa: E402
from lingbot_world.wan import vae as V  # noqa: E402
from lingbot_world.wan.devices import power_of_two_blocks  # noqa: E402


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


def like_for_like(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The unfused quotient of h's rows by their scales, cast to e4m3 the interpreter's way."""
    return interpreted_e4m3((h.float() / scale[:, None]).clamp(-448, 448))


def rows_case(h: torch.Tensor) -> dict:
    codes, scale = fp8_gelu.gelu_quantize_rows(h)
    y = F.gelu(h, approximate="tanh").float()
    ref_codes, ref_scale = fp8.quantize_rows(y)
    return {
        "usable": fp8_gelu.usable(h),
        "shape": list(codes.shape),
        "dtype": str(codes.dtype),
        "scale_max_rel": float(((scale - ref_scale).abs() / ref_scale).max()),
        "codes_equal": float((codes.float() == like_for_like(y, ref_scale).float()).float().mean()),
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
fp8_gelu.gelu_quantize_rows = real
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


def rope_codes_case(dtype, heads: int = 4, d: int = 24, grid: tuple = (2, 3, 5)) -> dict:
    """The q kernel's e4m3 output (`qk_rope.norm_rope_codes`) against the norm, `rope_apply` and the quotient by the
    heads' bound scales cast the interpreter's way; one head's weights 10x the others'."""
    tokens = grid[0] * grid[1] * grid[2]
    norm = dit.WanRMSNorm(heads * d)
    norm.weight.data = 1 + 0.3 * torch.randn(heads * d, generator=g)
    norm.weight.data[d : 2 * d] *= 10
    table = dit.rope_table(grid, dit.rope_freqs(d))
    x = (torch.randn(tokens, heads * d, generator=g) * 3).to(dtype)
    codes, scale = qk_rope.norm_rope_codes(norm, x, table, heads)
    ref = dit.rope_apply(norm(x).view(tokens, heads, d), grid, table, dtype)
    want = like_for_like(ref.float().flatten(0, 1), scale[0].repeat(tokens)).view(tokens, heads * d)
    bound = norm.weight.float().abs().view(heads, d).amax(1) * (heads * d) ** 0.5 / 448
    amax = ref.float().abs().amax(dim=(0, 2)) / 448  # each head's own: the unfused fa3_fp8 queries' scales

    def decoded_rel(scales):  # q quantized at `scales` with torch's cast (to nearest, as a GPU's), decoded
        codes = (ref.float() / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return float((codes.float() * scales[:, None] - ref.float()).norm() / ref.float().norm())

    return {
        "dtype": str(codes.dtype),
        "shape": list(codes.shape),
        "scale": list(scale.shape),
        "scale_max_rel": float(((scale[0] - bound).abs() / bound).max()),
        "codes_equal": float((codes.float() == want.float()).float().mean()),
        "max_code": float(codes.float().abs().max()),
        "decoded_rel": decoded_rel(scale[0]),
        "amax_decoded_rel": decoded_rel(amax),
    }


rope_cases["codes_fp16"] = rope_codes_case(torch.float16)
rope_cases["codes_fp32"] = rope_codes_case(torch.float32)


def key_codes_case(dtype, heads: int = 4, d: int = 24, grid: tuple = (2, 3, 5)) -> dict:
    """The k kernel writing an fp8 cache's keys (`qk_rope.norm_rope_into` an e4m3 buffer, scale 1) against its keys in `dtype`
    clamped and cast as the cache stores them (the interpreter's cast on both sides; one head's weights large
    enough to clamp); then a self-attention's forward into an fp8 cache with the kernel writing the keys into the
    cache's slots (`key_slot`) and without (the keys in `dtype`, which the cache casts with torch's cast)."""
    tokens = grid[0] * grid[1] * grid[2]
    attn = dit.init_random_(dit.WanSelfAttention(heads * d, heads), seed=4).requires_grad_(False)
    attn.norm_k.weight.data = 1 + 0.3 * torch.randn(heads * d, generator=g)
    attn.norm_k.weight.data[:d] *= 300
    table = dit.rope_table(grid, dit.rope_freqs(d))
    x = (torch.randn(tokens, heads * d, generator=g) * 3).to(dtype)
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    qk_rope.norm_rope_into(attn.norm_k, x, table, qk_rope.KeySlot(codes, 0))
    keys = qk_rope.norm_rope(attn.norm_k, x, table, dtype)
    want = interpreted_e4m3(keys.float().clamp(-448, 448))

    attn.norm_k.weight.data[:d] /= (
        300  # the forward: keys of ordinary size (huge logits magnify a code's step)
    )
    made = []
    real, real_into = qk_rope.norm_rope, qk_rope.norm_rope_into

    def forward(into):
        cache = fast.SelfKVCache(1, tokens, heads, d, 0, torch.float8_e4m3fn, "cpu")
        cache.begin(0, tokens)
        kv = fast.ChunkCausal(cache, 1)
        slot = kv.key_slot(0, tokens, dtype) if into else None
        assert not into or (slot.cache is cache.k[0] and slot.start == 0)
        qk_rope.norm_rope = lambda *a: made.append(str(a[-1])) or real(*a)
        qk_rope.norm_rope_into = lambda *a: made.append(f"into {a[-1].cache.dtype}") or real_into(*a)
        out = attn(x, grid, table, dtype, functools.partial(kv.self_kv, 0), slot)
        qk_rope.norm_rope, qk_rope.norm_rope_into = real, real_into
        return out, cache.k[0], cache.v[0]

    (out, k8, v8), (out0, k0, v0) = forward(True), forward(False)
    return {
        "kernel_dtypes": made,
        "dtype": str(codes.dtype),
        "codes_equal": float((codes.float() == want.float()).float().mean()),
        "max_code": float(codes.float().abs().max()),
        "cache_keys_equal": float((k8.float() == k0.float()).float().mean()),
        "cache_values_equal": bool(torch.equal(v8, v0)),
        "forward_rel": float((out - out0).float().norm() / out0.float().norm()),
    }


rope_cases["key_codes_fp16"] = key_codes_case(torch.float16)
rope_cases["key_codes_bf16"] = key_codes_case(torch.bfloat16)
# each way of reading a row's pairs (at a stride of two; as whole tiles split in registers, the 14B's on a GPU) at
# widths of two tiles (96 = 64 + 32), one (64 = 64 + 0) and a second one partly masked (112 = 64 + 64, 48 used): the
# module's values, the queries' codes and an fp8 cache's keys
narrow = qk_rope.STRIDED_COLS
for way, qk_rope.STRIDED_COLS in (("strided", narrow), ("whole_tiles", 0)):
    for d in (24, 16, 28):
        rope_cases[f"fp16_{way}_{4 * d}"] = rope_case(torch.float16, d=d)
    rope_cases[f"codes_fp16_{way}_112"] = rope_codes_case(torch.float16, d=28)
    rope_cases[f"key_codes_fp16_{way}_112"] = key_codes_case(torch.float16, d=28)
qk_rope.STRIDED_COLS = narrow


def key_slot_compiled_case(dynamic: bool, heads: int = 2, d: int = 16, grid: tuple = (1, 2, 4)) -> dict:
    """A compiled function writing chunks' keys into a bf16 cache's slots (`key_slot`, `qk_rope.norm_rope_into`) and
    their values through `self_kv`, as the chunk loop's compiled blocks do (`dynamic`: as live play's growing
    chunks', whose placement is symbolic), chunk 1 then chunk 2 of a cache that keeps chunk 0, against the same run
    eagerly: the caches both leave, and the arguments inductor's code hands the op."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    tokens = grid[0] * grid[1] * grid[2]
    norm = dit.WanRMSNorm(heads * d)
    norm.weight.data = 1 + 0.3 * torch.randn(heads * d, generator=g)
    table = dit.rope_table(grid, dit.rope_freqs(d))
    xs = [(torch.randn(tokens, heads * d, generator=g) * 3).bfloat16() for _ in range(3)]

    def write(x, kv):
        qk_rope.norm_rope_into(norm, x, table, kv.key_slot(0, x.shape[0], x.dtype))
        k, _ = kv.self_kv(0, None, x.view(-1, heads, d))
        return k.float().sum()

    compiled_write = torch.compile(write, fullgraph=True, dynamic=dynamic)
    caches, code = [], []
    for compiled in (False, True):
        cache = fast.SelfKVCache(1, 4 * tokens, heads, d, 0, torch.bfloat16, "cpu")
        cache.begin(0, tokens)
        cache.k[0][:tokens] = 1.0  # chunk 0's keys, which must stay
        for c in (1, 2):
            cache.begin(c * tokens, tokens)
            kv = fast.ChunkCausal(cache, 1)
            if compiled:
                _, made = run_and_get_code(compiled_write, xs[c], kv)
                code += made
            else:
                write(xs[c], kv)
        caches.append(cache.k[0].clone())
    eager, compiled = caches
    return {
        "cache_equal": torch.equal(compiled, eager),
        "chunk0_kept": bool((eager[:tokens] == 1.0).all()),
        "chunks_written": bool(eager[tokens : 3 * tokens].ne(0).any(dim=(1, 2)).all()),
        "calls": [
            line.strip() for text in code for line in text.splitlines() if "qk_rope_into.default(" in line
        ],
    }


rope_cases["key_slot_compiled"] = key_slot_compiled_case(dynamic=False)
rope_cases["key_slot_compiled_dynamic"] = key_slot_compiled_case(dynamic=True)


def key_slot_block_case(dtype=torch.bfloat16) -> dict:
    """A DiT block's forward (`WanAttentionBlock`, the RoPE table given, as the compiled runners give it) into a
    chunk-causal cache at chunk 1, whole and for its keys alone (`keys_only`, the commit pass's last block): with the
    cache's slots offered, and with none (`SelfKVCache.slot` returning None). Whether the block had the kernel write
    its keys into the cache, and whether the caches and outputs agree."""
    model = TinyRun(layers=1, use_fp8=False).model.to(dtype)
    block = model.blocks[0]
    grid = (1, 2, 4)
    tokens, dim = grid[0] * grid[1] * grid[2], model.dim
    heads = block.self_attn.num_heads
    table = dit.rope_table(grid, dit.rope_freqs(dim // heads))
    x = torch.randn(tokens, dim, generator=g).to(dtype)
    e0 = torch.randn(1, 6, dim, generator=g)
    context = torch.randn(7, dim, generator=g).to(dtype)
    calls, real_into, real_slot = [], qk_rope.norm_rope_into, fast.SelfKVCache.slot

    def run(offer: bool, keys_only: bool = False):
        cache = fast.SelfKVCache(1, 3 * tokens, heads, dim // heads, 0, dtype, "cpu")
        cache.begin(0, tokens)
        cache.begin(tokens, tokens)
        qk_rope.norm_rope_into = lambda *a: calls.append(offer) or real_into(*a)
        if not offer:
            fast.SelfKVCache.slot = lambda *a: None
        try:
            kv = fast.ChunkCausal(cache, 1)
            out = block(x, e0, grid, table, context, None, dtype, 0, kv, keys_only=keys_only)
        finally:
            qk_rope.norm_rope_into, fast.SelfKVCache.slot = real_into, real_slot
        return out, cache.k[0]

    (out, k), (out0, k0) = run(True), run(False)
    (none, k_only), (_, k_only0) = (
        run(True, keys_only=True),
        run(False, keys_only=True),
    )  # the commit's last block
    return {
        "into_calls": calls,
        "keys_equal": torch.equal(k, k0),
        "keys_only_equal": none is None and torch.equal(k_only, k_only0) and torch.equal(k_only, k),
        "chunk_written": bool(k[tokens : 2 * tokens].ne(0).any(dim=(1, 2)).all()),
        "out_equal": torch.equal(out, out0),
    }


rope_cases["key_slot_block"] = key_slot_block_case()


def inputs_case(x, norm, update=None, camera=None, modulation=None) -> dict:
    """`fp8_inputs.norm_codes` against `dit.block_input`'s unfused path (kernel off), codes cast like for like."""
    got_x, codes, scale = fp8_inputs.norm_codes(x, norm, update, camera, modulation)
    fp8_inputs.enabled = False
    want_x, h = dit.block_input(x, norm, (), update, camera and (lambda: camera), modulation)
    fp8_inputs.enabled = True
    _, want_scale = fp8.quantize_rows(h.float())
    return {
        "usable": fp8_inputs.usable(x, update),
        "x_dtype": str(got_x.dtype),
        "x_same_dtype": got_x.dtype == want_x.dtype,
        "x_max_abs": float((got_x.float() - want_x.float()).abs().max()),
        "scale_max_rel": float(((scale - want_scale).abs() / want_scale).max()),
        "codes_equal": float((codes.float() == like_for_like(h, want_scale).float()).float().mean()),
    }


# fp16 where the formulas round to a half-precision dtype: the interpreter casts fp16 to nearest, as a GPU does
half, rows, cols = torch.float16, 7, 300  # an odd row count (a program's second row masked), masked columns
x = torch.randn(rows, cols, generator=g) * 3
x[3] = 0.5  # a constant row: its norm is zero, scale 1e-12 / 448


def vec(k=0.1):
    return torch.randn(cols, generator=g) * k


def mat(k=1.0, dtype=half):
    return (torch.randn(rows, cols, generator=g) * k).to(dtype)


norm, affine = dit.WanLayerNorm(cols), dit.WanLayerNorm(cols, elementwise_affine=True).requires_grad_(False)
affine.weight.data, affine.bias.data = 1 + vec(), vec()
inputs = {
    "norm1": inputs_case(x, norm, (mat(), vec()), modulation=(vec(), vec())),
    "norm1_first": inputs_case(
        x.to(half), norm, modulation=(vec(), vec())
    ),  # the block's first input, rounded
    "norm3": inputs_case(x, affine, (mat(), vec()), (mat(0.1), mat(0.1))),
    "norm3_first": inputs_case(x.to(half), affine, (mat(), vec()), (mat(0.1), mat(0.1))),
    "norm2": inputs_case(x, norm, (mat(), None), modulation=(vec(), vec())),
}
# one tile (a power of two), and two with none masked (64 + 32), as 1,536 = 1,024 + 512
for width in (256, 96):
    wx = torch.randn(rows, width, generator=g) * 3
    wnorm = dit.WanLayerNorm(width, elementwise_affine=True).requires_grad_(False)
    wnorm.weight.data, wnorm.bias.data = (
        1 + torch.randn(width, generator=g) * 0.1,
        torch.randn(width, generator=g) * 0.1,
    )
    wmat = [(torch.randn(rows, width, generator=g) * k).to(half) for k in (1.0, 0.1, 0.1)]
    wcase = inputs_case(wx, wnorm, (wmat[0], torch.randn(width, generator=g) * 0.1), (wmat[1], wmat[2]))
    inputs[f"norm3_cols_{width}"] = wcase | {"tiles": list(power_of_two_blocks(width, 2))}
for name, t in {
    "rows": mat(3, torch.bfloat16),
    "rows_strided": torch.randn(40, 96, generator=g)[:, :80],
}.items():
    codes, scale = fp8_inputs.quantize_rows(t)
    _, want_scale = fp8.quantize_rows(t)
    inputs[name] = {
        "stride": t.stride(0),
        "scale_max_rel": float(((scale - want_scale).abs() / want_scale).max()),
        "codes_equal": float((codes.float() == like_for_like(t, want_scale).float()).float().mean()),
    }
# the camera layers' inputs: codes of a sum or of a SiLU, each rounded to the rows' dtype first (fp16: the interpreter
# rounds it to nearest, as torch does)
for name, (t, plus, silu) in {
    "rows_plus": (mat(3, torch.float16), mat(2, torch.float16), False),
    "rows_silu": (mat(4, torch.float16), None, True),
}.items():
    codes, scale = fp8_inputs.quantize_rows(t, plus, silu)
    y = F.silu(t) if silu else t + plus
    loose = F.silu(t.float()) if silu else t.float() + plus
    _, want_scale = fp8.quantize_rows(y)
    inputs[name] = {
        "scale_max_rel": float(((scale - want_scale).abs() / want_scale).max()),
        "codes_equal": float((codes.float() == like_for_like(y, want_scale).float()).float().mean()),
        "plain_equal": float((codes.float() == like_for_like(t, want_scale).float()).float().mean()),
        # the sum or SiLU left in fp32, not rounded to t's dtype first
        "unrounded_equal": float((codes.float() == like_for_like(loose, want_scale).float()).float().mean()),
    }
inputs["usable"] = {
    "fp32": fp8_inputs.usable(x, (mat(), None)),
    "bf16_gated": fp8_inputs.usable(x.bfloat16(), (mat(), vec())),
    "bf16_plain_update": fp8_inputs.usable(x.bfloat16(), (mat(), None)),
    "bf16_no_update": fp8_inputs.usable(x.bfloat16()),
    "bf16_gate": fp8_inputs.usable(x, (mat(), vec().bfloat16())),
    "other_rows": fp8_inputs.usable(x, (mat()[:-1], vec())),
    "widest": fp8_inputs.usable(torch.empty(1, fp8_inputs.MAX_COLS)),
    "too_wide": fp8_inputs.usable(torch.empty(1, fp8_inputs.MAX_COLS + 16)),
    "3d": fp8_inputs.usable(torch.empty(1, 2, 64)),
    "no_rows": fp8_inputs.usable(torch.empty(0, 64)),
    "rows_strided": fp8_inputs.quantizes(torch.empty(8, 64)[:, :32]),
    "cols_strided": fp8_inputs.quantizes(torch.empty(64, 8).T),
}
input_calls, real_fns = {"norm_codes": [], "quantize_rows": []}, {}
for name in input_calls:
    real_fns[name] = getattr(fp8_inputs, name)
    setattr(
        fp8_inputs, name, lambda *a, _n=name: input_calls[_n].append(list(a[0].shape)) or real_fns[_n](*a)
    )
run.forward()  # one forward's calls
forward_calls = {name: len(calls) for name, calls in input_calls.items()}
with torch.no_grad():  # the kept camera injections of one chunk, against each block's own
    cam_tokens = run.model.embed_camera(run.cam, torch.float32)
    kept = run.model.camera_injections(cam_tokens, torch.float32)
    camera_calls = len(input_calls["quantize_rows"]) - forward_calls["quantize_rows"]
    own = [block.camera(cam_tokens, torch.float32) for block in run.model.blocks]
del input_calls["quantize_rows"][forward_calls["quantize_rows"] :]
for name, fn in real_fns.items():
    setattr(fp8_inputs, name, fn)


def interpreted_quantize_rows(t, _rows=fp8.quantize_rows):
    """`fp8.quantize_rows` with its e4m3 cast done the interpreter's way."""
    _, scale = _rows(t)
    return like_for_like(t, scale), scale


def fused_against_unfused(compute_dtype, cast_like_for_like: bool) -> float:
    """A tiny fp8 forward with the kernels against the unfused path: the relative L2 distance of their outputs.
    `cast_like_for_like`: every unfused quantization (the other linears' too) casts to e4m3 the interpreter's way."""
    tiny = TinyRun(layers=2)
    tiny.model.compute_dtype = compute_dtype
    real_rows = fp8.quantize_rows
    if cast_like_for_like:
        fp8.quantize_rows = interpreted_quantize_rows
    fused = tiny.forward()
    assert torch.isfinite(fused).all()
    fp8_inputs.enabled = False
    unfused = tiny.forward()
    fp8_inputs.enabled, fp8.quantize_rows = True, real_rows
    return float((fused - unfused).norm() / unfused.norm())


inputs["forward"] = {
    "calls": input_calls,
    # the kept injections: the tokens' codes once for all blocks, then 2 a block; 3 a block made one by one
    "camera_calls": camera_calls,
    "kept_equal_own": all(
        torch.equal(a, b)
        for pair, mine in zip(kept, own, strict=True)
        for a, b in zip(pair, mine, strict=True)
    ),
    "dim": run.model.blocks[0].norm1.normalized_shape[0],
    # fp32 compute, e4m3 cast the same way on both sides: the same forward
    "rel_fp32_like_for_like": fused_against_unfused(torch.float32, True),
    # bf16: the interpreter also truncates the bf16 roundings
    "rel_bf16_like_for_like": fused_against_unfused(torch.bfloat16, True),
    "rel_bf16": fused_against_unfused(torch.bfloat16, False),
}


# --- the fast decoder's causal conv kernel (`wan.tap_conv`) ---
CL3 = torch.channels_last_3d


def conv_case(c: int, co: int, dtype, bias: bool = True, frames: int = 4, size=(5, 7), config=None) -> dict:
    """The kernel on x's frames after a cache of 2 against the 3-D conv of the two concatenated (float64);
    `config` tunes an untuned width for the call."""
    x = torch.randn(1, c, frames, *size, generator=g).to(dtype).contiguous(memory_format=CL3)
    w = (torch.randn(co, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5).to(dtype).contiguous(memory_format=CL3)
    b = torch.randn(co, generator=g).to(dtype) if bias else None
    cache, new = x[:, :, :2].contiguous(memory_format=CL3), x[:, :, 2:].contiguous(memory_format=CL3)
    saved = dict(tap_conv.CONFIGS)
    tap_conv.CONFIGS[(c, co)] = config or tap_conv.CONFIGS[(c, co)]
    try:
        y = tap_conv.causal_conv(cache, new, tap_conv.pack(w), b)
    finally:
        tap_conv.CONFIGS = saved
    ref = F.conv3d(x.double(), w.double(), None if b is None else b.double(), padding=(0, 1, 1))
    return {
        "usable": tap_conv.usable(w),
        "rel": float((y.double() - ref).norm() / ref.norm()),
        "shape": list(y.shape),
        "dtype": str(y.dtype),
        "channels_last": channels_last_3d(y),
    }


conv_cases = {
    "96_fp32": conv_case(96, 96, torch.float32),
    "96_fp16_no_bias": conv_case(96, 96, torch.float16, bias=False),
    # the head: 3 output channels in a block of 16, the rest masked
    "96_to_3_fp16": conv_case(96, 3, torch.float16),
    # two column blocks of 128 + 64, one output frame, two pixel blocks with rows wrapping inside them; 192 is not
    # tuned (cuDNN is faster there), so the case brings a config (bf16 is left to the GPU: the interpreter's bf16
    # dot is not a GPU's)
    "192_fp16_one_frame": conv_case(192, 192, torch.float16, frames=3, size=(9, 40), config=(128, 4, 2)),
    "usable": {
        "96_fp32": tap_conv.usable(torch.zeros(96, 96, 3, 3, 3)),
        "192_fp16": tap_conv.usable(torch.zeros(192, 192, 3, 3, 3, dtype=torch.float16)),
        "96_to_192_fp16": tap_conv.usable(torch.zeros(192, 96, 3, 3, 3, dtype=torch.float16)),
        "2d_fp16": tap_conv.usable(torch.zeros(96, 96, 3, 3, dtype=torch.float16)),
    },
}


def decode_tiny(vae, latent, enabled: bool) -> tuple[torch.Tensor, list, int]:
    """(frames, the kernel's calls as x's shape + output channels, convs packed) of a tiny VAE's fp16 fast decode
    with its levers run eagerly (the compiled runner's steps, called as they are), the kernel tuned as on a GPU for
    its full-resolution residual convs (4 -> 4) and its head (4 -> 3) (one program a frame: the interpreter is slow
    per step), or not (`tap_conv.enabled`)."""
    calls, conv = [], tap_conv.causal_conv
    saved = tap_conv.CONFIGS, tap_conv.BLOCK_K, tap_conv.enabled, V.decoder_runner, tap_conv.causal_conv
    tap_conv.CONFIGS = {(4, 4): (2048, 4, 2), (4, 3): (2048, 4, 2)}
    tap_conv.BLOCK_K, tap_conv.enabled = 4, enabled
    V.decoder_runner = lambda device: lambda step, *args: step(*args)
    tap_conv.causal_conv = lambda cache, x, w, b: calls.append([*x.shape, w.shape[1]]) or conv(cache, x, w, b)
    try:
        with vae.chunk_decoder(dtype=torch.float16, compile=True, subpixel=True) as dec:
            packed = len(dec.decoder.levers.packed)
            out = torch.cat([dec.decode(latent[:, :1]), dec.decode(latent[:, 1:])], dim=1)
    finally:
        tap_conv.CONFIGS, tap_conv.BLOCK_K, tap_conv.enabled, V.decoder_runner, tap_conv.causal_conv = saved
    return out, calls, packed


vae = V.init_random_(V.WanVAE(**{**V.WAN21_VAE_CONFIG, "dim": 4}).eval(), 7)
latent = torch.randn(16, 3, 5, 6, generator=torch.Generator().manual_seed(3))
exact = vae.decode(latent)
with_kernel, kernel_calls, packed = decode_tiny(vae, latent, True)
without_kernel, no_calls, none_packed = decode_tiny(vae, latent, False)
conv_cases["decoder"] = {
    "packed": [packed, none_packed],
    "calls": kernel_calls,
    "calls_without": len(no_calls),
    "rel": float((with_kernel - without_kernel).norm() / without_kernel.norm()),
    "rel_exact": [float((d - exact).norm() / exact.norm()) for d in (with_kernel, without_kernel)],
}
print(
    json.dumps(
        {
            "cases": cases,
            "forward": forward,
            "usable": usable,
            "rope_cases": rope_cases,
            "inputs": inputs,
            "tap_conv": conv_cases,
        }
    )
)
