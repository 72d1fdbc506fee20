"""Self-attention's q/k RMSNorm + RoPE in one Triton kernel (`wan.qk_rope`), checked on CPU tensors through Triton's
interpreter (conftest's `interpreted_kernels`): fp32 exactly enough to see the formulas; bf16 only loosely, as the
interpreter casts to bf16 toward zero where a GPU rounds to nearest (the GPU: benchmarks/bench_qk_rope.py)."""

import torch
from helpers import TinyRun
from lingbot_world.wan import dit, parallel, qk_rope


def test_kernel_matches_rmsnorm_then_rope(interpreted_kernels):
    cases = interpreted_kernels["rope_cases"]
    fp32, bf16 = cases["fp32"], cases["bf16"]
    assert fp32["usable"] and fp32["shape"] == [30, 96]
    # fp32: the largest difference a few roundings of the largest value (the sum of squares in another order)
    assert fp32["equal"] > 0.5 and fp32["max_ulps"] < 8, fp32
    assert fp32["forward_rel"] < 1e-6, fp32  # the self-attention's output with and without the kernel
    assert bf16["usable"] and bf16["max_ulps"] < 8 and bf16["forward_rel"] < 0.05, bf16
    assert cases["usable"] == {"complex": False, "other_length": False, "3d": False, "table": True}


def test_eager_and_sequence_parallel_blocks_rotate_as_before(monkeypatch):
    """The kernel needs the compiled runner's real table and the whole sequence's heads: eager blocks (complex
    freqs) and sequence-parallel ones never call it, so their q and k are normed and rotated as written."""
    monkeypatch.setattr(qk_rope, "usable", lambda x, table: not table.is_complex())  # as on a GPU
    attn = TinyRun(layers=1, use_fp8=False).model.blocks[0].self_attn
    x, grid = torch.randn(24, 64), (2, 3, 4)
    freqs = dit.rope_freqs(attn.head_dim)
    assert attn.normed_rotated(x, freqs, torch.float32) is None  # complex: eager
    monkeypatch.setattr(parallel, "current", lambda: object())
    assert attn.normed_rotated(x, dit.rope_table(grid, freqs), torch.float32) is None
    monkeypatch.setattr(parallel, "current", lambda: None)
    calls = []
    monkeypatch.setattr(qk_rope, "norm_rope", lambda norm, t, table, dtype: calls.append(norm) or t)
    q, k, v = attn.normed_rotated(x, dit.rope_table(grid, freqs), torch.float32)
    assert calls == [attn.norm_q, attn.norm_k] and q.shape == k.shape == v.shape == (
        24,
        attn.num_heads,
        attn.head_dim,
    )
