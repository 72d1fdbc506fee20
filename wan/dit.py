"""The Wan2.2 i2v diffusion transformer with LingBot-World camera control.

Parameter names and shapes follow upstream checkpoints exactly (`blocks.N.self_attn.q.weight`,
`blocks.N.cam_scale_layer.weight`, `patch_embedding_wancamctrl.weight`, ...), so a real state dict
loads with no renaming.

Upstream runs the model under `torch.autocast("cuda", bfloat16)` with fp32 islands. Here the same
dtype flow is written out explicitly (every Linear runs in `compute_dtype`, the modulation,
residual stream, time embedding and head in fp32), so CPU and GPU take one code path and
bitsandbytes 4-bit layers slot in unchanged. Memory-saving departures that keep every value equal:
the time embedding is computed once per timestep and broadcast over tokens instead of per token,
and RoPE is applied in token chunks. Opt-in (`WanModel.lean_activations`): blocks run token chunk by
chunk, updating the residual in place (`WanAttentionBlock.forward_lean`); values equal up to GEMM
row blocking.
"""

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from . import attention as attention_backends
from . import fp8_inputs, parallel, qk_rope
from .config import CONTROL_CHANNELS, DiTConfig
from .fa3_attention import HeadCodes
from .fp8 import FP8, RowCodes, fp8_linear, gelu_linear, take_codes

ROPE_CHUNK = 8192  # tokens per float64 RoPE chunk; bounds the transient to ~0.3 GB at dim 5120
# FFN token chunk: above it the [L, 13824] intermediate is built piecewise (2 GB at 720p). 480p
# (31,668 tokens) stays one GEMM, as upstream; smaller GEMMs can round differently.
FFN_CHUNK = 32768
# Lean activations (WanModel.lean_activations): tokens per chunk of a block's per-token work. Bounds the
# chunk's temporaries (~80 KB per token at dim 5120: ~0.7 GB) and stays below FFN_CHUNK, so each
# chunk's FFN is one GEMM.
LEAN_CHUNK = 8192


def linear(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`layer(x)` computed in `dtype`, as autocast would run it; 4-bit and fp8 (`wan.fp8`) layers included.

    A layer carrying LoRA adapters (a `lora` submodule, see `wan.lora`) adds their unmerged side
    path in `dtype`: `((x @ down.T) @ up.T) * scale` per low-rank adapter, `(x @ diff.T) * scale`
    per dense weight delta, then its summed bias delta; each product is accumulated into the output
    by one in-place GEMM (no output-sized temporary). Without adapters nothing changes.
    """
    side = layer._modules.get("lora")
    if side is None:
        return _linear(layer, x, dtype)
    x = x.to(dtype)
    out = _linear(layer, x, dtype).contiguous()
    flat, x2 = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
    for down, up, scale in side.paths():
        if up is None:
            flat.addmm_(x2, down.to(dtype).T, alpha=scale)
        else:
            flat.addmm_(x2 @ down.to(dtype).T, up.to(dtype).T, alpha=scale)
    bias = side.bias()
    if bias is not None:
        flat.add_(bias.to(dtype))
    return out


def _linear(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    weight = layer.weight
    if weight.dtype == FP8:  # wan.fp8: e4m3 codes with a scale per output row
        return fp8_linear(x, weight, layer.weight_scale, layer.bias, dtype)
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:  # bitsandbytes Params4bit
        if dtype == quant_state.dtype:
            return layer(x.to(dtype))
        import bitsandbytes.functional as bnb_f

        weight = bnb_f.dequantize_4bit(weight.data, quant_state)
    bias = layer.bias
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:
    half = dim // 2
    position = position.to(torch.float64)
    # the exponents made on position's device: a host-made arange copied over would sync the chunk loop's host
    steps = torch.arange(half, dtype=torch.float64, device=position.device)
    sinusoid = torch.outer(position, torch.pow(10000, -steps.div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_params(max_seq_len: int, dim: int, theta: float = 10000) -> torch.Tensor:
    freqs = torch.outer(
        torch.arange(max_seq_len, device="cpu"),
        1.0 / torch.pow(theta, torch.arange(0, dim, 2, device="cpu").to(torch.float64).div(dim)),
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_freqs(head_dim: int) -> torch.Tensor:
    """Complex128 [1024, head_dim/2]: frame, height and width bands side by side."""
    d = head_dim
    return torch.cat(
        [
            rope_params(1024, d - 4 * (d // 6)),
            rope_params(1024, 2 * (d // 6)),
            rope_params(1024, 2 * (d // 6)),
        ],
        dim=1,
    )


def rope_positions(grid: tuple, freqs: torch.Tensor) -> torch.Tensor:
    """The complex128 rotation of every token, [f*h*w, 1, head_dim/2] (a broadcast view of `freqs`)."""
    f, h, w = grid
    c = freqs.shape[1]
    fr = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    return torch.cat(
        [
            fr[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            fr[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            fr[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)


def rope_table(grid: tuple, freqs: torch.Tensor) -> torch.Tensor:
    """`rope_positions` as real (cos, sin) pairs, [f*h*w, 1, head_dim/2, 2] float64, materialized: what
    compiled blocks get, so the compiler's fused kernel reads each token's pairs instead of rebuilding
    them from the frequency bands (it cannot take complex tensors at all)."""
    return torch.view_as_real(rope_positions(grid, freqs)).contiguous()


def _rotate_pairs(x: torch.Tensor, table: torch.Tensor, out_dtype) -> torch.Tensor:
    """x [l, heads, 2c] rotated by `rope_table` rows [l, 1, c, 2]: the complex product in real float64."""
    xr = x.to(torch.float64).reshape(x.shape[0], x.shape[1], -1, 2)
    a, b, cos, sin = xr[..., 0], xr[..., 1], table[..., 0], table[..., 1]
    # each half rounded before the stack (the same values): compiled, the stack is the tensor inductor writes out,
    # so it is written in out_dtype; stacked in float64 it was written in float64 (4x the bytes of bf16) and read
    # back so by fp8 attention's quantization
    pairs = ((a * cos - b * sin).float().to(out_dtype), (a * sin + b * cos).float().to(out_dtype))
    return torch.stack(pairs, dim=-1).flatten(2)


def rope_apply(
    x: torch.Tensor,
    grid: tuple,
    freqs: torch.Tensor,
    out_dtype=torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding over (frame, height, width) in float64, as upstream, rounded to fp32 and then
    to `out_dtype` (upstream rounds to fp32 here and to bf16 inside its attention call).

    x: [L, heads, head_dim] with L = f*h*w. `freqs`: the complex128 table of `rope_freqs`, or the
    `rope_table` of this grid: the same float64 products in real arithmetic (equal values on the CPU),
    which a compiled block fuses into one kernel over the whole sequence. Run eagerly, both go in token
    chunks (bounded float64 temporaries). `out`: where to write the result (default: a new tensor);
    `out=x` rotates in place (each chunk is read whole before it is written), if x has `out_dtype`.
    """
    seq_len, n = x.shape[0], x.shape[1]
    if not freqs.is_complex():
        if out is None and torch.compiler.is_compiling():
            return _rotate_pairs(x, freqs, out_dtype)

        def rotate(s, e):
            return _rotate_pairs(x[s:e], freqs[s:e], out_dtype)
    else:
        table = rope_positions(grid, freqs)

        def rotate(s, e):
            xc = torch.view_as_complex(x[s:e].to(torch.float64).reshape(e - s, n, -1, 2))
            return torch.view_as_real(xc * table[s:e]).flatten(2).float()

    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(
            f"rope_apply out: expected {list(x.shape)} {out_dtype}, got {list(out.shape)} {out.dtype}"
        )
    for s in range(0, seq_len, ROPE_CHUNK):
        e = min(s + ROPE_CHUNK, seq_len)
        out[s:e] = rotate(s, e)
    return out


class WanRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight.to(x.dtype)


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False):
        super().__init__(dim, elementwise_affine=elementwise_affine, eps=eps)

    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).type_as(x)


