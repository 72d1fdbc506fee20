"""The fp8 FFN's fused GELU + row quantization (`wan.fp8_gelu`): a Triton kernel on CUDA, checked here on CPU
tensors through Triton's interpreter (conftest's `interpreted_kernels`).
The interpreter casts to bf16 toward zero and to e4m3 its own way, where a GPU rounds to nearest even: so codes are
compared with the unfused quotient cast by the interpreter too, and the GPU's equality with the unfused path is
measured by benchmarks/bench_fp8_gelu.py."""

import pytest
import torch
from helpers import TinyRun
from lingbot_world.wan import fp8, fp8_gelu


def test_kernel_matches_gelu_then_row_quantization(interpreted_kernels):
    cases = interpreted_kernels["cases"]
    for name in ("bf16", "fp32", "strided", "pow2"):
        case = cases[name]
        assert case["usable"] and case["dtype"] == "torch.float8_e4m3fn", name
    # codes: against the unfused path's quotient cast the interpreter's way; a bf16 GELU rounded toward zero
    # instead of to nearest can move a code by one step
    assert cases["fp32"]["codes_equal"] > 0.995, cases["fp32"]
    assert min(cases[name]["codes_equal"] for name in ("bf16", "strided", "pow2")) > 0.9, cases
    assert cases["strided"]["shape"] == [40, 80]  # a view's rows read at its stride
    # scales: one rounding of the GELU'd max apart at most (bf16: the interpreter truncates; fp32: an ulp)
    assert cases["bf16"]["scale_max_rel"] <= 2**-7 and cases["strided"]["scale_max_rel"] <= 2**-7
    assert cases["fp32"]["scale_max_rel"] <= 1e-6
    assert cases["zero_row"] == {"codes_max": 0.0, "scale": pytest.approx(1e-12 / 448, rel=1e-6)}


def test_fp8_ffn_takes_the_kernel_once_per_block(interpreted_kernels):
    forward = interpreted_kernels["forward"]
    # the tiny model's 2 blocks: one call each, on the [tokens, ffn_dim] hidden
    assert [shape[1] for shape in forward["kernel_calls"]] == [forward["ffn_dim"]] * 2
    assert forward["finite"] and 0 < forward["rel_deviation"] < 0.02


def test_without_the_kernel_the_ffn_is_the_unfused_path(monkeypatch):
    """On CPU (no interpreter) an fp8 forward never reaches the kernel: the GELU and `quantize_rows` run as written."""
    run = TinyRun(layers=2)
    h = torch.randn(4, 128)
    assert not fp8_gelu.usable(h)  # a CPU tensor
    assert fp8.gelu_linear(run.model.blocks[0].ffn[2], h, torch.bfloat16) is None

    def unreachable(h):
        raise AssertionError("the fused kernel ran on a CPU tensor")

    monkeypatch.setattr(fp8_gelu, "gelu_quantize_rows", unreachable)
    quantized = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: quantized.append(t.shape[-1]) or real(t))
    run.forward()
    ffn_dim = run.model.blocks[0].ffn[0].weight.shape[0]
    assert quantized.count(ffn_dim) == 2  # each block's GELU'd hidden, quantized by the unfused path


def test_gelu_linear_declines_what_it_cannot_fuse(monkeypatch):
    monkeypatch.setattr(fp8_gelu, "usable", lambda h: True)  # as on a GPU
    run, bf16 = TinyRun(layers=1), TinyRun(layers=1, use_fp8=False)
    h = torch.randn(4, 128)
    assert fp8.gelu_linear(bf16.model.blocks[0].ffn[2], h, torch.bfloat16) is None  # not an fp8 layer
    down = run.model.blocks[0].ffn[2]
    down.add_module("lora", torch.nn.Module())  # a LoRA side path reads the GELU'd input itself
    assert fp8.gelu_linear(down, h, torch.bfloat16) is None


def test_rows_split_into_few_power_of_two_blocks():
    from lingbot_world.wan.devices import power_of_two_blocks

    def blocks(cols):  # the GELU kernel's three
        return power_of_two_blocks(cols, 3)

    # the cases above: 300 columns take three blocks, 80 two, 64 one
    assert blocks(300) == (256, 32, 16) and blocks(80) == (64, 16, 0)
    assert blocks(64) == (64, 0, 0)
    assert blocks(8960) == (8192, 512, 256) and blocks(13824) == (8192, 4096, 2048)
    for cols in range(1, 3000):
        first, second, third = blocks(cols)
        assert first + second <= cols <= first + second + third or third == 0 and first + second == cols
        assert first + second + third - cols < max(third, 1)  # only the last block has idle lanes
        assert all(p == 0 or p & (p - 1) == 0 for p in (first, second, third)), cols


def test_kernel_takes_rows_that_fit_a_program(interpreted_kernels):
    assert interpreted_kernels["usable"] == {"widest": True, "too_wide": False, "3d": False, "no_rows": False}
