"""fp8 linears' inputs in one pass (`wan.fp8_inputs`): a block's residual update + LayerNorm + modulation + e4m3 row
codes, and the plain row quantization, as Triton kernels on CUDA, checked here on CPU tensors through Triton's
interpreter (conftest's `interpreted_kernels`). The interpreter casts to e4m3 its own way and to bf16 toward zero, so
codes are compared with the unfused path's quotient cast by the interpreter too, and roundings to a half-precision
dtype in fp16 (which it casts to nearest, as a GPU does). The GPU's agreement: BENCHMARKS.md (issue 21)."""

import types

import pytest
import torch
from helpers import TinyRun
from lingbot_world.wan import dit, fp8, fp8_inputs
from lingbot_world.wan.devices import power_of_two_blocks


def test_kernel_matches_the_unfused_block_input(interpreted_kernels):
    """The three norms of a block (`dit.block_input`): before self-attention (the FFN update of the block before,
    gated), on the block's first input (no update; the norm rounds to the input's dtype), before cross-attention
    (the attention's gated update, the camera's injection, an affine norm), before the FFN (a plain sum)."""
    inputs = interpreted_kernels["inputs"]
    for name in ("norm1", "norm1_first", "norm3", "norm3_first", "norm2", "norm3_cols_256", "norm3_cols_96"):
        case = inputs[name]
        assert case["usable"] and case["x_same_dtype"], (name, case)
        # the same additions and products, rounded the same way (the interpreter fuses no multiply-add)
        assert case["x_max_abs"] == 0.0, (name, case)
        # the mean and variance are summed in another order: a scale within an fp32 rounding or two
        assert case["scale_max_rel"] <= 5e-7 and case["codes_equal"] >= 0.995, (name, case)
    # a row as two power-of-two column tiles, none masked where the width allows (300 = 256 + 44 of 64)
    assert [inputs[f"norm3_cols_{w}"]["tiles"] for w in (256, 96)] == [[256, 0], [64, 32]]
    assert [power_of_two_blocks(c, 2) for c in (1536, 5120, 300)] == [(1024, 512), (4096, 1024), (256, 64)]
    assert inputs["norm1_first"]["x_dtype"] == "torch.float16"  # nothing updates it: given back as it came
    assert (
        inputs["norm3_first"]["x_dtype"] == "torch.float32"
    )  # an fp32 gate's update: fp32, as torch promotes
    for name, stride in (("rows", 300), ("rows_strided", 96)):  # a view's rows read at its stride
        case = inputs[name]
        assert case["stride"] == stride and case["scale_max_rel"] == 0.0 and case["codes_equal"] == 1.0, case
    # the codes of t + plus and of SiLU(t), rounded to t's dtype as torch returns them (the SiLU's exp is the
    # interpreter's): not the codes of t
    plus, silu = inputs["rows_plus"], inputs["rows_silu"]
    assert plus["scale_max_rel"] == 0.0 and plus["codes_equal"] == 1.0, plus
    assert silu["scale_max_rel"] <= 1e-3 and silu["codes_equal"] >= 0.9995, silu
    # the rounded sum and SiLU: not the ones left in fp32 (about 1 code in 500-1000 differs)
    for case in (plus, silu):
        assert case["unrounded_equal"] < case["codes_equal"], case
    assert max(inputs[name]["plain_equal"] for name in ("rows_plus", "rows_silu")) < 0.5, inputs


