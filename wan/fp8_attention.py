"""8-bit attention (`attention='fp8'`): cuDNN's fp8 flash attention on fp8 tensor cores.

q, k and v are quantized to float8 e4m3 with one scale per tensor (amax / 448, computed on the device: no host
sync, fused into the block's graph when it is compiled). The kernel computes q·kᵀ from the fp8 codes and the
softmax in fp32, rounds the probabilities to e4m3 (scaled by 448: before normalization they lie in [0, 1]) for
the product with v, and writes the output in e4m3 as well (on Hopper, cuDNN's kernel writes fp8 only) at the
scale of max|v| / 448: each output row is a convex combination of v's rows, so |o| <= max|v| never overflows.
An fp8 K/V cache hands its e4m3 keys and values over as stored (scale 1, no pass over the window); the output's
scale is then taken from the stored values' amax, so small values keep their precision.
The output is then brought back to the compute dtype. Lossy: the probabilities and the output keep 3 mantissa
bits; the benchmark reports the deviation.

The kernel is one opaque op (`torch.ops.lingbot.fp8_attention`) so a compiled block traces through it without
a graph break. It runs cuDNN through NVIDIA's `cudnn` Python frontend (the `nvidia-cudnn-frontend` package);
on other devices the op computes `reference`, the same arithmetic in plain torch (what the CPU tests run;
`attention_problem` refuses the option off CUDA, so no user run takes that path).
"""

import atexit
import functools
import importlib
import math
import threading

import torch

from .devices import card_problem, cuda_index, lingbot_op

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
P_SCALE = FP8_MAX  # the probabilities' scale (they are <= 1 before the softmax's division)
_TINY = 1e-12  # an all-zero tensor gets this amax: scale > 0, codes 0
FALLBACK = "use --attention sdpa (PyTorch's kernels, exact)"
# fewer keys than this (cross-attention's 512 text tokens): SDPA, as fast there (H100: 0.63 ms against the fp8
# kernel's 0.78 ms at 31,668 queries) and exact
MIN_KEYS = 2048
PACKAGE = "nvidia-cudnn-frontend"


