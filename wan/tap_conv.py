"""The fast decoder's full-resolution causal 3x3x3 convs as one Triton implicit GEMM (Hopper).

A residual block's conv (96 channels in and out at the Wan2.1 decoder's last stage) and the head's (96 -> 3) take
their input x [1, c, t, H, W] after the conv's cache of 2 frames [1, c, 2, H, W] (both channels-last-3d: memory
t, H, W, c) and write [1, co, t, H, W] the same way: output frame j is the sum over the time taps k = 0..2 of frame
j+k of (cache, x) in its 3x3 neighbourhood (zero padded in H and W) times the tap's weights, plus the bias. One
program takes a block of an output frame's pixels and all its output channels; its reduction runs over (tap, kh,
kw, 32 input channels), reading the cache's and x's frames where they are. Products accumulate in fp32; the bias is
added before the one rounding to the output's dtype.

What it replaces (`vae._causal_conv`): the cache and x concatenated, then for the residual convs the three taps'
frames stacked in the channels for one cuDNN 2-D conv (`vae._tap_conv`), and for the head cuDNN's 3-D conv. In the
compiled fp16 decoder on an H200, two 16-frame chunks at 464x832 took 264.9 ms of kernels against 286.4, and
benchmarks/bench_vae.py's chunk 0.138 s against 0.146, at the same PSNR against the fp32 decoder (BENCHMARKS.md).
The kernel alone is about as fast as cuDNN's there; what goes is the concatenation and the stacking. At the
192-channel stage cuDNN's 3-D conv was faster than the kernel, so the other stages stay on cuDNN.

Used for the compiled fast decoder (`vae.DecoderLevers`, which packs each such conv's weight once, `pack`) on
compute capability 9.x, where it was measured; elsewhere cuDNN runs as before. Under TRITON_INTERPRET=1 it also
runs on CPU tensors (the tests).
"""

import torch

from .devices import channels_last_3d_strides, triton, triton_runs_on

if triton is not None:
    import triton.language as tl

# (input, output channels) -> (pixels per program, warps, pipeline stages): the Wan2.1 decoder's full-resolution
# residual convs, from an H200 sweep, and its head with the same (128 pixels measured no clear gain in the decoder;
# BENCHMARKS.md)
CONFIGS = {(96, 96): (256, 4, 3), (96, 3): (256, 4, 3)}
BLOCK_K = 32  # input channels per step of the reduction (96 is a multiple)
enabled = True  # the benchmarks' A/B switch (read when a decoder's levers are made)


def usable(weight: torch.Tensor) -> bool:
    """Whether a causal conv with `weight` [co, c, 3, 3, 3] runs as this kernel here: its widths tuned, a half
    precision, and a Hopper GPU (or Triton's interpreter)."""
    if not enabled or weight.dim() != 5 or tuple(weight.shape[2:]) != (3, 3, 3):
        return False
    co, c = weight.shape[:2]
    if (c, co) not in CONFIGS or weight.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not triton_runs_on(weight):
        return False
    return not weight.is_cuda or torch.cuda.get_device_capability(weight.device)[0] == 9


def blocks(co: int) -> tuple[int, int]:
    """The output channels as (first, second) power-of-two column blocks of at least 16 (Triton's tiles are powers
    of two, its dots at least 16 wide), second 0 where one block holds them: 96 = 64 + 32, 16 = 16 + 0; other
    counts in one block, its columns past co masked (3 -> 16, 112 -> 128)."""
    first = 1 << (co.bit_length() - 1)
    rest = co - first
    if first >= 16 and (rest == 0 or (rest >= 16 and rest & (rest - 1) == 0)):
        return first, rest
    return max(16, 1 << (co - 1).bit_length()), 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[co, c, 3, 3, 3] -> [27 c, co]: one row per (tap, kh, kw, input channel), the kernel's reduction order."""
    co, c = weight.shape[:2]
    return weight.permute(2, 3, 4, 1, 0).reshape(27 * c, co).contiguous()