def test_fused_forward_is_the_unfused_forward(interpreted_kernels):
    forward = interpreted_kernels["inputs"]["forward"]
    dim, tokens = forward["dim"], 12
    # the tiny model's 2 blocks: three norms each, and the row quantization before both o-projections and of the
    # camera layers' three inputs (the tokens, the SiLU'd hidden rows, the scale and shift layers' shared input)
    assert forward["calls"]["norm_codes"] == [[tokens, dim]] * 6
    assert forward["calls"]["quantize_rows"] == [[tokens, dim]] * 10
    # a chunk's kept injections quantize the tokens once for both blocks, and equal each block's own
    assert forward["camera_calls"] == 1 + 2 * 2 and forward["kept_equal_own"], forward
    # fp32 compute and the e4m3 cast done the same way on both sides: the same forward
    assert forward["rel_fp32_like_for_like"] < 1e-6, forward
    # bf16: the interpreter truncates the camera's (1 + scale), the sum and the SiLU its layers' inputs are rounded
    # to, and the products it rounds
    assert 0 < forward["rel_bf16_like_for_like"] < 0.06, forward
    # and with torch's e4m3 casts on the unfused side, two ways of rounding every quantized input (a tiny model's
    # random weights amplify them; the GPU's deviation from the bf16 path: BENCHMARKS.md)
    assert forward["rel_bf16_like_for_like"] < forward["rel_bf16"] < 0.15, forward


def test_kernels_take_what_fits_a_program(interpreted_kernels):
    assert interpreted_kernels["inputs"]["usable"] == {
        "fp32": True,
        "bf16_gated": True,  # block 0's bf16 input plus an fp32-gated update: fp32 out, as the kernel computes
        "bf16_plain_update": False,  # a bf16 sum would round to bf16: the unfused path
        "bf16_no_update": True,
        "bf16_gate": False,  # its product would be rounded to bf16 first
        "other_rows": False,
        "widest": True,
        "too_wide": False,
        "3d": False,
        "no_rows": False,
        "rows_strided": True,
        "cols_strided": False,
    }


def test_on_cpu_the_block_inputs_are_the_unfused_path(monkeypatch):
    """Without the interpreter a CPU forward never reaches the kernels: its norms give tensors, and every fp8 input
    is quantized by `fp8.quantize_rows` as written."""

    def unreachable(*args):
        raise AssertionError("a fused kernel ran on a CPU tensor")

    monkeypatch.setattr(fp8_inputs, "norm_codes", unreachable)
    monkeypatch.setattr(fp8_inputs, "quantize_rows", unreachable)
    run = TinyRun(layers=1)
    assert not fp8_inputs.usable(torch.randn(4, 64)) and not fp8_inputs.quantizes(torch.randn(4, 64))
    quantized = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: quantized.append(t.shape[0]) or real(t))
    assert torch.isfinite(run.forward()).all()
    # q, k, v, cross q, both FFN layers, the camera's 4, both o-projections (12 tokens), text k/v (32 tokens)
    assert sorted(quantized) == [12] * 12 + [32] * 2


def test_wide_rows_leave_gated_updates_and_the_camera_to_the_unfused_path(monkeypatch):
    """Above `GATED_COLS` (the 14B's width) the norms after a gated update or with the camera's injection take the
    unfused path, which inductor compiles faster there; block 0's first norm and the plain update keep the kernel,
    and at the 1.3B's width every case does."""
    monkeypatch.setattr(fp8_inputs, "triton_runs_on", lambda t: True)  # as on a GPU
    for cols, wide in ((1536, False), (5120, True)):
        x, out, gate = torch.zeros(4, cols), torch.zeros(4, cols), torch.zeros(cols)
        assert fp8_inputs.usable(x.bfloat16())  # block 0's first norm
        assert fp8_inputs.usable(x, (out, None))  # before the FFN
        assert fp8_inputs.usable(x, (out, gate)) is not wide  # before self-attention
        assert fp8_inputs.usable(x, (out, gate), camera=True) is not wide  # before cross-attention
        assert fp8_inputs.usable(x, camera=True) is not wide
    made = []
    monkeypatch.setattr(
        fp8_inputs, "norm_codes", lambda x, *a: made.append(x.shape) or (x, *fp8.quantize_rows(x))
    )
    norm = dit.WanLayerNorm(5120, 1e-6)
    fp8_layer = types.SimpleNamespace(weight=torch.zeros(1, dtype=fp8.FP8))
    monkeypatch.setattr(dit, "take_codes", lambda *layers: True)
    x, out, gate = torch.randn(4, 5120), torch.randn(4, 5120), torch.rand(5120)
    y, h = dit.block_input(x, norm, (fp8_layer,), (out, gate))
    assert made == [] and torch.equal(y, x + out * gate)  # unfused: the residual updated as written
    dit.block_input(x, norm, (fp8_layer,), (out, None))
    assert made == [(4, 5120)]