def amax_scale(t: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """fp32 [1]: max|t| / 448, the scale that maps t's largest magnitude to e4m3's largest value; `per_head`:
    [1, heads], each head's of [L, heads, d]."""
    src = t.detach().float() if t.dtype == FP8 else t.detach()  # no amax kernel for e4m3
    if per_head:
        return (src.abs().amax(dim=(0, 2)).float().clamp_min(_TINY) / FP8_MAX).reshape(1, -1)
    return (src.abs().amax().float().clamp_min(_TINY) / FP8_MAX).reshape(1)


def quantize(t: torch.Tensor, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scale) of `t` with one scale for the whole tensor (scale [1]) or, `per_head`, one per
    head of [L, heads, d] (scale [1, heads], as FlashAttention-3 takes its descales): t ~= codes * scale. An
    e4m3 tensor (an fp8 K/V cache's keys) is its own codes at scale 1: no pass over it."""
    if t.dtype == FP8:
        return t.contiguous(), torch.ones((1, t.shape[1]) if per_head else (1,), device=t.device)
    scale = amax_scale(t, per_head)
    work = t.to(torch.float32, copy=True)  # the one fp32 copy (eager), divided and clamped in place
    codes = work.div_(scale.reshape(-1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).contiguous()  # [heads or 1, 1]
    return codes, scale


def reference(q, k, v, q_scale, k_scale, v_scale, o_scale) -> torch.Tensor:
    """The kernel's arithmetic in plain torch: [L, heads, d] e4m3 codes and their fp32 [1] scales in, the
    output's e4m3 codes at `o_scale` out ([Lq, heads, d]). One head at a time (a score matrix in fp32)."""
    d = q.shape[-1]
    out = torch.empty(q.shape, dtype=FP8, device=q.device)
    for h in range(q.shape[1]):
        qh, kh, vh = (t[:, h].float() * s for t, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
        scores = (qh @ kh.T) / math.sqrt(d)
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # in [0, 1], as the kernel holds them
        p8 = (p * P_SCALE).to(FP8).float() / P_SCALE
        o = (p8 @ vh) / p.sum(dim=-1, keepdim=True)
        out[:, h] = (o / o_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return out


def _kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    o_scale: torch.Tensor,
) -> torch.Tensor:
    """Attention of e4m3 q over e4m3 k/v ([L, heads, d], one fp32 [1] scale each); the output's e4m3 codes at
    `o_scale`. cuDNN on CUDA, `reference` elsewhere."""
    if q.device.type == "cuda":
        with torch.cuda.device(q.device):  # the handle, graph and launch on q's GPU, whichever is current
            return _cudnn_attention(q, k, v, q_scale, k_scale, v_scale, o_scale)
    return reference(q, k, v, q_scale, k_scale, v_scale, o_scale)


lingbot_op("fp8_attention", _kernel, lambda q, k, v, *scales: torch.empty_like(q))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The `wan.attention` backend: [L, heads, d] in (any float dtype, fp8 K/V caches included), [Lq, heads,
    d] out in `dtype`."""
    (q8, qs), (k8, ks), (v8, vs) = (quantize(t) for t in (q, k, v))
    out_scale = vs if v.dtype != FP8 else amax_scale(v8)  # max|v| / 448 either way
    out = torch.ops.lingbot.fp8_attention(q8, k8, v8, qs, ks, vs, out_scale)
    return (out.float() * out_scale).to(dtype)


# --- cuDNN ---------------------------------------------------------------------------------------------


def _frontend():
    try:
        return importlib.import_module("cudnn")
    except (ImportError, OSError) as err:
        raise RuntimeError(
            f"attention 'fp8' needs NVIDIA's cuDNN Python frontend (pip install {PACKAGE}), which is not "
            f"importable here: {err}"
        ) from err


class _Kernels:
    """Per device: one cuDNN handle and one built graph per shape (heads, q tokens, k/v tokens, head_dim);
    building takes ~0.1 s, so a shape is built once per process."""

    def __init__(self):
        self.lock = threading.Lock()
        self.handles: dict[int, object] = {}
        self.graphs: dict[tuple, object] = {}
        self.p_scales: dict[int, tuple] = {}  # (descale, scale) of the probabilities, fp32 [1, 1, 1, 1]

    def clear(self) -> None:
        with self.lock:
            self.graphs.clear()
            self.handles.clear()

    def handle(self, cudnn, index: int):
        if not self.handles:  # runs before the frontend's own exit hook (registered at its import): nothing
            atexit.register(self.clear)  # of ours is left for its bindings to report as leaked at shutdown
        if index not in self.handles:  # made on the current device: the op's own device context (`_kernel`)
            self.handles[index] = cudnn.create_handle()
        return self.handles[index]

    def p_scale(self, index: int) -> tuple:
        if index not in self.p_scales:
            scale = torch.full((1, 1, 1, 1), P_SCALE, device=f"cuda:{index}")
            self.p_scales[index] = (1.0 / scale, scale)
        return self.p_scales[index]

    def graph(self, cudnn, index: int, heads: int, lq: int, lk: int, d: int):
        key = (index, heads, lq, lk, d)
        with self.lock:
            if key not in self.graphs:
                self.graphs[key] = _build(cudnn, self.handle(cudnn, index), heads, lq, lk, d)
            return self.graphs[key]


_KERNELS = _Kernels()
# the variant pack's tensor ids
_Q, _K, _V, _O, _AMAX_S, _AMAX_O, _DQ, _DK, _DV, _DS, _SS, _SO = range(12)


def _build(cudnn, handle, heads: int, lq: int, lk: int, d: int):
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tokens(uid, n):  # [L, heads, d] contiguous, seen as [1, heads, L, d]
        return g.tensor(uid=uid, dim=(1, heads, n, d), stride=(n * heads * d, d, heads * d, 1), data_type=fp8)

    def scalar(uid):
        return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

    q, k, v = tokens(_Q, lq), tokens(_K, lk), tokens(_V, lk)
    o, _, amax_s, amax_o = g.sdpa_fp8(
        q=q,
        k=k,
        v=v,
        descale_q=scalar(_DQ),
        descale_k=scalar(_DK),
        descale_v=scalar(_DV),
        descale_s=scalar(_DS),
        scale_s=scalar(_SS),
        scale_o=scalar(_SO),
        generate_stats=False,
        attn_scale=1.0 / math.sqrt(d),
        use_causal_mask=False,
    )
    o.set_uid(_O).set_output(True).set_dim((1, heads, lq, d)).set_stride((lq * heads * d, d, heads * d, 1))
    o.set_data_type(fp8)
    for uid, t in ((_AMAX_S, amax_s), (_AMAX_O, amax_o)):
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


def _cudnn_attention(q, k, v, q_scale, k_scale, v_scale, o_scale) -> torch.Tensor:
    cudnn = _frontend()
    q, k, v = (t.contiguous() for t in (q, k, v))
    index = cuda_index(q.device)
    lq, heads, d = q.shape
    graph = _KERNELS.graph(cudnn, index, heads, lq, k.shape[0], d)
    handle = _KERNELS.handle(cudnn, index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    out = torch.empty_like(q)
    p_descale, p_scale = _KERNELS.p_scale(index)

    def s(t):
        return t.reshape(1, 1, 1, 1)

    pack = {
        _Q: q,
        _K: k,
        _V: v,
        _O: out,
        _AMAX_S: q_scale.new_empty(1, 1, 1, 1),
        _AMAX_O: q_scale.new_empty(1, 1, 1, 1),
        _DQ: s(q_scale),
        _DK: s(k_scale),
        _DV: s(v_scale),
        _DS: p_descale,
        _SS: p_scale,
        _SO: s(1.0 / o_scale),
    }
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
    graph.execute(pack, workspace, handle=handle)
    return out


def attention_problem(device) -> str | None:
    """Why fp8 attention cannot run on `device` (None: it can), naming the fallback."""
    return card_problem(
        device,
        lambda kind: (
            "attention 'fp8' runs cuDNN's fp8 attention on a CUDA GPU with fp8 tensor cores (Hopper or newer); "
            f"this run is on {kind}. Instead: {FALLBACK}"
        ),
        _cuda_problem,
    )


@functools.cache
def _cuda_problem(index: int) -> str | None:
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (8, 9):
        return (
            f"attention 'fp8' needs fp8 tensor cores (Hopper or newer); {name} is compute capability "
            f"{major}.{minor}. Instead: {FALLBACK}"
        )
    try:
        _frontend()
    except RuntimeError as err:
        return f"{err}. Instead: {FALLBACK}"
    try:  # cuDNN's fp8 attention on this card with this cuDNN, once
        x = torch.ones(64, 1, 128, device=f"cuda:{index}")
        attention(x, x, x, torch.bfloat16)
        torch.cuda.synchronize(index)
    except Exception as err:  # cuDNN declines in several exception types
        first = (str(err).strip().splitlines() or [""])[0][:300]
        return f"cuDNN has no fp8 attention for {name} here ({first}). Instead: {FALLBACK}"
    return None