def linear_input(
    rows: torch.Tensor, *layers: nn.Linear, plus: torch.Tensor | None = None, silu: bool = False
) -> torch.Tensor | RowCodes:
    """rows [L, C] (`plus`: rows + plus; `silu`: F.silu(rows); one or the other) as the input of `layers`: their e4m3
    `RowCodes`, made once for all of them by `wan.fp8_inputs.quantize_rows` where they all take codes and the kernel
    runs (the sum or the SiLU taken in the same pass), else the rows as they are. For inputs whose producer inductor
    cannot fuse the quantization into (an attention kernel, a GEMM): its own looped reduction took 2-4 times the
    kernel's time there."""
    if plus is not None and silu:
        raise ValueError("linear_input: a sum or a SiLU, not both")
    if not layers:
        raise ValueError("linear_input: name the layers the rows go into")
    like = plus is None or (
        plus.shape == rows.shape and plus.dtype == rows.dtype and fp8_inputs.quantizes(plus)
    )
    if like and take_codes(*layers) and fp8_inputs.quantizes(rows):
        return RowCodes(*fp8_inputs.quantize_rows(rows, plus, silu))
    rows = F.silu(rows) if silu else rows
    return rows if plus is None else rows + plus


def attention_rows(out: torch.Tensor, layer: nn.Linear) -> torch.Tensor | RowCodes:
    """An attention's output [L, heads, d] as its o-projection `layer`'s input [L, heads * d] (`linear_input`)."""
    return linear_input(out.flatten(1), layer)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype) -> torch.Tensor:
    """[L, heads, d] inputs cast to `dtype`, through the active backend of `wan.attention` (SDPA by
    default, which is what upstream's flash_attention computes)."""
    return attention_backends.attention(q, k, v, dtype)


