"""Attention backends for the DiT: one registry, one active backend at a time.

Every backend takes q, k, v as [L, heads, head_dim] (k and v may have another length than q, and another
dtype: an fp8 K/V cache hands its e4m3 values over as stored) plus the compute dtype, casts them to it (or, the
fp8 backend, takes e4m3 as it is) and returns [L_q, heads, head_dim] in that dtype.

- ``sdpa`` (default): PyTorch's scaled_dot_product_attention, the code path the model always had.
- ``sage``: SageAttention's quantized kernel (needs the ``sageattention`` package and a CUDA device).
- ``fp8``: cuDNN's fp8 attention (`wan.fp8_attention`; a CUDA GPU with fp8 tensor cores and the
  ``nvidia-cudnn-frontend`` package) for self-attention, SDPA for the text's short key set. Lossy.
- ``fa3`` / ``fa3_fp8``: FlashAttention-3's Hopper kernels in the compute dtype / in e4m3 with a scale per head
  (`wan.fa3_attention`; an H100-class GPU and the ``flash_attn_3`` package). ``fa3_fp8`` is lossy.
- anything a host registers: `register(name, fn)` for a backend with our signature, or
  `register_comfy(name, fn)` for a function with ComfyUI's ``optimized_attention`` signature
  ``fn(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False)``
  taking [batch, tokens, heads * head_dim] tensors. This package never imports ComfyUI; its node
  layer registers ComfyUI's function here.

`use(name)` makes a backend the active one for a block of code (the sampling loop); `attention()`
calls the active backend.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import fa3_attention, fp8_attention
from .devices import kept_import

Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inputs cast to `dtype` as upstream's flash_attention does; SDPA kernels."""
    q, k, v = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)


def fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cuDNN's fp8 attention (`wan.fp8_attention`) over long key sets; SDPA over short ones (the text's 512 in
    cross-attention), where the fp8 kernel is no faster (benchmarks/bench_fp8.py) and would only add error."""
    if k.shape[0] < fp8_attention.MIN_KEYS:
        return sdpa(q, k, v, dtype)
    return fp8_attention.attention(q, k, v, dtype)


def _sageattn():
    try:
        return kept_import("sageattention").sageattn
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            "attention='sage' needs the `sageattention` package (pip install sageattention, CUDA only), "
            f"which is not importable here: {err}"
        ) from err


def sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SageAttention in its [batch, tokens, heads, head_dim] ("NHD") layout."""
    q, k, v = (t.to(dtype).unsqueeze(0) for t in (q, k, v))
    return _sageattn()(q, k, v, tensor_layout="NHD", is_causal=False)[0].to(dtype)


def comfy_style(fn: Callable) -> Backend:
    """Adapt a ComfyUI-style attention function (see module docstring) to our backend signature.

    It is called in ComfyUI's default layout, [1, L, heads * head_dim] in and out, as ComfyUI's own
    Wan model calls it; the function is looked up on every call, so passing a lambda that reads
    ComfyUI's module attribute follows ComfyUI's own backend choice.
    """

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        heads, head_dim = q.shape[1], q.shape[2]
        q, k, v = (t.to(dtype).reshape(1, t.shape[0], heads * head_dim) for t in (q, k, v))
        out = fn(q, k, v, heads)
        return out.reshape(q.shape[1], heads, head_dim).to(dtype)

    return run


_BACKENDS: dict[str, Backend] = {
    "sdpa": sdpa,
    "sage": sage,
    "fp8": fp8,
    "fa3": fa3_attention.attention,
    "fa3_fp8": fa3_attention.attention_fp8,
}
_FA3 = (fa3_attention.attention, fa3_attention.attention_fp8)
BUILT_IN = tuple(_BACKENDS)  # the choices the CLI and the Speed node offer
# backends that make e4m3 copies of q, k and v beside a block's attention (the memory plan counts them)
QUANTIZED = ("fp8", "fa3_fp8")
_active: Backend = sdpa


def register(name: str, fn: Backend) -> None:
    """Make `fn(q, k, v, dtype)` available as backend `name` (replacing one of that name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"attention backend name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise TypeError(f"attention backend {name!r}: expected a callable, got {type(fn).__name__}")
    _BACKENDS[name] = fn


def register_comfy(name: str, fn: Callable) -> None:
    """Register a function with ComfyUI's optimized_attention signature as backend `name`."""
    if not callable(fn):
        raise TypeError(f"attention backend {name!r}: expected a callable, got {type(fn).__name__}")
    register(name, comfy_style(fn))


def names() -> list[str]:
    return sorted(_BACKENDS)


def resolve(name: str) -> Backend:
    """The backend called `name`; a clear error when it is unknown or its package is missing."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {names()}, got {name!r}")
    if name == "sage" and _BACKENDS[name] is sage:
        _sageattn()  # fail now, naming the package, rather than inside the first block
    if _BACKENDS[name] in _FA3:
        fa3_attention.interface()
    return _BACKENDS[name]


def problem(name: str, device) -> str | None:
    """Why backend `name` cannot run on `device` (None: it can, or only running it will tell), naming the
    fallback; an unknown name says which there are."""
    backend = _BACKENDS.get(name)
    if backend is None:
        return f"attention backend must be one of {names()}, got {name!r}"
    if backend is fp8:
        return fp8_attention.attention_problem(device)
    if backend in _FA3:
        return fa3_attention.problem(name, device)
    if backend is sage:
        try:
            _sageattn()
        except RuntimeError as err:
            return f"{err}. Instead: {fp8_attention.FALLBACK}"
        if torch.device(device).type != "cuda":
            return (
                f"attention 'sage' runs SageAttention's CUDA kernels; this run is on {torch.device(device).type}. "
                f"Instead: {fp8_attention.FALLBACK}"
            )
    return None


def active() -> Backend:
    return _active


def takes_query_codes() -> bool:
    """Whether the active backend takes the queries as e4m3 `fa3_attention.HeadCodes` (``fa3_fp8``): read at trace
    time, as the backend itself is."""
    return _active is fa3_attention.attention_fp8


def takes_cached_rows(name: str) -> bool:
    """Whether backend `name` reads a K/V cache aligned to its end from a start on the device
    (`fa3_attention.CachedRows`, FlashAttention-3's): such a cache gives the chunk loop one graph for every chunk."""
    return _BACKENDS.get(name) in _FA3


@contextlib.contextmanager
def use(name: str):
    """Run the enclosed code with backend `name` active; the previous one is restored on exit."""
    global _active
    backend = resolve(name)
    previous, _active = _active, backend
    try:
        yield backend
    finally:
        _active = previous


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[L, heads, d] inputs through the active backend (SDPA unless `use` says otherwise). Keys and values as
    `fa3_attention.CachedRows` reach the FA3 backends as they are and the others as their rows."""
    if isinstance(k, fa3_attention.CachedRows) and _active not in _FA3:
        k, v = k.rows(), v.rows()
    return _active(q, k, v, dtype)
