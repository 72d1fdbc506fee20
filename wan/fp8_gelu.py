"""The fp8 FFN's hidden activation in one pass (Triton): tanh-GELU, each row's amax and its e4m3 codes.

With fp8 linears, a block's FFN hidden h = ffn[0](x) [tokens, ffn_dim] is GELU'd and then quantized per row for
ffn[2]'s scaled matmul (`wan.fp8.quantize_rows`). Compiled, inductor fuses that into a looped reduction that reads
each row twice: on an H100 a steady v2 1.3B chunk spent 29 ms there, about 3x the time its bytes need. Here one
program holds a whole row in registers (ffn_dim <= `MAX_COLS`): one read of h, one write of the codes.

Same formulas as the unfused path: GELU(approximate='tanh') in fp32, rounded to h's dtype (what the GELU module
returns), scale = max(amax, 1e-12) / 448, codes = clamp(y / scale, +-448) cast to e4m3 (round to nearest even). Two
departures, both of the size of the casts to h's dtype and to e4m3: tanh is the GPU's own approximation
(`tanh.approx.f32`, one special-function instruction; under Triton's interpreter, which runs no PTX,
1 - 2 / (exp(2u) + 1)), where torch's tanhf takes tens of instructions and the kernel was bound by arithmetic (inside a
CUDA graph on an H200: 69 -> 53 us at the 1.3B's shape, 113 -> 88 us at the 14B's); and y / scale is y times the
row's 1 / scale, one product where a division per element took another special-function instruction (torch divides
exactly). So a code can move by one e4m3 step: 0.13 % of them against the unfused path on an H200, measured by
benchmarks/bench_fp8_gelu.py (the scales equal).

Used on CUDA where Triton is installed (torch.compile traces the kernel as it is); elsewhere the unfused path runs.
Under TRITON_INTERPRET=1 it also runs on CPU tensors (the tests; the interpreter casts to e4m3 its own way).
"""

import torch

from .devices import power_of_two_blocks, triton, triton_runs_on

if triton is not None:
    import triton.language as tl

MAX_COLS = 16384  # a row lives in one program's registers; wider rows take the unfused path
enabled = True  # the benchmarks' A/B switch (read at trace time: a compiled block guards on it)


def usable(h: torch.Tensor) -> bool:
    """Whether `gelu_quantize_rows` runs for hidden `h` [rows, cols] here."""
    return enabled and triton_runs_on(h) and h.dim() == 2 and h.numel() > 0 and h.shape[1] <= MAX_COLS


if triton is not None:

    @triton.jit
    def _tanh(u, APPROX: tl.constexpr):
        """tanh(u): the GPU's `tanh.approx.f32` (`APPROX`), else 1 - 2 / (exp(2u) + 1) (the interpreter's)."""
        if APPROX:
            return tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1
            )
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def _gelu_block(h_row, start, cols, SIZE: tl.constexpr, APPROX: tl.constexpr):
        """One block of a row: (GELU_tanh of it in fp32, rounded to h's dtype as the GELU module returns it; its
        offsets; their mask)."""
        offsets = start + tl.arange(0, SIZE)
        mask = offsets < cols
        x = tl.load(h_row + offsets, mask=mask, other=0.0).to(tl.float32)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) * (x + 0.044715 x^3)
        y = 0.5 * x * (1.0 + _tanh(u, APPROX))
        return y.to(h_row.dtype.element_ty).to(tl.float32), offsets, mask

    @triton.jit
    def _store_codes(codes_row, y, inverse, offsets, mask):
        """One block's e4m3 codes: clamp(y * (1 / scale), +-448), cast (round to nearest even)."""
        codes = tl.clamp(y * inverse, -448.0, 448.0).to(codes_row.dtype.element_ty)
        tl.store(codes_row + offsets, codes, mask=mask)

    @triton.jit
    def _gelu_fp8_rows(
        h_ptr,
        codes_ptr,
        scale_ptr,
        cols,
        h_stride,
        FIRST: tl.constexpr,
        SECOND: tl.constexpr,
        THIRD: tl.constexpr,
        APPROX: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        h_row, codes_row = h_ptr + row * h_stride, codes_ptr + row * cols
        y1, offsets1, mask1 = _gelu_block(h_row, 0, cols, FIRST, APPROX)
        amax = tl.max(tl.abs(y1), axis=0)
        if SECOND > 0:
            y2, offsets2, mask2 = _gelu_block(h_row, FIRST, cols, SECOND, APPROX)
            amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=0))
        if THIRD > 0:
            y3, offsets3, mask3 = _gelu_block(h_row, FIRST + SECOND, cols, THIRD, APPROX)
            amax = tl.maximum(amax, tl.max(tl.abs(y3), axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0  # wan.fp8's _TINY floor and FP8_MAX
        inverse = 1.0 / scale
        _store_codes(codes_row, y1, inverse, offsets1, mask1)
        if SECOND > 0:
            _store_codes(codes_row, y2, inverse, offsets2, mask2)
        if THIRD > 0:
            _store_codes(codes_row, y3, inverse, offsets3, mask3)
        tl.store(scale_ptr + row, scale)


def warps(cols: int) -> int:
    """Warps per row, from benchmarks/bench_fp8_gelu.py's sweep on an H100: 8 for the v2 1.3B's 8,960 columns
    (0.092 ms against 0.105 with 16), 16 for 13,824 (0.142 against 0.142; 0.62 against 0.69 ms at base-cam's
    31,668 rows)."""
    return 8 if cols <= 12288 else 16


def launch(h, codes, scale, num_warps: int | None = None) -> None:
    rows, cols = h.shape
    num_warps = num_warps or warps(cols)
    # the GPU's tanh instruction (PTX: NVIDIA's); Triton's interpreter (CPU tensors) and ROCm run no PTX
    approx = h.is_cuda and torch.version.hip is None
    _gelu_fp8_rows[(rows,)](
        h, codes, scale, cols, h.stride(0), *power_of_two_blocks(cols, 3), approx, num_warps=num_warps
    )


def gelu_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, cols], fp32 scales [rows]) of GELU_tanh(h), as `wan.fp8.quantize_rows(gelu(h))`."""
    if h.stride(1) != 1:
        h = h.contiguous()
    rows, cols = h.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=h.device)
    scale = torch.empty(rows, dtype=torch.float32, device=h.device)
    launch(h, codes, scale)
    return codes, scale