class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def qkv(self, x, dtype, out=None, rope=None, q_codes=False, key_slot=None, queries=True):
        """The normed queries and keys and the values of tokens `x`, each [L, heads, head_dim] in `dtype`
        (`queries` False: None in the queries' place, none made; the keys written into `key_slot`: None in theirs).
        `out`: three buffers to write them into, each as soon as it is made (one token chunk's temporaries at a
        time: the lean blocks; `key_slot` is then not used). `rope`: the compiled runner's RoPE table, to rotate q
        and k by in their norm's kernel (`wan.qk_rope`, where `rotates_in_norm`); `q_codes` (with `rope`): the
        queries come out of it as FlashAttention-3's e4m3 `HeadCodes` (`wan.fa3_attention`); `key_slot` (with
        `rope`): where the K/V cache keeps these keys (`Bidirectional.key_slot`), which the kernel writes them into
        as the cache stores them."""
        n, d = self.num_heads, self.head_dim

        def normed(norm, t):
            return norm(t) if rope is None else qk_rope.norm_rope(norm, t, rope, dtype)

        def make_queries():
            t = linear(self.q, x, dtype)
            if not q_codes:
                return normed(self.norm_q, t).view(-1, n, d)
            codes, scale = qk_rope.norm_rope_codes(self.norm_q, t, rope, n)
            return HeadCodes(codes.view(-1, n, d), scale)

        def make_keys():
            t = linear(self.k, x, dtype)
            if rope is None or key_slot is None or out is not None:
                return normed(self.norm_k, t).view(-1, n, d)
            qk_rope.norm_rope_into(self.norm_k, t, rope, key_slot)
            return None

        makers = (
            make_queries if queries else lambda: None,
            make_keys,
            lambda: linear(self.v, x, dtype).view(-1, n, d),
        )
        if out is None:
            return [make() for make in makers]
        for buf, make in zip(out, makers, strict=True):
            buf.copy_(make())

    def rotates_in_norm(self, x, freqs) -> bool:
        """Whether q and k of tokens x are rotated by their norm's kernel (`wan.qk_rope`, `qkv`'s `rope`): with
        the compiled runner's RoPE table, outside sequence parallel (which rotates after the exchange of heads)."""
        return (
            isinstance(self.norm_q, WanRMSNorm)
            and parallel.current() is None
            and qk_rope.usable(x, freqs, self.head_dim)  # x is as wide as q and k
        )

    def attend(self, q, k, v, grid, freqs, dtype, keys=None, in_place=False, rotated=False):
        """RoPE on q and k, then attention of q over the keys: [L, heads, head_dim] in, the attention output
        out. `keys(k, v)`: the keys and values the queries attend to, given this call's rotated k and v
        (None: themselves, bidirectional; a chunk-causal cache writes them and returns cache + chunk).
        Under sequence parallel (`wan.parallel.current`) q, k, v are the local token slices and this runs on
        the full sequence of the rank's heads. `in_place`: rotate q and k in their own buffers; `rotated`:
        they already are (`qkv`'s `rope`; k None: the keys are in the cache already, `qkv`'s `key_slot`).

        Upstream keeps q, k and the attention output in fp32 between bf16 roundings; going straight to
        `dtype` gives the same values (bf16 -> fp32 -> bf16 is exact) in half the memory."""

        def core(q, k, v):
            if not rotated:
                q = rope_apply(q, grid, freqs, dtype, out=q if in_place else None)
                k = rope_apply(k, grid, freqs, dtype, out=k if in_place else None)
            if keys is not None:
                k, v = keys(k, v)
            return attention(q, k, v, dtype)

        sp = parallel.current()  # sequence parallel: local tokens in, the heads' full sequence inside
        return core(q, k, v) if sp is None else sp.attention(core, q, k, v, math.prod(grid))

    def store_keys(self, x, grid, freqs, dtype, keys, key_slot=None) -> None:
        """Only the rotated keys and values of tokens `x`, handed to `keys` (a chunk-causal cache's write) as
        `forward` makes them: for a forward whose attention output nothing reads (the commit pass's last block)."""
        rotated = self.rotates_in_norm(x.codes if isinstance(x, RowCodes) else x, freqs)
        _, k, v = self.qkv(x, dtype, rope=freqs if rotated else None, key_slot=key_slot, queries=False)
        keys(k if rotated else rope_apply(k, grid, freqs, dtype), v)

    def forward(self, x, grid, freqs, dtype, keys=None, key_slot=None):
        """x: the tokens [L, C], or their `RowCodes` (fp8 q/k/v, `block_input`); `key_slot`: where `keys` keeps
        them (`Bidirectional.key_slot`)."""
        rotated = self.rotates_in_norm(x.codes if isinstance(x, RowCodes) else x, freqs)
        q_codes = rotated and attention_backends.takes_query_codes()
        q, k, v = self.qkv(x, dtype, rope=freqs if rotated else None, q_codes=q_codes, key_slot=key_slot)
        out = self.attend(q, k, v, grid, freqs, dtype, keys, rotated=rotated)
        del q, k, v
        return linear(self.o, attention_rows(out, self.o), dtype)


class WanCrossAttention(WanSelfAttention):
    def forward(self, x, context, dtype):
        return self.attend(x, *self.context_kv(context, dtype), dtype)

    def context_kv(self, context, dtype):
        """The text's keys and values [text_len, heads, d] (see `Bidirectional.text_kv`)."""
        n, d = self.num_heads, self.head_dim
        k = self.norm_k(linear(self.k, context, dtype)).view(-1, n, d)
        v = linear(self.v, context, dtype).view(-1, n, d)
        return k, v

    def attend(self, x, k, v, dtype):
        """Queries of tokens `x` against keys and values from `context_kv`, through the o-projection."""
        n, d = self.num_heads, self.head_dim
        q = self.norm_q(linear(self.q, x, dtype)).view(-1, n, d)
        out = attention(q, k, v, dtype).to(q.dtype)
        return linear(self.o, attention_rows(out, self.o), dtype)


