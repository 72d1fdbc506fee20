"""FlashAttention-3 (`attention='fa3'` and `'fa3_fp8'`): Dao-AILab's Hopper kernels, through its
`flash_attn_interface` module (the `flash_attn_3` package, built from flash-attention's `hopper/` directory; it
is not on PyPI).

- ``fa3``: q, k and v in the compute dtype (bf16/fp16; an fp32 model's in bf16), FA3's warp-specialized kernel.
  Not bit-equal to SDPA (another kernel, another summation order), within the same bf16 rounding of the exact
  result.
- ``fa3_fp8``: q, k and v quantized to e4m3 with one scale per head (max|t| over the head's tokens / 448, on the
  device, fused into a compiled block); FA3's fp8 kernel takes the scales as its descale factors, rounds the
  softmax probabilities to e4m3 for the product with v and writes the output in bf16 (no fp8 output rounding,
  unlike cuDNN's kernel on Hopper). An fp8 K/V cache hands its e4m3 keys and values over as stored (scale 1).
  Short key sets (the text's 512 in cross-attention) run ``fa3``: the quantization would cost more than it saves.
  Lossy: the benchmark reports the deviation.

FA3's own entry point is a registered custom op with a fake implementation, so compiled blocks trace through it
without a graph break. FA3 runs on compute capability 9.0 only (H100, H200, H20); `problem` refuses it elsewhere
and names the fallback.
"""

import functools
import importlib

import torch

from .devices import card_problem
from .fp8_attention import FP8, FP8_MAX, MIN_KEYS

MODULE = "flash_attn_interface"
PACKAGE = "flash_attn_3 (FlashAttention-3, built from flash-attention's hopper/ directory)"
FALLBACK = {
    "fa3": "use --attention sdpa (PyTorch's kernels, exact)",
    "fa3_fp8": "use --attention fp8 (cuDNN's fp8 attention) or sdpa (exact)",
}
_TINY = 1e-12  # an all-zero head gets this amax: scale > 0, codes 0


def _interface():
    try:
        return importlib.import_module(MODULE)
    except (ImportError, OSError) as err:
        raise RuntimeError(
            f"FlashAttention-3 needs the {PACKAGE} package, whose {MODULE} module is not importable here: {err}"
        ) from err


def head_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [L, heads, d], fp32 [1, heads] scales) with one scale per head: t ~= codes * scale. An e4m3
    tensor (an fp8 K/V cache's keys) is its own codes at scale 1: no pass over it."""
    heads = t.shape[1]
    if t.dtype == FP8:
        return t.contiguous(), torch.ones(1, heads, device=t.device)
    scale = t.detach().abs().amax(dim=(0, 2)).float().clamp_min(_TINY) / FP8_MAX  # [heads]
    codes = (t.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale.reshape(1, heads)


def _run(q, k, v, **descales) -> torch.Tensor:
    """FA3 over [L, heads, d] (batch 1); its output [Lq, heads, d]."""
    out = _interface().flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), **descales)
    out = out[0] if isinstance(out, tuple) else out  # some versions return (out, softmax_lse)
    return out[0]


HALF = (torch.bfloat16, torch.float16)  # FA3's kernels take these; an fp32 model's attention runs in bf16


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``fa3`` backend: inputs cast to `dtype` (bf16 where `dtype` is not a half type; an fp8 cache's values
    too), [Lq, heads, d] out in `dtype`."""
    work = dtype if dtype in HALF else torch.bfloat16
    return _run(*(t.to(work) for t in (q, k, v))).to(dtype)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``fa3_fp8`` backend (module docstring); [Lq, heads, d] out in `dtype`."""
    if k.shape[0] < MIN_KEYS:
        return attention(q, k, v, dtype)
    (q8, qs), (k8, ks), (v8, vs) = (head_quantize(t) for t in (q, k, v))
    return _run(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs).to(dtype)


def problem(name: str, device) -> str | None:
    """Why backend `name` ('fa3' or 'fa3_fp8') cannot run on `device` (None: it can), naming the fallback."""
    return card_problem(
        device,
        lambda kind: (
            f"attention '{name}' runs FlashAttention-3's kernels on a Hopper GPU (compute capability 9.0); this "
            f"run is on {kind}. Instead: {FALLBACK[name]}"
        ),
        functools.partial(_cuda_problem, name),
    )


@functools.cache
def _cuda_problem(name: str, index: int) -> str | None:
    card = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return (
            f"attention '{name}': FlashAttention-3 runs on Hopper GPUs (compute capability 9.0) only; {card} is "
            f"{major}.{minor}. Instead: {FALLBACK[name]}"
        )
    try:
        _interface()
    except RuntimeError as err:
        return f"attention '{name}': {err}. Instead: {FALLBACK[name]}"
    try:  # a build may leave out a dtype or head size: run the model's (head_dim 128) once
        x = torch.ones(MIN_KEYS, 1, 128, device=f"cuda:{index}")
        (attention_fp8 if name == "fa3_fp8" else attention)(x, x, x, torch.bfloat16)
        torch.cuda.synchronize(index)
    except Exception as err:  # the extension declines in several exception types
        first = (str(err).strip().splitlines() or [""])[0][:300]
        return f"attention '{name}': this FlashAttention-3 build does not run here ({first}). Instead: {FALLBACK[name]}"
    return None