def test_only_fp8_layers_without_side_paths_take_codes(monkeypatch):
    monkeypatch.setattr(fp8_inputs, "usable", lambda x, update=None, camera=False: True)  # as on a GPU
    made = []
    monkeypatch.setattr(
        fp8_inputs, "norm_codes", lambda x, *a: made.append(a) or (x, *fp8.quantize_rows(x.float()))
    )
    block = TinyRun(layers=1).model.blocks[0]
    plain = TinyRun(layers=1, use_fp8=False).model.blocks[0]
    x = torch.randn(6, 64)
    _, h = dit.block_input(x, plain.norm2, (plain.ffn[0],))  # bf16 weights: a tensor, as written
    assert isinstance(h, torch.Tensor) and made == []
    _, h = dit.block_input(x, block.norm2, (block.ffn[0],))
    assert isinstance(h, fp8.RowCodes) and len(made) == 1
    block.ffn[0].add_module("lora", torch.nn.Module())  # a LoRA side path reads the input itself
    _, h = dit.block_input(x, block.norm2, (block.ffn[0],))
    assert isinstance(h, torch.Tensor) and len(made) == 1
    _, h = dit.block_input(
        x, torch.nn.Identity(), (block.cross_attn.q,)
    )  # no norm to fuse (cross_attn_norm off)
    assert isinstance(h, torch.Tensor) and len(made) == 1


def test_row_codes_feed_the_ffn_chunk_by_chunk(monkeypatch):
    """An FFN input given as codes is split into token chunks past FFN_CHUNK as a tensor input is: same values."""
    block = TinyRun(layers=1).model.blocks[0]
    h = torch.randn(10, 64)
    want = block.feed_forward(h, torch.bfloat16)
    codes = fp8.RowCodes(*fp8.quantize_rows(h))
    assert torch.equal(block.feed_forward(codes, torch.bfloat16), want)
    monkeypatch.setattr(dit, "FFN_CHUNK", 4)
    chunked = block.feed_forward(codes, torch.bfloat16)
    assert chunked.shape == want.shape and torch.equal(chunked, block.feed_forward(h, torch.bfloat16))


def test_a_linear_input_takes_a_sum_or_a_silu_and_computes_it_where_no_codes_are_made():
    layer, t, plus = torch.nn.Linear(8, 4), torch.randn(3, 8), torch.randn(3, 8)
    # a dense layer takes no codes: the rows come back computed as torch computes them
    assert torch.equal(dit.linear_input(t, layer, plus=plus), t + plus)
    assert torch.equal(dit.linear_input(t, layer, silu=True), torch.nn.functional.silu(t))
    assert dit.linear_input(t, layer) is t
    for refuse in (dit.linear_input, fp8_inputs.quantize_rows):
        args = (t, layer) if refuse is dit.linear_input else (t,)
        with pytest.raises(ValueError, match="a sum or a SiLU, not both"):
            refuse(*args, plus=plus, silu=True)
    with pytest.raises(ValueError, match="name the layers"):
        dit.linear_input(t)
    # a sum the kernel would misread: other rows, another dtype, columns apart
    for bad in (plus[:2], plus.double(), torch.randn(8, 3).T):
        with pytest.raises(ValueError, match="plus must be of t's shape"):
            fp8_inputs.quantize_rows(t, bad)