class Bidirectional:
    """The pluggable piece of the one DiT block (`WanAttentionBlock.forward`): which keys and values its
    attention reads, and where its camera injection comes from. This one is the bidirectional experts':
    self-attention over the forward's own tokens, cross-attention over text keys computed in every block from
    the forward's embedded text, the camera injection computed in every block from the camera tokens.
    `wan.fast.ChunkCausal` is the chunk-causal one (a K/V cache of the past chunks, text keys kept, and
    optionally each block's camera injection kept for all the forwards of a chunk)."""

    def key_slot(self, layer: int, rows: int, dtype) -> "qk_rope.KeySlot | None":
        """Where block `layer`'s cache keeps this forward's `rows` rotated keys of `dtype` (its cache and the
        chunk's first row), for the q/k kernel to write them into as the cache stores them
        (`WanSelfAttention.qkv`, where the kernel runs); `self_kv` then gets None in their place. None: no cache, or
        none the kernel can write into (`self_kv` stores the keys it is given, as where the kernel does not run)."""
        return None

    def self_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Block `layer`'s rotated keys and values of this forward -> what its queries attend to."""
        return k, v

    def text_kv(self, layer: int, cross: "WanCrossAttention", context, dtype):
        """Block `layer`'s text keys and values (`cross.context_kv` of the embedded text `context`)."""
        return cross.context_kv(context, dtype)

    def camera(self, layer: int, block: "WanAttentionBlock", cam, dtype):
        """Block `layer`'s camera injection (scale, shift) of camera tokens `cam` (None: no camera)."""
        return None if cam is None else block.camera(cam, dtype)


BIDIRECTIONAL = Bidirectional()


def add_update(x: torch.Tensor, update: tuple) -> torch.Tensor:
    """x plus a block's update (its output, its gate; None: no gate), as the FFN's is what each block adds last."""
    out, gate = update
    return x + out if gate is None else x + out * gate


def modulated(h: torch.Tensor, modulation: tuple | None) -> torch.Tensor:
    """A norm's output h times (1 + scale) plus shift, in fp32 (`modulation`: (shift, scale); None: h as it is)."""
    return h if modulation is None else h.float() * (1 + modulation[1]) + modulation[0]


def block_input(x, norm, layers, update=None, camera=None, modulation=None):
    """The residual's next value and the input of the block's next linears `layers`: x plus `update` (`add_update`),
    then the camera's injection (`camera()`: its (scale, shift) or None; x becomes (1 + scale) * x + shift), then
    `norm`, `modulated`. -> (x, input). Where `layers` are all fp8 (`take_codes`) and `wan.fp8_inputs`'s kernel runs,
    the input comes as their e4m3 `RowCodes`, made in the same pass as the update and the norm."""
    if (
        isinstance(norm, WanLayerNorm)
        and take_codes(*layers)
        and fp8_inputs.usable(x, update, camera is not None)
        and (camera is None or update is not None)  # the injection acts on the updated, fp32 residual
    ):
        injection = None if camera is None else camera()
        x, codes, scale = fp8_inputs.norm_codes(x, norm, update, injection, modulation)
        return x, RowCodes(codes, scale)
    if update is not None:
        x = add_update(x, update)
    injection = None if camera is None else camera()
    if injection is not None:
        scale, shift = injection
        x = (1.0 + scale) * x + shift
    return x, modulated(norm(x), modulation)