if triton is not None:

    @triton.jit
    def _dot(a, w_ptr, rows, START: tl.constexpr, N: tl.constexpr, CO: tl.constexpr, acc):
        """acc += a @ columns START..START+N of the packed weight's `rows` (zeros past CO)."""
        cols = START + tl.arange(0, N)
        return tl.dot(a, tl.load(w_ptr + rows + cols[None, :], mask=(cols < CO)[None, :], other=0.0), acc)

    @triton.jit
    def _store(
        y_ptr,
        b_ptr,
        acc,
        pixels,
        inside,
        START: tl.constexpr,
        N: tl.constexpr,
        CO: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        """Columns START..START+N of the output rows at `pixels` (those under CO), the bias added, rounded once."""
        cols = START + tl.arange(0, N)
        real = cols < CO
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=real, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + pixels[:, None] * CO + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=inside[:, None] & real[None, :])

    @triton.jit
    def _causal_conv(
        cache_ptr,
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        height,
        width,
        C: tl.constexpr,
        CO: tl.constexpr,
        N0: tl.constexpr,
        N1: tl.constexpr,
        BM: tl.constexpr,
        BK: tl.constexpr,
        STAGES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        frame_pixels = height * width
        offsets = tl.program_id(0) * BM + tl.arange(0, BM)
        inside = offsets < frame_pixels
        row = offsets // width
        col = offsets - row * width
        # the output frame; its taps read frames j, j+1, j+2 of (the cache's 2, then x's)
        j = tl.program_id(1)
        rk = tl.arange(0, BK)
        acc0 = tl.zeros((BM, N0), tl.float32)
        if N1 > 0:
            acc1 = tl.zeros((BM, N1), tl.float32)
        else:
            acc1 = tl.zeros((BM, 16), tl.float32)  # unused: the compiler drops it
        STEPS: tl.constexpr = C // BK
        for step in tl.range(0, 27 * STEPS, num_stages=STAGES):
            tap = step // STEPS  # k * 9 + kh * 3 + kw
            c0 = (step - tap * STEPS) * BK
            k = tap // 9
            kh = (tap - k * 9) // 3
            kw = tap - k * 9 - kh * 3
            src_row = row + kh - 1
            src_col = col + kw - 1
            ok = inside & (src_row >= 0) & (src_row < height) & (src_col >= 0) & (src_col < width)
            f = j + k
            frame = tl.where(
                f < 2,
                cache_ptr + f.to(tl.int64) * frame_pixels * C,
                x_ptr + (f - 2).to(tl.int64) * frame_pixels * C,
            )
            a = tl.load(
                frame + ((src_row * width + src_col) * C + c0)[:, None] + rk[None, :],
                mask=ok[:, None],
                other=0.0,
            )
            rows = (tap * C + c0 + rk)[:, None] * CO
            acc0 = _dot(a, w_ptr, rows, 0, N0, CO, acc0)
            if N1 > 0:
                acc1 = _dot(a, w_ptr, rows, N0, N1, CO, acc1)
        out = y_ptr + j.to(tl.int64) * frame_pixels * CO
        _store(out, b_ptr, acc0, offsets, inside, 0, N0, CO, HAS_BIAS)
        if N1 > 0:
            _store(out, b_ptr, acc1, offsets, inside, N0, N1, CO, HAS_BIAS)


def causal_conv(
    cache: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The causal conv (padding 0, 1, 1) of x [1, c, t, H, W] after its cache's 2 frames [1, c, 2, H, W] (both
    channels-last-3d), with `packed` = pack(weight) [27 c, co] -> [1, co, t, H, W], channels-last-3d: what the 3-D
    conv of the two concatenated gives, without the concatenation."""
    _, c, frames, height, width = x.shape
    if cache.shape[2] != 2 or cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:]:
        raise ValueError(
            f"tap_conv: a cache of 2 frames like x {list(x.shape)} expected, got {list(cache.shape)}"
        )
    co = packed.shape[1]
    pixels, warps, stages = CONFIGS[(c, co)]
    cache = cache.contiguous(memory_format=torch.channels_last_3d)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    # the strides given as such: compiled, torch.empty(memory_format=...) becomes a permuted view of a dense
    # buffer, which inductor does not hand to the kernel to write in place; it made a NaN-filled copy before
    # each call instead (45 us at 96 channels; BENCHMARKS.md)
    shape = (1, co, frames, height, width)
    y = torch.empty_strided(shape, channels_last_3d_strides(shape), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(height * width, pixels), frames)
    _causal_conv[grid](
        cache,
        x,
        packed,
        packed if bias is None else bias,
        y,
        height,
        width,
        c,
        co,
        *blocks(co),
        pixels,
        BLOCK_K,
        stages,
        bias is not None,
        num_warps=warps,
    )
    return y
