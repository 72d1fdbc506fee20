"""fp8 linears' inputs in one pass (Triton): a block's residual update, LayerNorm, modulation and each row's e4m3
codes (`norm_codes`), and the row quantization of an attention's output or of the camera layers' inputs, a sum or a
SiLU taken on the way (`quantize_rows`).

With fp8 linears, each of a block's three norms (before self-attention, cross-attention and the FFN) feeds scaled
matmuls that take the normed rows as e4m3 codes with a scale per row (`wan.fp8.quantize_rows`). Compiled, inductor
fused the residual's update, the norm, the modulation and the quantization into a looped reduction. Here one program
holds two whole rows in registers, each as two power-of-two column tiles (`devices.power_of_two_blocks`: 1,536 =
1,024 + 512 and 5,120 = 4,096 + 1,024, where one tile of 2,048 or 8,192 masked a quarter or three eighths of its
lanes): one read of each input, one write of the updated residual and of the codes. Inside a CUDA graph on an H200, at a v2 1.3B
chunk's 6,032 tokens x 1,536 (the norms before self-attention / cross-attention / the FFN): 34 / 43 / 32 us a call
against inductor's 51 / 60 / 48, and the o-projections' row quantization 7 us against 18; at the 14B's 5,120
columns 122 / 148 / 117 us against 132 / 152 / 141, and 27 us against 53. Figures and the chunk loop's time:
BENCHMARKS.md (issue 21).

Same formulas as the block's unfused path, in its order: x + update (times its gate), then the camera's injection
(1 + scale, rounded to the scale's dtype) * x + shift, in fp32; LayerNorm in fp32 (rounded to x's dtype where x is
not fp32, as `WanLayerNorm` returns it), its affine weight and bias or the modulation * (1 + scale) + shift; scale =
max(amax, 1e-12) / 448 and codes = clamp(y / scale, +-448) cast to e4m3. The mean and variance are summed in another
order than torch's (two passes over the row in registers, not Welford), the divisions are Triton's, and on a GPU a
product and the sum after it may be rounded once (a fused multiply-add, as in inductor's compile of the same lines):
so the residual can move by an fp32 rounding and a code by one e4m3 step (how often:
benchmarks/bench_fp8_inputs.py). Where inductor compiled the camera's injection it did not round 1 + scale to bf16
as the eager path does; the kernel does.

Used on CUDA where Triton is installed, as two ops (`devices.lingbot_op`); elsewhere the unfused path runs. Under
TRITON_INTERPRET=1 also on CPU tensors (the tests).
"""

import torch

from .devices import lingbot_op, power_of_two_blocks, triton, triton_runs_on

if triton is not None:
    import triton.language as tl

FP8 = torch.float8_e4m3fn
MAX_COLS = 8192  # two rows live in one program's registers; wider rows take the unfused path
ROWS = 2  # rows per program (an H200's sweep at 1,536 and 5,120 columns: 2 was best or within 3 % of it)
enabled = True  # the benchmarks' A/B switch (read at trace time: a compiled block guards on it)
# Above this width (the 14B's 5,120 columns) the norms after a gated update (before self-attention; before
# cross-attention, with the camera's injection) run unfused. With one masked tile per row the kernel took 136 and 200
# us a call there against inductor's 121 and 152 on an H200, and the 14B chunk went 1.5759 -> 1.5642 s without it;
# with two unmasked tiles, 122 and 148 against 132 and 152 us, and the chunk was even (1.5717 s unfused, 1.5703 with
# the kernel), so the split stays (BENCHMARKS.md). At the 1.3B's 1,536 the kernel is the faster.
GATED_COLS = 2048


def _rows_fit(t: torch.Tensor) -> bool:
    return enabled and triton_runs_on(t) and t.dim() == 2 and t.shape[0] > 0 and 0 < t.shape[1] <= MAX_COLS


def usable(x: torch.Tensor, update=None, camera: bool = False) -> bool:
    """Whether `norm_codes` runs here for residual x [rows, cols] and `update` (its (output [rows, cols], gate [cols]
    or None) or None), `camera`: with the camera's injection. The updated residual must come out in fp32, as the
    kernel computes it (x in fp32, or an fp32 gate: block 0's bf16 input plus its attention's gated update), and a
    gate must be fp32 (its product unrounded). Wider than `GATED_COLS`, a gated update or the injection is left to
    the unfused path."""
    if not _rows_fit(x):
        return False
    gate = None if update is None else update[1]
    if x.shape[1] > GATED_COLS and (camera or gate is not None):
        return False
    if update is None:
        return True
    out = update[0]
    if out.shape != x.shape or (
        gate is not None and (gate.dtype != torch.float32 or gate.shape != x.shape[1:])
    ):
        return False
    return x.dtype == torch.float32 or gate is not None