class WanAttentionBlock(nn.Module):
    def __init__(self, dim, ffn_dim, num_heads, qk_norm, cross_attn_norm, eps, camera: bool):
        super().__init__()
        self.norm1 = WanLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, num_heads, qk_norm, eps)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(dim, num_heads, qk_norm, eps)
        self.norm2 = WanLayerNorm(dim, eps)
        self.ffn = nn.Sequential(
            nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim)
        )
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))
        if camera:
            self.cam_injector_layer1 = nn.Linear(dim, dim)
            self.cam_injector_layer2 = nn.Linear(dim, dim)
            self.cam_scale_layer = nn.Linear(dim, dim)
            self.cam_shift_layer = nn.Linear(dim, dim)

    def forward(
        self,
        x,
        e0,
        grid,
        freqs,
        context,
        cam,
        dtype,
        layer=0,
        kv=BIDIRECTIONAL,
        pending=None,
        defer=False,
        keys_only=False,
    ):
        """x: [L, C] (bf16 into block 0, fp32 after); e0: [1, 6, C] fp32; cam: [L, C] or None. `layer`: this
        block's index, `kv`: the keys its attention reads (`Bidirectional`, or a chunk-causal cache).

        The chunk loop's compiled blocks pass the FFN's update on to the next block (`defer`: returns (x, (FFN
        output, its gate)) without adding it; `pending`: that pair from the block before, added to x first), so it
        lands in the graph that norms x next and one pass over the fp32 residual fuses both. Same operations, same
        order. `keys_only` (a chunk-causal `kv`): only the self-attention's keys and values are made and written
        (`WanSelfAttention.store_keys`); returns None."""
        e = self.modulation_vectors(e0)
        attn, cross = self.self_attn, self.cross_attn
        x, h = block_input(x, self.norm1, (attn.q, attn.k, attn.v), pending, modulation=(e[0], e[1]))
        keys, slot = functools.partial(kv.self_kv, layer), kv.key_slot(layer, h.shape[0], dtype)
        if keys_only:
            return attn.store_keys(h, grid, freqs, dtype, keys, slot)
        y = attn(h, grid, freqs, dtype, keys, slot)
        camera = functools.partial(kv.camera, layer, self, cam, dtype)
        x, h = block_input(x, self.norm3, (cross.q,), (y, e[2]), camera)
        y = cross.attend(h, *kv.text_kv(layer, cross, context, dtype), dtype)
        x, h = block_input(x, self.norm2, (self.ffn[0],), (y, None), modulation=(e[3], e[4]))
        update = self.feed_forward(h, dtype), e[5]
        return (x, update) if defer else add_update(x, update)

    def modulation_vectors(self, e0):
        """The block's six [C] fp32 modulation vectors (shift, scale, gate of attention; then of the FFN)."""
        return (self.modulation.float() + e0)[0].unbind(0)

    def attention_input(self, x, e):
        return modulated(self.norm1(x), (e[0], e[1]))

    def camera(self, cam, dtype, cam_input=None):
        """The camera injection's (scale, shift) of camera tokens `cam`: x becomes (1 + scale) * x + shift.
        `cam_input`: cam's `RowCodes` for every block's first camera layer, made once for all blocks
        (`WanModel.camera_injections`; None, or cam as it is: made here where this block's layer takes codes)."""
        first, second = self.cam_injector_layer1, self.cam_injector_layer2
        h = linear(first, cam_input if isinstance(cam_input, RowCodes) else linear_input(cam, first), dtype)
        h = linear(second, linear_input(h, second, silu=True), dtype)
        h = linear_input(h, self.cam_scale_layer, self.cam_shift_layer, plus=cam)
        return linear(self.cam_scale_layer, h, dtype), linear(self.cam_shift_layer, h, dtype)

    def ffn_input(self, x, e):
        return modulated(self.norm2(x), (e[3], e[4]))

    def ffn_output(self, x, e, dtype):
        """norm2, modulation, the FFN and its gate: what the block adds to x last."""
        return self.feed_forward(self.ffn_input(x, e), dtype) * e[5]

    def forward_lean(
        self, x, e0, grid, freqs, context, cam, dtype, chunk: int = LEAN_CHUNK, layer=0, kv=BIDIRECTIONAL
    ):
        """`forward` with only the full-length tensors alive: the fp32 residual (updated in place, and
        returned; block 0 makes its fp32 copy), the camera tokens, q/k/v and the attention output, plus
        one `chunk` of tokens' temporaries. The same sub-steps as `forward`, token chunk by chunk, so the
        values equal it up to how GEMMs block rows (the chunks are smaller GEMMs).

        1. per chunk: norm1 + modulation, the q/k/v projections (and q/k norms) into full buffers;
        2. RoPE in place, then attention over the whole sequence (`WanSelfAttention.attend`);
        3. per chunk: the o-projection into x, the camera injection, cross-attention against the text
           keys/values (computed once per block), norm2 + FFN, each updating the chunk of x in place.
        """
        e = self.modulation_vectors(e0)
        attn = self.self_attn
        n, d = attn.num_heads, attn.head_dim
        length = x.shape[0]
        spans = [(s, min(s + chunk, length)) for s in range(0, length, chunk)]
        q, k, v = (torch.empty(length, n, d, dtype=dtype, device=x.device) for _ in range(3))
        for s, t in spans:
            attn.qkv(self.attention_input(x[s:t], e), dtype, out=(q[s:t], k[s:t], v[s:t]))
        # in place: the pre-RoPE q and k are not kept beside the rotated ones
        out = attn.attend(q, k, v, grid, freqs, dtype, functools.partial(kv.self_kv, layer), in_place=True)
        del q, k, v
        if x.dtype != torch.float32 or not x.is_contiguous():  # block 0: the residual becomes fp32 here
            x = x.to(torch.float32, memory_format=torch.contiguous_format)
        text_k, text_v = kv.text_kv(layer, self.cross_attn, context, dtype)
        for s, t in spans:
            xc = x[s:t]
            xc.add_(linear(attn.o, out[s:t].flatten(1), dtype) * e[2])
            if cam is not None:
                scale, shift = self.camera(cam[s:t], dtype)
                xc.mul_(1.0 + scale).add_(shift)
                del scale, shift
            xc.add_(self.cross_attn.attend(self.norm3(xc), text_k, text_v, dtype))
            xc.add_(self.ffn_output(xc, e, dtype))
        return x

    def feed_forward(self, h: torch.Tensor | RowCodes, dtype) -> torch.Tensor:
        """The FFN of its input h [L, C] (or h's `RowCodes`, `block_input`), token chunk by token chunk past
        FFN_CHUNK."""

        def ffn(part):
            hidden = linear(self.ffn[0], part, dtype)
            # fp8 on a GPU: the GELU and the down projection's row quantization in one kernel
            fused = gelu_linear(self.ffn[2], hidden, dtype)
            return fused if fused is not None else linear(self.ffn[2], self.ffn[1](hidden), dtype)

        if h.shape[0] <= FFN_CHUNK:
            return ffn(h)
        out = torch.empty(h.shape[0], h.shape[1], dtype=dtype, device=h.device)
        for s in range(0, h.shape[0], FFN_CHUNK):
            t = s + FFN_CHUNK
            out[s:t] = ffn(h.rows(s, t) if isinstance(h, RowCodes) else h[s:t])
        return out


class Head(nn.Module):
    def __init__(self, dim, out_dim, patch_size, eps=1e-6):
        super().__init__()
        self.norm = WanLayerNorm(dim, eps)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.empty(1, 2, dim))

    def forward(self, x, e):
        """x: [L, C]; e: [1, C] fp32. Runs entirely in fp32, as upstream's autocast island."""
        m = (self.modulation.float() + e.unsqueeze(1)).chunk(2, dim=1)
        return linear(self.head, self.norm(x) * (1 + m[1][0]) + m[0][0], torch.float32)


