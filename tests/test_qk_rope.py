"""Self-attention's q/k RMSNorm + RoPE in one Triton kernel (`wan.qk_rope`), checked on CPU tensors through
Triton's interpreter (conftest's `interpreted_kernels`). The interpreter casts to fp16 to nearest, as a GPU does,
so fp16 shows every rounding of the formulas; it casts to bf16 toward zero, so bf16 is checked only loosely (the
GPU's bf16: benchmarks/bench_qk_rope.py)."""

import re

import torch
from helpers import TinyRun
from lingbot_world.wan import dit, parallel, qk_rope


def test_kernel_matches_rmsnorm_then_rope(interpreted_kernels):
    cases = interpreted_kernels["rope_cases"]
    for name in ("fp32", "fp16", "fp16_strided", "bf16"):
        assert cases[name]["usable"] and cases[name]["shape"] == [30, 96], name
    # fp16: the module's roundings (norm, weight, rotation, output) one for one: every value equal
    for name in ("fp16", "fp16_strided"):
        assert cases[name]["equal"] == 1.0 and cases[name]["forward_rel"] == 0.0, cases[name]
    # the pairs read at a stride of two or as whole tiles, a row as two tiles (96 = 64 + 32), one (64) or two with
    # the second partly masked (112 = 64 + 64): the same values, within a rounding where the sum of squares per tile
    # rounds otherwise
    for way in ("strided", "whole_tiles"):
        for width in (96, 64, 112):
            case = cases[f"fp16_{way}_{width}"]
            assert case["usable"] and case["shape"] == [30, width], (way, width, case)
            assert case["max_ulps"] < 2 and case["forward_rel"] < 1e-3, (way, width, case)
            assert case["equal"] >= 0.99 and (width == 112 or case["equal"] == 1.0), (way, width, case)
        codes, keys = cases[f"codes_fp16_{way}_112"], cases[f"key_codes_fp16_{way}_112"]
        assert codes["codes_equal"] > 0.995 and codes["max_code"] < 448, (way, codes)
        assert keys["codes_equal"] == 1.0 and keys["max_code"] == 448.0, (way, keys)
    assert cases["fp16_strided"]["stride"] == 128  # rows read at the view's stride
    # fp32: within a rounding of the largest value (the sum of squares is taken in another order)
    assert cases["fp32"]["max_ulps"] < 2 and cases["fp32"]["forward_rel"] < 1e-6, cases["fp32"]
    assert cases["bf16"]["max_ulps"] < 8 and cases["bf16"]["forward_rel"] < 0.05, cases["bf16"]
    assert cases["zero_rows"] == {"finite": True, "max_abs": 0.0}  # eps keeps an all-zero row at zero
    # the e4m3 queries: each head at its weight bound's scale, nothing saturated, the same codes as quantizing the
    # rotated q (rounded to its dtype) by those scales; cast to nearest, as near q as codes at each head's amax
    for name in ("codes_fp16", "codes_fp32"):
        case = cases[name]
        assert (
            case["dtype"] == "torch.float8_e4m3fn" and case["shape"] == [30, 96] and case["scale"] == [1, 4]
        )
        assert case["scale_max_rel"] < 1e-6 and case["max_code"] < 448, case
        assert case["codes_equal"] > 0.995 and case["decoded_rel"] < 1.25 * case["amax_decoded_rel"] < 0.1, (
            case
        )
    assert cases["usable"] == {
        "complex": False,
        "other_length": False,
        "3d": False,
        "other_head_dim": False,
        "table": True,
    }


def test_kernel_writes_an_fp8_caches_keys_as_the_cache_stores_them(interpreted_kernels):
    """With an fp8 K/V cache the k kernel writes e4m3 at scale 1: the keys rounded to their dtype, clamped to 448 and
    cast, the codes the cache's own store gives (both cast the interpreter's way). Given the cache's slots
    (`Bidirectional.key_slot`) a self-attention's forward has the kernel write its keys there, and its values and
    queries as before. Against the store's torch cast the interpreter's own cast moves some codes by a step (on a GPU
    both are one instruction)."""
    for dtype in ("fp16", "bf16"):
        case = interpreted_kernels["rope_cases"][f"key_codes_{dtype}"]
        assert case["dtype"] == "torch.float8_e4m3fn" and case["codes_equal"] == 1.0, case
        assert case["max_code"] == 448.0, case  # the large head saturates, as the cache clamps
        half = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}[dtype]
        assert case["kernel_dtypes"] == [half, "into torch.float8_e4m3fn", half, half], case
        assert case["cache_values_equal"] and case["cache_keys_equal"] >= 0.9, case
        assert case["forward_rel"] < 0.15, case