def quantizes(t: torch.Tensor) -> bool:
    """Whether `quantize_rows` runs here for t [rows, cols]."""
    return _rows_fit(t) and t.stride(1) == 1


def warps(cols: int) -> int:
    """From an H200's sweep (2-16 warps, 1-8 rows a program): 2 for 1,536 columns, 4 for 5,120."""
    return 2 if cols <= 2048 else 4


if triton is not None:

    @triton.jit
    def _row_tile(start, rows, cols, first, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """A tile of ROWS rows and BLOCK columns from column `first`: (row indices, column indices, its mask, its
        element offsets at row stride cols)."""
        r = start + tl.arange(0, ROWS)
        c = first + tl.arange(0, BLOCK)
        mask = (r < rows)[:, None] & (c < cols)[None, :]
        return r, c, mask, r.to(tl.int64)[:, None] * cols + c[None, :]

    @triton.jit
    def _row_scale(amax):
        return tl.maximum(amax, 1e-12) / 448.0  # wan.fp8's _TINY floor and FP8_MAX

    @triton.jit
    def _store_codes(y, scale, codes_ptr, offsets, mask):
        """codes clamp(y / scale, +-448) cast to e4m3 (nearest)."""
        codes = tl.clamp(y / scale[:, None], -448.0, 448.0).to(codes_ptr.dtype.element_ty)
        tl.store(codes_ptr + offsets, codes, mask=mask)

    @triton.jit
    def _store_row_codes(y, codes_ptr, scale_ptr, r, rows, offsets, mask):
        """Each row's scale max(amax, 1e-12) / 448 and its codes."""
        y = tl.where(mask, y, 0.0)
        scale = _row_scale(tl.max(tl.abs(y), axis=1))
        _store_codes(y, scale, codes_ptr, offsets, mask)
        tl.store(scale_ptr + r, scale, mask=r < rows)

    @triton.jit
    def _updated_part(
        x_ptr,
        update_ptr,
        gate_ptr,
        cam_scale_ptr,
        cam_shift_ptr,
        x_out_ptr,
        c,
        offsets,
        mask,
        col_mask,
        UPDATE: tl.constexpr,
        GATED: tl.constexpr,
        CAMERA: tl.constexpr,
    ):
        """One column tile of the rows: x plus its (gated) update, then the camera's injection, in fp32, stored
        as the residual's new value where anything updated it."""
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if UPDATE:
            u = tl.load(update_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if GATED:
                u = u * tl.load(gate_ptr + c, mask=col_mask, other=0.0)[None, :]
            x = x + u
        if CAMERA:
            s = tl.load(cam_scale_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            s = (1.0 + s).to(cam_scale_ptr.dtype.element_ty).to(tl.float32)
            x = s * x + tl.load(cam_shift_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if UPDATE or CAMERA:
            tl.store(x_out_ptr + offsets, x, mask=mask)
        return x

    @triton.jit
    def _normed_part(
        d,
        rstd,
        x_ptr,
        weight_ptr,
        bias_ptr,
        c,
        col_mask,
        AFFINE: tl.constexpr,
        MODULATE: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        """One column tile's normed values from its centred x `d`: the norm's affine or the modulation."""
        y = d * rstd[:, None]
        if AFFINE:
            y = y * tl.load(weight_ptr + c, mask=col_mask, other=0.0)[None, :]
            y = y + tl.load(bias_ptr + c, mask=col_mask, other=0.0)[None, :]
        if ROUND:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        if MODULATE:  # weight_ptr, bias_ptr: the modulation's scale and shift
            y = y * (1.0 + tl.load(weight_ptr + c, mask=col_mask, other=0.0))[None, :]
            y = y + tl.load(bias_ptr + c, mask=col_mask, other=0.0)[None, :]
        return y

    @triton.jit
    def _norm_codes_rows(
        x_ptr,
        update_ptr,
        gate_ptr,
        cam_scale_ptr,
        cam_shift_ptr,
        weight_ptr,
        bias_ptr,
        x_out_ptr,
        codes_ptr,
        scale_ptr,
        rows,
        cols,
        eps,
        BLOCK: tl.constexpr,
        TAIL: tl.constexpr,
        ROWS: tl.constexpr,
        UPDATE: tl.constexpr,
        GATED: tl.constexpr,
        CAMERA: tl.constexpr,
        AFFINE: tl.constexpr,
        MODULATE: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        # the rows in two power-of-two column tiles, [0, BLOCK) and [BLOCK, BLOCK + TAIL)
        start = tl.program_id(0) * ROWS
        r, c, mask, offsets = _row_tile(start, rows, cols, 0, BLOCK, ROWS)
        ins = (x_ptr, update_ptr, gate_ptr, cam_scale_ptr, cam_shift_ptr, x_out_ptr)
        x = _updated_part(*ins, c, offsets, mask, c < cols, UPDATE, GATED, CAMERA)
        total = tl.sum(x, axis=1)
        if TAIL > 0:
            _, ct, mask_t, offsets_t = _row_tile(start, rows, cols, BLOCK, TAIL, ROWS)
            xt = _updated_part(*ins, ct, offsets_t, mask_t, ct < cols, UPDATE, GATED, CAMERA)
            total += tl.sum(xt, axis=1)
        mean = total / cols
        d = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(d * d, axis=1)
        if TAIL > 0:
            dt = tl.where(mask_t, xt - mean[:, None], 0.0)
            var += tl.sum(dt * dt, axis=1)
        rstd = tl.math.rsqrt(var / cols + eps)
        outs = (x_ptr, weight_ptr, bias_ptr)
        y = tl.where(mask, _normed_part(d, rstd, *outs, c, c < cols, AFFINE, MODULATE, ROUND), 0.0)
        amax = tl.max(tl.abs(y), axis=1)
        if TAIL > 0:
            yt = _normed_part(dt, rstd, *outs, ct, ct < cols, AFFINE, MODULATE, ROUND)
            yt = tl.where(mask_t, yt, 0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(yt), axis=1))
        scale = _row_scale(amax)
        _store_codes(y, scale, codes_ptr, offsets, mask)
        if TAIL > 0:
            _store_codes(yt, scale, codes_ptr, offsets_t, mask_t)
        tl.store(scale_ptr + r, scale, mask=r < rows)

    @triton.jit
    def _codes_rows(
        t_ptr,
        plus_ptr,
        codes_ptr,
        scale_ptr,
        rows,
        cols,
        t_stride,
        plus_stride,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        PLUS: tl.constexpr,
        SILU: tl.constexpr,
    ):
        """The rows' codes; `PLUS`: of t + plus, `SILU`: of SiLU(t), each rounded to t's dtype as torch returns it."""
        r, c, mask, offsets = _row_tile(tl.program_id(0) * ROWS, rows, cols, 0, BLOCK, ROWS)
        r64 = r.to(tl.int64)[:, None]
        y = tl.load(t_ptr + r64 * t_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if PLUS:
            y += tl.load(plus_ptr + r64 * plus_stride + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if SILU:
            y = y / (1.0 + tl.exp(-y))  # torch's formula (Triton's exp: within a rounding of torch's)
        if PLUS or SILU:
            y = y.to(t_ptr.dtype.element_ty).to(tl.float32)
        _store_row_codes(y, codes_ptr, scale_ptr, r, rows, offsets, mask)


def _outputs(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(rows, cols, dtype=FP8, device=device)
    return codes, torch.empty(rows, dtype=torch.float32, device=device)


def _grid(rows: int) -> tuple[int]:
    return (triton.cdiv(rows, ROWS),)


def _launch_rows(t: torch.Tensor, plus: torch.Tensor | None, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    codes, scale = _outputs(rows, cols, t.device)
    block = triton.next_power_of_2(cols)
    _codes_rows[_grid(rows)](
        t,
        t if plus is None else plus,  # absent: any pointer (its load is compiled out)
        codes,
        scale,
        rows,
        cols,
        t.stride(0),
        t.stride(0) if plus is None else plus.stride(0),
        BLOCK=block,
        ROWS=ROWS,
        PLUS=plus is not None,
        SILU=silu,
        num_warps=4,
    )
    return codes, scale


def _launch_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    gate: torch.Tensor | None,
    cam_scale: torch.Tensor | None,
    cam_shift: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    affine: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm_codes`'s kernel: (the updated residual, or an empty tensor when nothing updates it; codes; scales).
    weight, bias: the norm's own where `affine`, else the modulation's scale and shift (or None)."""
    rows, cols = x.shape
    codes, scale = _outputs(rows, cols, x.device)
    updated = update is not None or cam_scale is not None
    x_out = torch.empty(rows if updated else 0, cols, dtype=torch.float32, device=x.device)
    given = (update, gate, cam_scale, cam_shift, weight, bias)
    # absent inputs: any pointer (their loads are compiled out)
    args = [x if t is None else t.contiguous() for t in given]
    _norm_codes_rows[_grid(rows)](
        x,
        *args,
        x_out,
        codes,
        scale,
        rows,
        cols,
        eps,
        *power_of_two_blocks(cols, 2),
        ROWS=ROWS,
        UPDATE=update is not None,
        GATED=gate is not None,
        CAMERA=cam_scale is not None,
        AFFINE=affine,
        MODULATE=not affine and weight is not None,
        ROUND=not updated and x.dtype != torch.float32,  # the norm returns its input's dtype
        num_warps=warps(cols),
    )
    return x_out, codes, scale


def _norm_fake(x, update, gate, cam_scale, cam_shift, weight, bias, eps, affine):
    updated = update is not None or cam_scale is not None
    x_out = x.new_empty(x.shape[0] if updated else 0, x.shape[1], dtype=torch.float32)
    return x_out, *_outputs(x.shape[0], x.shape[1], x.device)


# `torch.ops.lingbot.fp8_codes_rows` and `fp8_norm_codes`. Opaque to torch.compile: traced as a user kernel, the norm
# kernel failed inductor's own Triton compile on an H200 ("Unsupported rounding mode for conversion" in the LLVM
# lowering) where the same kernel launched as written compiles; as ops, a compiled block calls them as they are (no
# graph break).
lingbot_op("fp8_codes_rows", _launch_rows, lambda t, plus, silu: _outputs(t.shape[0], t.shape[1], t.device))
lingbot_op("fp8_norm_codes", _launch_norm, _norm_fake)


def quantize_rows(
    t: torch.Tensor, plus: torch.Tensor | None = None, silu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, cols], fp32 scales [rows]) of t, as `wan.fp8.quantize_rows` (where `quantizes`); `plus`
    (where `quantizes` it too, of t's shape and dtype): of t + plus; `silu`: of F.silu(t); one or the other. The sum
    or the SiLU is rounded to t's dtype first, as torch returns it, and never written."""
    if plus is not None and silu:
        raise ValueError("quantize_rows: a sum or a SiLU, not both")
    if plus is not None and (plus.shape != t.shape or plus.dtype != t.dtype or plus.stride(1) != 1):
        raise ValueError(
            f"quantize_rows: plus must be of t's shape {list(t.shape)} and dtype {t.dtype}, its columns contiguous; "
            f"got {list(plus.shape)} {plus.dtype} with strides {plus.stride()}"
        )
    return torch.ops.lingbot.fp8_codes_rows(t, plus, silu)


def norm_codes(x, norm, update=None, camera=None, modulation=None):
    """One pass of a block (where `usable`): x [rows, cols] plus `update` (its (output, gate [cols] or None)), then
    the `camera` injection ((scale, shift), each [rows, cols]), then `norm` (a `WanLayerNorm`, affine or not) and
    the `modulation` ((shift, scale), each [cols]) -> (the residual's new value, e4m3 codes, fp32 row scales) of what
    the unfused path gives the next linears. The residual comes back as it was when nothing updates it."""
    out, gate = update if update is not None else (None, None)
    cam_scale, cam_shift = camera if camera is not None else (None, None)
    affine = norm.weight is not None
    if affine and modulation is not None:
        raise ValueError("norm_codes: an affine norm takes no modulation (no block norm has both)")
    if affine:
        # as they are: the kernel widens them to fp32 as it loads them (exact), no conversion pass a call
        weight, bias = norm.weight, norm.bias
    else:
        bias, weight = modulation if modulation is not None else (None, None)
    x_out, codes, scale = torch.ops.lingbot.fp8_norm_codes(
        x.contiguous(), out, gate, cam_scale, cam_shift, weight, bias, norm.eps, affine
    )
    return (x if update is None and camera is None else x_out), codes, scale