class WanModel(nn.Module):
    """One LingBot-World expert (or plain Wan2.2 i2v when `control_type` is None).

    Constructor arguments are the fields of upstream's `config.json` plus `control_type`.
    Build under `torch.device("meta")` to get the structure with no weight memory.
    """

    def __init__(
        self,
        model_type="i2v",
        patch_size=(1, 2, 2),
        text_len=512,
        in_dim=36,
        dim=5120,
        ffn_dim=13824,
        freq_dim=256,
        text_dim=4096,
        out_dim=16,
        num_heads=40,
        num_layers=40,
        window_size=(-1, -1),
        qk_norm=True,
        cross_attn_norm=True,
        eps=1e-6,
        control_type="cam",
    ):
        super().__init__()
        if model_type != "i2v":
            raise ValueError(f"model_type: only 'i2v' is supported, got {model_type!r}")
        if control_type not in (None, "cam", "act"):
            raise ValueError(f"control_type must be 'cam', 'act' or None, got {control_type!r}")
        if tuple(window_size) != (-1, -1):
            raise ValueError(f"window_size: only global attention (-1, -1) is supported, got {window_size}")
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"dim {dim} must split into {num_heads} heads of even size")
        self.config = DiTConfig(
            model_type,
            tuple(patch_size),
            text_len,
            in_dim,
            dim,
            ffn_dim,
            freq_dim,
            text_dim,
            out_dim,
            num_heads,
            num_layers,
            tuple(window_size),
            qk_norm,
            cross_attn_norm,
            eps,
            control_type,
        )
        self.patch_size = tuple(patch_size)
        self.text_len = text_len
        self.dim = dim
        self.freq_dim = freq_dim
        self.out_dim = out_dim
        self.control_type = control_type
        self.compute_dtype = torch.bfloat16

        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        if control_type is not None:
            cam_in = CONTROL_CHANNELS[control_type] * math.prod(patch_size)
            self.patch_embedding_wancamctrl = nn.Linear(cam_in, dim)
            self.c2ws_hidden_states_layer1 = nn.Linear(dim, dim)
            self.c2ws_hidden_states_layer2 = nn.Linear(dim, dim)
        self.text_embedding = nn.Sequential(
            nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList(
            WanAttentionBlock(
                dim, ffn_dim, num_heads, qk_norm, cross_attn_norm, eps, control_type is not None
            )
            for _ in range(num_layers)
        )
        self.head = Head(dim, out_dim, patch_size, eps)
        self._freqs = None  # complex128 RoPE table, made on first use on the compute device
        # None: call each block directly. Otherwise run_block(block, *block_args), e.g. one compiled
        # function shared by all blocks (see wan.speed.block_runner).
        self.block_runner = None
        # None, or a wan.block_swap.BlockSwapper streaming some blocks' weights from host RAM.
        self.block_swap = None
        # None, or a wan.parallel.SequenceParallel: this rank runs its slice of the video tokens.
        self.sequence_parallel = None
        # True: blocks run `WanAttentionBlock.forward_lean` in chunks of `lean_chunk` tokens and the head
        # runs chunk by chunk (less activation memory; not with a compiled block_runner).
        self.lean_activations = False
        self.lean_chunk = LEAN_CHUNK

    @classmethod
    def from_config(cls, config: DiTConfig) -> "WanModel":
        return cls(**vars(config))

    def _rope(self, device, start_frame: int = 0):
        """The complex128 RoPE table on `device`, its temporal band starting at frame `start_frame` (a chunk of a
        chunked generation sits at its absolute frame position; rows past the table's end are zero, never
        read: the chunked models check the clip's length against ROPE_FRAMES)."""
        if self._freqs is None or self._freqs.device != device:
            self._freqs = rope_freqs(self.blocks[0].self_attn.head_dim).to(device)
        freqs = self._freqs
        if not start_frame:
            return freqs
        c = freqs.shape[1]
        c0 = c - 2 * (c // 3)
        band0 = freqs[start_frame:, :c0]
        band0 = torch.cat([band0, band0.new_zeros(freqs.shape[0] - band0.shape[0], c0)])
        return torch.cat([band0, freqs[:, c0:]], dim=1)

    def runner_rope(self, grid: tuple, start_frame: int, device) -> torch.Tensor:
        """The compiled runner's RoPE table (`rope_table`) of a forward's token grid from frame `start_frame`."""
        return rope_table(grid, self._rope(torch.device(device), start_frame))

    def time_embed(self, t: torch.Tensor):
        """Timestep [1] -> (e [1, C], e0 [1, 6, C]) in fp32; every token shares them in i2v."""
        e = sinusoidal_embedding_1d(self.freq_dim, t.reshape(-1)[:1]).float()
        e = linear(self.time_embedding[0], e, torch.float32)
        e = linear(self.time_embedding[2], F.silu(e), torch.float32)
        e0 = linear(self.time_projection[1], F.silu(e), torch.float32).unflatten(1, (6, self.dim))
        return e, e0

    def embed_text(self, context: torch.Tensor) -> torch.Tensor:
        """Text embedding [tokens <= text_len, text_dim] -> [text_len, dim]: zero-padded to text_len, then
        the text MLP in the compute dtype."""
        dtype = self.compute_dtype
        context = torch.cat([context, context.new_zeros(self.text_len - context.shape[0], context.shape[1])])
        context = linear(self.text_embedding[0], context, dtype)
        return linear(self.text_embedding[2], self.text_embedding[1](context), dtype)

    def embed_camera(self, cam: torch.Tensor, dtype) -> torch.Tensor:
        """Packed camera tensor [1, C, F, H, W] -> per-token conditioning [L, dim]."""
        if self.control_type is None:
            raise ValueError("this checkpoint has no camera layers (plain Wan2.2 i2v); drop the camera input")
        expected = CONTROL_CHANNELS[self.control_type]
        if cam.dim() != 5 or cam.shape[:2] != (1, expected):
            raise ValueError(
                f"camera tensor: expected [1, {expected}, lat_f, lat_h, lat_w] for control_type "
                f"{self.control_type!r}, got {list(cam.shape)}"
            )
        p1, p2, p3 = self.patch_size
        tokens = rearrange(cam, "1 c (f c1) (h c2) (w c3) -> (f h w) (c c1 c2 c3)", c1=p1, c2=p2, c3=p3)
        c = linear(self.patch_embedding_wancamctrl, tokens, dtype)
        h = linear(self.c2ws_hidden_states_layer1, c, dtype)
        return c + linear(self.c2ws_hidden_states_layer2, F.silu(h), dtype)

    def camera_injections(
        self, cam_tokens: torch.Tensor, dtype, out: list | None = None, runner=None
    ) -> list:
        """Every block's camera injection (`WanAttentionBlock.camera`: its (scale, shift), [L, dim] each) of
        `embed_camera`'s tokens (under sequence parallel, of this rank's token share, as `forward_tokens` splits
        them), as a list of pairs; `out`: an earlier call's list, whose buffers are overwritten and returned (fixed
        addresses, which a recorded CUDA graph reads). `runner(block, cam, dtype, cam_input)`: a compiled
        `block.camera` (None: plain calls); `cam_input` is the tokens' codes, made once for every block here. A
        chunked session runs it once per chunk and hands the pairs to every forward of the chunk
        (`wan.fast.ChunkCausal`): the values each forward would compute."""
        sp = self.sequence_parallel
        if sp is not None:
            cam_tokens = sp.split(cam_tokens)
        # the tokens' codes once for every block's first camera layer (the same input in each)
        cam_input = linear_input(cam_tokens, *(block.cam_injector_layer1 for block in self.blocks))
        pairs = []
        for i, block in enumerate(self.blocks):
            run = block.camera if runner is None else functools.partial(runner, block)
            made = run(cam_tokens, dtype, cam_input)
            if out is not None:
                for buffer, value in zip(out[i], made, strict=True):
                    buffer.copy_(value)
                made = out[i]
            pairs.append(tuple(made))
        return pairs

    def forward(self, x, t, context, seq_len=None, y=None, cam=None):
        """One denoising prediction.

        x: noisy latent [16, F, H, W]; t: timestep tensor [1]; context: text embedding
        [tokens, text_dim] (trimmed, padded here to text_len); y: i2v condition [20, F, H, W]
        (mask + image latent); cam: packed camera tensor [1, C, F, H, W] or None.
        Returns the flow prediction [out_dim, F, H, W] in fp32.
        """
        if y is None:
            raise ValueError("i2v model needs the image condition y [20, F, H, W]")
        if context.shape[0] > self.text_len:
            raise ValueError(f"context has {context.shape[0]} tokens, more than text_len {self.text_len}")
        # no local here holds the camera tokens: the lean forward lets them go before the head
        return self.forward_tokens(
            x,
            y,
            t,
            self.embed_text(context),
            None if cam is None else self.embed_camera(cam, self.compute_dtype),
            seq_len=seq_len,
        )

    def forward_tokens(
        self,
        x,
        y,
        t,
        context,
        cam_tokens,
        start_frame=0,
        kv=BIDIRECTIONAL,
        seq_len=None,
        runner=None,
        rope=None,
        keys_only=False,
    ):
        """The prediction from embedded inputs: the one forward of the bidirectional experts (`forward`) and of
        the chunked models (`wan.fast`, one chunk at a time).

        x, y: latent and i2v condition [16 | 20, F, H, W]; t: timestep tensor; context: embedded text
        [text_len, dim] (`embed_text`; None when `kv` keeps the text's keys from an earlier forward);
        cam_tokens: `embed_camera` of the camera [F*H*W/4, dim] or None; start_frame: the latent frame the
        tokens start at (RoPE); kv: the attention's keys (`Bidirectional`, or `wan.fast.ChunkCausal`); runner:
        this forward's block runner (None: the model's `block_runner`); rope: the compiled runner's RoPE table
        (`runner_rope`) made by the caller, which keeps it in a fixed buffer (a CUDA graph's input); None: made here.
        `keys_only` (a chunk-causal `kv`): a forward run only for the keys it writes (the chunk loop's commit pass):
        the last block makes and writes its keys and values alone, as a plain call (no compiled graph of its own),
        no head runs, and it returns None. The keys are the eager whole forward's; where the blocks run compiled,
        that block's norm and modulation now run unfused, so a key can move by one rounding from the compiled
        block's. With the lean blocks or under sequence parallel the whole forward runs.
        Patch embedding, RoPE, the blocks (block swap, compiled runner, lean, sequence parallel), head and
        unpatchify run here once for every model kind.
        """
        dtype = self.compute_dtype
        x = torch.cat([x, y], dim=0)
        w = self.patch_embedding.weight
        x = F.conv3d(
            x.unsqueeze(0).to(dtype),
            w.to(dtype),
            self.patch_embedding.bias.to(dtype),
            stride=self.patch_size,
        )[0]
        grid = tuple(x.shape[1:])
        x = x.flatten(1).transpose(0, 1)  # [L, dim]
        if seq_len is not None and x.shape[0] > seq_len:
            raise ValueError(f"seq_len {seq_len} is shorter than the {x.shape[0]} video tokens")
        e, e0 = self.time_embed(t)
        if cam_tokens is not None and cam_tokens.shape[0] != x.shape[0]:
            raise ValueError(
                f"camera tensor gives {cam_tokens.shape[0]} tokens, the video has {x.shape[0]}; "
                "lat_f/lat_h/lat_w must match the latent"
            )
        run, swap, sp = runner or self.block_runner, self.block_swap, self.sequence_parallel
        if rope is None:
            freqs = self._rope(x.device, start_frame)
            # compiled blocks get RoPE as real (cos, sin) pairs; a runner that fell back runs the complex table
            compiled = run is not None and not getattr(run, "failed", False)
            rope = rope_table(grid, freqs) if compiled else freqs
        lean = self.lean_activations
        if lean and run is not None:
            raise ValueError(
                "lean_activations: the lean blocks do not run compiled; turn off compile or lean_activations"
            )
        chunk = self.lean_chunk
        if lean and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"lean_chunk: expected an integer >= 1 (tokens per chunk), got {chunk!r}")
        if keys_only and kv is BIDIRECTIONAL:
            raise ValueError("keys_only: a forward run for its keys needs a chunk-causal kv to write into")
        last = len(self.blocks) - 1 if keys_only and sp is None and not lean else None  # its keys alone
        if sp is not None:
            x = sp.split(x)
            cam_tokens = None if cam_tokens is None else sp.split(cam_tokens)
        # the bidirectional blocks take today's arguments (one compiled graph for all blocks); others add theirs
        extra = (lambda i: ()) if kv is BIDIRECTIONAL else (lambda i: (i, kv))
        # a runner that `defers` (the chunk loop's compiled one) hands each block's FFN update to the next block
        defer, pending = run is not None and getattr(run, "defers", False), None
        with parallel.use(sp):  # read by WanSelfAttention
            try:
                for i, block in enumerate(self.blocks):
                    if swap is not None:
                        swap.before(i)
                    if lean:
                        x = block.forward_lean(x, e0, grid, rope, context, cam_tokens, dtype, chunk, i, kv)
                    elif i == last:
                        x = block(
                            x, e0, grid, rope, context, cam_tokens, dtype, i, kv, pending, keys_only=True
                        )
                    elif run is None:
                        x = block(x, e0, grid, rope, context, cam_tokens, dtype, *extra(i))
                    else:
                        deferral = {"pending": pending, "defer": True} if defer else {}
                        out = run(block, x, e0, grid, rope, context, cam_tokens, dtype, *extra(i), **deferral)
                        x, pending = out if defer else (out, None)
                    if swap is not None:
                        swap.after(i)
            finally:
                if swap is not None:
                    swap.finish()  # an error or interrupt mid-forward leaves no swapped block on the device
        if last is not None:
            return None
        if pending is not None:  # the last block's FFN update: no block follows to take it
            x, pending = add_update(x, pending), None
        if lean:
            cam_tokens = None  # its last use was the last block: not held through the head
            x = self.head_lean(x, e, chunk)
        else:
            x = self.head(x, e)
        if sp is not None:  # the head is per token: gather its small output, not the [L, dim] stream
            x = sp.gather(x, math.prod(grid))
        # Upstream unpatchifies inside its bf16 autocast region, where einsum casts the fp32 head
        # output to bf16: the prediction is bf16-rounded before the final .float().
        return self.unpatchify(x.to(dtype), grid)

    def head_lean(self, x: torch.Tensor, e: torch.Tensor, chunk: int) -> torch.Tensor:
        """`self.head(x, e)` chunk by chunk into one [L, out] fp32 tensor (its norm and modulation
        temporaries are per chunk)."""
        out = torch.empty(x.shape[0], self.head.head.out_features, dtype=torch.float32, device=x.device)
        for s in range(0, x.shape[0], chunk):
            out[s : s + chunk] = self.head(x[s : s + chunk], e)
        return out

    def unpatchify(self, x: torch.Tensor, grid: tuple) -> torch.Tensor:
        c = self.out_dim
        u = x[: math.prod(grid)].view(*grid, *self.patch_size, c)
        u = torch.einsum("fhwpqrc->cfphqwr", u)
        return u.reshape(c, *[i * j for i, j in zip(grid, self.patch_size, strict=True)]).float()


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, device=None) -> nn.Module:
    """Fill every parameter with seeded random values (tests, benchmarks, the demo; real use loads weights).

    Weights get std 1/sqrt(fan_in) so activations keep their scale through the blocks; upstream's own
    init zeroes the head and the camera biases, which would make outputs trivially zero. `device`: where
    the generator draws (default the CPU; a GPU's fills a full-size model there in seconds).
    """
    g = torch.Generator(device or "cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, device=g.device)
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            p.copy_(1 + 0.1 * r)
        elif p.dim() >= 2 and "modulation" not in name:
            p.copy_(r / math.sqrt(p[0].numel()))
        else:
            p.copy_(0.1 * r)
    return model