def test_compiled_the_kernel_writes_keys_into_the_cache_itself(interpreted_kernels):
    """Compiled (inductor on the CPU), the op that writes chunks' keys into the cache's slots gets the cache itself
    (the graph's input, not a copy of the cache to write back) and the chunk's first row. With static shapes and
    with dynamic ones (live play's growing chunks, a symbolic row) it leaves the cache the eager run leaves:
    chunks 1 and 2 written, chunk 0 kept."""
    for name in ("key_slot_compiled", "key_slot_compiled_dynamic"):
        case = interpreted_kernels["rope_cases"][name]
        assert case["cache_equal"] and case["chunk0_kept"] and case["chunks_written"], (name, case)
        assert case["calls"], (name, case)
        row = r"s\d+" if name.endswith("dynamic") else r"\d+"  # dynamic: one graph for every chunk's row
        for call in case["calls"]:
            assert re.search(r", arg\d+_1, " + row + r"\)$", call), (name, case)


def test_a_block_has_the_kernel_write_its_keys_into_the_cache(interpreted_kernels):
    """A DiT block given the RoPE table (as the compiled runners give it) and a chunk-causal cache has the kernel
    write its keys into the cache's slots, whole and for its keys alone (the commit pass's last block), and leaves
    the cache and its output as with no slots offered."""
    case = interpreted_kernels["rope_cases"]["key_slot_block"]
    assert case["into_calls"] == [True, True], case
    assert case["keys_equal"] and case["chunk_written"] and case["out_equal"], case
    assert case["keys_only_equal"], case


def test_only_compiled_blocks_outside_sequence_parallel_take_the_kernel(monkeypatch):
    """The kernel needs the compiled runner's real table, the whole sequence's heads and an RMSNorm: eager blocks
    (complex freqs), sequence-parallel ones and ones without q/k norms never call it, so their q and k are normed
    and rotated as written."""
    monkeypatch.setattr(qk_rope, "triton_runs_on", lambda t: True)  # as on a GPU
    calls = []
    monkeypatch.setattr(qk_rope, "norm_rope", lambda norm, t, table, dtype: calls.append(norm) or t)
    attn = TinyRun(layers=1, use_fp8=False).model.blocks[0].self_attn
    x, grid = torch.randn(24, 64), (2, 3, 4)
    freqs = dit.rope_freqs(attn.head_dim)
    table = dit.rope_table(grid, freqs)
    assert not attn.rotates_in_norm(x, freqs)  # complex: eager
    monkeypatch.setattr(parallel, "current", lambda: object())
    assert not attn.rotates_in_norm(x, table)
    monkeypatch.setattr(parallel, "current", lambda: None)
    plain = dit.WanSelfAttention(64, attn.num_heads, qk_norm=False)
    assert not plain.rotates_in_norm(x, table)
    assert calls == []
    assert attn.rotates_in_norm(x, table)
    q, k, v = attn.qkv(x, torch.float32, rope=table)
    assert calls == [attn.norm_q, attn.norm_k]
    assert q.shape == k.shape == v.shape == (24, attn.num_heads, attn.head_dim)
    calls.clear()
    attn(x, grid, table, torch.float32)  # the forward takes the kernel
    assert calls == [attn.norm_q, attn.norm_k]


def test_lean_blocks_rotate_in_place_without_the_kernel(monkeypatch):
    """`forward_lean` fills q, k and v chunk by chunk and rotates them in place: it never takes the kernel, even
    with the compiled runner's table."""
    monkeypatch.setattr(qk_rope, "triton_runs_on", lambda t: True)

    def unreachable(*args):
        raise AssertionError("the lean block took the q/k kernel")

    monkeypatch.setattr(qk_rope, "norm_rope", unreachable)
    block = TinyRun(layers=1, use_fp8=False).model.blocks[0]
    grid = (2, 3, 4)
    x, e0 = torch.randn(24, 64), torch.randn(1, 6, 64) * 0.1
    table = dit.rope_table(grid, dit.rope_freqs(block.self_attn.head_dim))
    context = torch.randn(5, 64)
    with torch.no_grad():
        out = block.forward_lean(x.clone(), e0, grid, table, context, None, torch.float32, chunk=8)
    assert out.shape == (24, 64) and torch.isfinite(out).all()
