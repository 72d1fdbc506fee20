"""fp8 (e4m3) Linear layers with row-wise scales: the weight quantized per output row, the activation per
token at run time, one `torch._scaled_mm` (fp8 tensor cores: CUDA compute capability 8.9+) per call.

A quantized layer keeps its `nn.Linear` and holds `weight` as float8_e4m3fn [out, in] plus `weight_scale`
fp32 [out] (weight ~= weight_fp8 * weight_scale[:, None]); `wan.dit.linear` sees the fp8 dtype and calls
`fp8_linear`. Only the DiT blocks' Linears are quantized (`fp8_layer`): the embeddings and the head stay as
loaded (small, and the head runs in fp32). This is torch's own scaled matmul, not a tensor subclass, so a
compiled block traces through it like any other op. The FFN's down projection takes its input from one Triton kernel
that applies the GELU and quantizes the rows in a single pass (`gelu_linear`, `wan.fp8_gelu`) where that kernel runs
(CUDA with Triton); elsewhere the GELU and `quantize_rows` run as written. There too, a block's three norms and the
attention outputs before the o-projections give their linears `RowCodes` made by `wan.fp8_inputs`.

Accumulation (`accumulation`): "exact" (the default) is cuBLAS's split accumulation, which promotes the fp8
tensor cores' partial sums to fp32 along K; "fast" (`use_fast_accum`) keeps them in the tensor cores' own
accumulator: on an H100 a steady v2 1.3B chunk's GEMMs took 78 -> 66 ms, at about 1.1-2x a GEMM's fp8
rounding error (more for long K: the FFN's down projection). A lossy option of its own, off unless asked.
"""

import contextlib
import functools
from typing import NamedTuple

import torch
from torch import nn

from . import fp8_gelu
from .devices import card_problem

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_SUFFIX = "_scale"  # '<layer>.weight_scale' beside '<layer>.weight'
FALLBACK = "leave fp8 off (bf16 linears, exact), or quantize to NF4 (--quantize) to save memory"
_TINY = 1e-12  # an all-zero row gets this amax: scale > 0, codes 0
ACCUMULATIONS = ("exact", "fast")
_fast_accum = False  # read by fp8_linear (a compiled block guards on it, so a change recompiles)


@contextlib.contextmanager
def accumulation(mode: str):
    """Run the enclosed code's fp8 linears with accumulation `mode` ('exact' or 'fast'); restored on exit."""
    global _fast_accum
    if mode not in ACCUMULATIONS:
        raise ValueError(f"fp8 accumulation: expected one of {', '.join(ACCUMULATIONS)}, got {mode!r}")
    previous, _fast_accum = _fast_accum, mode == "fast"
    try:
        yield
    finally:
        _fast_accum = previous


def fp8_layer(name: str, shape) -> bool:
    """Whether the Linear `name` with weight `shape` (out, in) is quantized to fp8: the DiT blocks' Linears
    whose sizes the scaled matmul takes (multiples of 16)."""
    return name.startswith("blocks.") and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, fp32 scales [rows]) of a 2-D tensor, one scale per row: amax / 448, so each row's
    largest magnitude maps to e4m3's largest value."""
    tf = t.float()
    scale = tf.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX
    codes = (tf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


class RowCodes(NamedTuple):
    """A linear's input as `quantize_rows` makes it (e4m3 codes [rows, cols], fp32 scales [rows]), made ahead by a
    block's fused kernel (`wan.fp8_inputs.norm_codes`); `wan.dit.linear` takes it in place of the input of layers
    that `take_codes`."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def rows(self, start: int, stop: int) -> "RowCodes":
        return RowCodes(self.codes[start:stop], self.scale[start:stop])


def take_codes(*layers: nn.Module) -> bool:
    """Whether `layers` all take their input as `RowCodes`: fp8 layers without a LoRA side path (which reads the
    input itself)."""
    return all(is_fp8(layer) and "lora" not in layer._modules for layer in layers)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (codes.float() * scale[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias, dtype) -> torch.Tensor:
    """`x @ W.T + b` with W = weight (fp8) * scale per row: x quantized per token (row-wise amax / 448) from
    its own precision, one scaled matmul (accumulating as `accumulation` says), bf16 out (what the row-wise
    kernel writes), returned in `dtype`. `RowCodes` (made ahead, `wan.fp8_inputs`) go straight to the matmul."""
    if isinstance(x, RowCodes):
        return _scaled_linear(x.codes, x.scale, weight, scale, bias, dtype)
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    return _scaled_linear(xq, xs, weight, scale, bias, dtype).view(*x.shape[:-1], weight.shape[0])


def _scaled_linear(xq, xs, weight, scale, bias, dtype) -> torch.Tensor:
    out = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=xs[:, None],
        scale_b=scale[None, :],
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
        use_fast_accum=_fast_accum,
    )
    return out.to(dtype)


def gelu_linear(layer: nn.Linear, h: torch.Tensor, dtype) -> torch.Tensor | None:
    """`fp8_linear` of GELU_tanh(h) [rows, cols] for the FFN's fp8 down projection `layer`, with the GELU and
    the quantization in one kernel (`wan.fp8_gelu`); None where that kernel does not run (the caller goes the
    unfused way: a LoRA side path needs the GELU'd input itself)."""
    if not take_codes(layer) or not fp8_gelu.usable(h):
        return None
    hq, hs = fp8_gelu.gelu_quantize_rows(h)
    return _scaled_linear(hq, hs, layer.weight, layer.weight_scale, layer.bias, dtype)


def is_fp8(layer: nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return weight is not None and weight.dtype == FP8


def quantize_layer_(layer: nn.Linear) -> None:
    """Replace a dense Linear's weight by its fp8 codes and row scales, in place (on its device)."""
    codes, scale = quantize_rows(layer.weight.detach())
    layer._parameters["weight"] = nn.Parameter(codes, requires_grad=False)
    layer._parameters["weight" + SCALE_SUFFIX] = nn.Parameter(scale, requires_grad=False)


def quantize_blocks_(model: nn.Module) -> int:
    """Quantize a loaded model's `fp8_layer` Linears in place (what the loader's quantize='fp8' makes of them while
    streaming); returns how many."""
    layers = [
        m for name, m in model.named_modules() if isinstance(m, nn.Linear) and fp8_layer(name, m.weight.shape)
    ]
    for layer in layers:
        quantize_layer_(layer)
    return len(layers)


def fp8_problem(device) -> str | None:
    """Why fp8 linears cannot run on `device` (None: they can), naming the fallback."""
    return card_problem(
        device,
        lambda kind: (
            f"fp8 linears need a CUDA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, "
            f"Blackwell); this run is on {kind}. Instead: {FALLBACK}"
        ),
        _cuda_problem,
    )


@functools.cache
def _cuda_problem(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    name = torch.cuda.get_device_name(index)
    if (major, minor) < (8, 9):
        return (
            f"fp8 linears need fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); {name} is "
            f"{major}.{minor}. Instead: {FALLBACK}"
        )
    try:  # this torch build's row-wise scaled matmul on this card, once
        a = torch.ones(16, 16, device=f"cuda:{index}").to(FP8)
        s = torch.ones(16, 1, device=f"cuda:{index}")
        fp8_linear(a.float(), a, s[:, 0], None, torch.bfloat16)
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return f"this PyTorch has no row-wise fp8 matmul on {name} ({first}). Instead: {FALLBACK}"
    return None


def check_fp8(device) -> None:
    """Raise ValueError (the message of `fp8_problem`) when fp8 linears cannot run on `device`."""
    problem = fp8_problem(device)
    if problem is not None:
        raise ValueError(problem)
