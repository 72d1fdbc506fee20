"""The fast decoder's causal 3x3x3 conv kernel (`wan.tap_conv`): checked on CPU tensors through Triton's interpreter
(conftest's `interpreted_kernels`). Its speed, and the decoded frames' PSNR against the fp32 decoder, are measured on
a GPU by benchmarks/bench_vae.py (BENCHMARKS.md)."""

import pytest
import torch
from lingbot_world.wan import tap_conv
from lingbot_world.wan import vae as V


def test_kernel_equals_the_3d_conv(interpreted_kernels):
    cases = interpreted_kernels["tap_conv"]
    # fp32: the same sums in another order; fp16: one rounding of the fp32 sum to the output
    assert cases["96_fp32"]["rel"] <= 1e-6
    for name in ("96_fp16_no_bias", "96_to_3_fp16", "192_fp16_one_frame"):
        assert 0 < cases[name]["rel"] <= 1e-3, name
        assert cases[name]["dtype"] == "torch.float16", name
    assert cases["96_fp32"]["shape"] == [1, 96, 2, 5, 7] and cases["96_to_3_fp16"]["shape"] == [1, 3, 2, 5, 7]
    assert cases["192_fp16_one_frame"]["shape"] == [1, 192, 1, 9, 40]
    for name in ("96_fp32", "96_fp16_no_bias", "96_to_3_fp16", "192_fp16_one_frame"):
        assert cases[name]["channels_last"], name  # channels-last-3d, as the decoder's next pass reads it


def test_kernel_takes_the_tuned_half_precision_widths_only(interpreted_kernels):
    cases = interpreted_kernels["tap_conv"]
    assert cases["96_fp16_no_bias"]["usable"] and cases["96_to_3_fp16"]["usable"]
    assert not cases["192_fp16_one_frame"]["usable"]  # runs when asked, but cuDNN is faster there
    assert cases["usable"] == {"96_fp32": False, "192_fp16": False, "96_to_192_fp16": False, "2d_fp16": False}


def test_the_fast_decoder_packs_its_tuned_convs_and_runs_them_as_the_kernel(interpreted_kernels):
    decoder = interpreted_kernels["tap_conv"]["decoder"]
    tiny = V.WanVAE(**{**V.WAN21_VAE_CONFIG, "dim": 4})
    convs = [tiny.decoder.head[2]]
    convs += [c for m in tiny.decoder.modules() if isinstance(m, V.ResidualBlock) for c in m.residual[2::4]]
    # the worker tunes the full-resolution stage's (input, output) widths (4, 4) and the head's (4, 3), as on a GPU
    tuned = [c for c in convs if (c.weight.shape[1], c.weight.shape[0]) in ((4, 4), (4, 3))]
    assert decoder["packed"] == [len(tuned), 0] and tiny.decoder.head[2] in tuned  # switched off: none packed
    # each call: x's shape, then the output channels
    assert {(shape[1], shape[-1]) for shape in decoder["calls"]} == {(4, 4), (4, 3)}
    assert decoder["calls_without"] == 0
    # the same fp16 decode up to its roundings, as far from the exact fp32 decode as without the kernel
    assert 0 < decoder["rel"] <= 5e-3
    with_kernel, without = decoder["rel_exact"]
    assert with_kernel <= 1.1 * without


def test_off_a_gpu_the_decoder_keeps_cudnn():
    """Without Triton's interpreter a CPU weight is not the kernel's: the levers pack nothing and `_tap_conv` keeps its
    2-D conv over the stacked taps."""
    weight = torch.zeros(96, 96, 3, 3, 3, dtype=torch.float16)
    assert not tap_conv.usable(weight)
    tiny = V.init_random_(V.WanVAE(**{**V.WAN21_VAE_CONFIG, "dim": 4}).eval(), 7)
    decoder = tiny.decoder_in(torch.float16, compile=False, subpixel=True)
    levers = V.DecoderLevers(decoder, tiny.decoder, lambda step, *args: step(*args))
    assert levers.packed == {}


def test_output_channels_as_power_of_two_column_blocks():
    assert tap_conv.blocks(96) == (64, 32) and tap_conv.blocks(192) == (128, 64)
    assert tap_conv.blocks(16) == (16, 0) and tap_conv.blocks(256) == (256, 0)
    # in one block, the columns past them masked: the head's 3, and counts no two blocks of 16+ make
    assert (
        tap_conv.blocks(3) == (16, 0) and tap_conv.blocks(112) == (128, 0) and tap_conv.blocks(72) == (128, 0)
    )


def test_pack_orders_rows_as_the_kernel_reduces():
    w = torch.randn(6, 4, 3, 3, 3)
    packed = tap_conv.pack(w)
    assert packed.shape == (27 * 4, 6) and packed.is_contiguous()
    # row (tap k, kh, kw, input channel c) holds w[:, c, k, kh, kw]
    k, kh, kw, c = 2, 0, 1, 3
    assert torch.equal(packed[((k * 3 + kh) * 3 + kw) * 4 + c], w[:, c, k, kh, kw])


def test_a_cache_that_is_not_two_frames_of_x_is_refused():
    x = torch.zeros(1, 96, 2, 5, 7, dtype=torch.float16)
    packed = tap_conv.pack(torch.zeros(96, 96, 3, 3, 3, dtype=torch.float16))
    for cache in (x[:, :, :1], torch.zeros(1, 96, 2, 5, 6, dtype=torch.float16)):
        with pytest.raises(ValueError, match="a cache of 2 frames like x"):
            tap_conv.causal_conv(cache, x, packed, None)
