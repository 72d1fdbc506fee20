"""LingBot-World-Fast: chunk-causal few-step generation over one camera-controlled DiT.

Upstream's `WanI2VFast.generate` with its `WanModelFast`, step for step, on our `WanModel` (the Fast
checkpoint has a base-cam expert's keys and shapes; the window and sink are run settings, not weights):

- The clip is generated in chunks of `FastConfig.chunk_frames` latent frames (v1 Fast: 3; LingBot-World
  2.0: 4). Each chunk takes 4 denoising steps at fixed timesteps of the 1000-step UniPC table (v1 Fast:
  indices 0, 179, 358, 679, t = 999, 978, 947, 825 at shift 10; v2: 0, 250, 500, 750; see
  `wan.config.CHUNKED_KINDS` and `FastConfig.for_kind`) and no CFG: every step predicts x0 = x_t - sigma * flow (float64) and, except the last, re-noises it
  to the next timestep with fresh noise. A "commit" forward at t = 0 on the clean chunk follows; its
  output is discarded, it only rewrites the chunk's slots of the self-attention cache with clean keys
  (compiled, it stops there: its last block makes only its keys and values, and no head runs).
- Self-attention is causal through a per-layer K/V cache with no mask: a chunk's queries attend to
  the cached past and to the whole chunk. Keys are cached after RoPE at their absolute frame position
  (temporal frequencies start at the chunk's first frame) and are never re-rotated. Each forward of a
  chunk overwrites the chunk's own slots. With a window (`local_attn_size` latent frames, sink
  included), a new chunk that does not fit evicts the oldest frames after the first `sink_size`
  frames, which are kept for the whole clip.
- Cross-attention keys and values of the (zero-padded) text are computed on the first forward and
  reused by every later step and chunk.
- RNG order: all initial noise [16, lat_f, lat_h, lat_w] first, then 3 re-noise draws per chunk, from
  one generator seeded with `seed`. As in `wan.i2v.make_noise`, the generator lives on the compute
  device (upstream's is a CUDA generator on its GPU), so a CUDA run reproduces upstream's noise and a
  CPU run gives CPU noise for the same seed.

Each forward is the model's one forward (`WanModel.forward_tokens`: the same blocks, block swap, lean
activations and attention backend as the bidirectional experts) with RoPE from the chunk's first frame and
the chunk-causal keys (`ChunkCausal`: the K/V cache and the kept text keys) as its pluggable piece.
Under sequence parallel (`WanModel.sequence_parallel`, `wan.parallel`) every rank runs the same session: the
same noise (same seed), the same schedule and the same cache placement; a chunk's tokens are split across
the ranks and each rank's self-attention sees the whole chunk for its share of the heads, so its K/V cache
holds those heads only (1/N of the cache per rank); the text keys, per token work, are kept whole.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention, fp8, i2v, speed
from .config import (
    NUM_TRAIN_TIMESTEPS,
    PATCH_SIZE,
    ROPE_FRAMES,
    VAE_STRIDE,
    ChunkedKind,
    DiTConfig,
    max_frame_num,
)
from .dit import Bidirectional
from .fa3_attention import CachedRows
from .pipeline import Hooks
from .qk_rope import KeySlot
from .schedulers import sampling_sigmas

log = logging.getLogger("LingBot-World")

CHUNK_FRAMES = 3  # v1 Fast's latent frames per chunk (upstream hard-codes 3; v2 uses 4)
LATENT_CHANNELS = 16
MAX_FRAME_NUM = max_frame_num(CHUNK_FRAMES)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def fast_latent_frames(frame_num: int, chunk: int = CHUNK_FRAMES) -> int:
    """Latent frames Fast generates for `frame_num` video frames: (F-1)//4+1, cut to a multiple of
    `chunk` (3 for v1 Fast, 4 for v2)."""
    _positive_int(frame_num, "frame_num")
    lat_f = (frame_num - 1) // VAE_STRIDE[0] + 1
    lat_f -= lat_f % chunk
    if lat_f < chunk:
        raise ValueError(
            f"frame_num: Fast needs at least {(chunk - 1) * VAE_STRIDE[0] + 1} frames "
            f"(one chunk of {chunk} latent frames), got {frame_num}"
        )
    if lat_f > ROPE_FRAMES:
        raise ValueError(
            f"frame_num: Fast makes at most {max_frame_num(chunk)} frames "
            f"({ROPE_FRAMES - ROPE_FRAMES % chunk} latent frames: its RoPE table has {ROPE_FRAMES} positions), "
            f"got {frame_num}"
        )
    return lat_f


def fast_frame_num(frame_num: int, chunk: int = CHUNK_FRAMES) -> int:
    """The video frame count Fast actually produces for `frame_num`: (lat_f-1)*4+1."""
    return (fast_latent_frames(frame_num, chunk) - 1) * VAE_STRIDE[0] + 1


@dataclass(frozen=True)
class FastConfig:
    """One chunked run's settings. The defaults are v1 Fast's whole set (chunk 3, its step indices, upstream's
    CLI window); take another model's from `FastConfig.for_kind`, not by changing the chunk alone."""

    shift: float = 10.0
    timestep_index: tuple[int, ...] = (0, 179, 358, 679)
    seed: int = 42
    local_attn_size: int = -1  # latent frames kept in the self-attention cache (-1: all), sink included
    sink_size: int = 0  # latent frames at the start the window never evicts (needs a window)
    kv_dtype: torch.dtype | None = None  # None: the model's compute dtype
    chunk_frames: int = CHUNK_FRAMES  # latent frames per chunk
    compile: bool = False  # compiled blocks once the window is full (`ChunkBlocks`); off: the exact loop
    attention: str = "sdpa"  # the `wan.attention` backend of every forward (sdpa: the exact loop)
    # True: each block's camera injection made once per chunk and kept for its forwards (the same values; memory
    # `camera_cache_bytes`). 'auto': the session layer's memory plan decides; an 'auto' it did not resolve runs as
    # off. Not with blocks swapped in from the host or the lean blocks.
    camera_cache: bool | str = False
    fp8_accum: str = "exact"  # fp8 linears' accumulation (`wan.fp8.accumulation`); nothing without them

    @property
    def roll_chunks(self) -> int:
        """Chunks up to and including the first that rolls the attention window (the window's fill, then its
        first eviction): a rollout's start, whose key sets grow; 0 for an unbounded cache, which never rolls."""
        return 0 if self.local_attn_size == -1 else self.local_attn_size // self.chunk_frames + 1

    @classmethod
    def for_kind(cls, kind: ChunkedKind, **settings) -> "FastConfig":
        """The kind's chunk, step indices, shift and documented window; `settings` given as None keep them.
        An unbounded cache asked for (local_attn_size -1) without a sink takes none: a sink needs a window."""
        if settings.get("local_attn_size") == -1 and settings.get("sink_size") is None:
            settings = {**settings, "sink_size": 0}
        base = dict(
            chunk_frames=kind.chunk_frames,
            timestep_index=kind.timestep_index,
            shift=kind.shift,
            local_attn_size=kind.local_attn_size,
            sink_size=kind.sink_size,
        )
        return cls(**{**base, **{k: v for k, v in settings.items() if v is not None}})

    def validate(self) -> None:
        _positive_int(self.chunk_frames, "chunk_frames")
        if isinstance(self.shift, bool) or not isinstance(self.shift, (int, float)):
            raise ValueError(f"shift: expected a number > 0, got {self.shift!r}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift: expected a finite number > 0, got {self.shift!r}")
        idx = self.timestep_index
        if (
            not isinstance(idx, (tuple, list))
            or not idx
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx)
            or not all(0 <= i < NUM_TRAIN_TIMESTEPS for i in idx)
        ):
            raise ValueError(
                f"timestep_index: expected a non-empty tuple of integers in [0, {NUM_TRAIN_TIMESTEPS - 1}] "
                f"(indices into the {NUM_TRAIN_TIMESTEPS}-step schedule), got {idx!r}"
            )
        issue = i2v.seed_issue(self.seed)
        if issue:
            raise ValueError(f"seed: {issue}")
        if isinstance(self.sink_size, bool) or not isinstance(self.sink_size, int) or self.sink_size < 0:
            raise ValueError(f"sink_size: expected an integer >= 0 (latent frames), got {self.sink_size!r}")
        local = self.local_attn_size
        if isinstance(local, bool) or not isinstance(local, int) or (local != -1 and local < 1):
            raise ValueError(f"local_attn_size: expected -1 (unbounded) or a positive integer, got {local!r}")
        chunk = self.chunk_frames
        if local == -1 and self.sink_size:
            raise ValueError(
                f"sink_size: a sink is what a window never evicts, and local_attn_size -1 keeps every frame; "
                f"set local_attn_size to a window (>= sink_size + {chunk} = {self.sink_size + chunk}) "
                f"or sink_size to 0, got sink_size {self.sink_size}"
            )
        if local != -1 and local < self.sink_size + chunk:
            raise ValueError(
                f"local_attn_size: must leave room for a {chunk}-frame chunk after the "
                f"{self.sink_size}-frame sink (>= sink_size + {chunk} = {self.sink_size + chunk}), got {local}"
            )
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile: expected True or False, got {self.compile!r}")
        if not (isinstance(self.camera_cache, bool) or self.camera_cache == "auto"):
            raise ValueError(f"camera_cache: expected True, False or 'auto', got {self.camera_cache!r}")
        if self.attention not in attention.names():
            raise ValueError(f"attention: expected one of {attention.names()}, got {self.attention!r}")
        if self.fp8_accum not in fp8.ACCUMULATIONS:
            raise ValueError(
                f"fp8_accum: expected one of {', '.join(fp8.ACCUMULATIONS)}, got {self.fp8_accum!r}"
            )
        kv = self.kv_dtype
        if kv is not None and (not isinstance(kv, torch.dtype) or not kv.is_floating_point):
            raise ValueError(f"kv_dtype: expected None or a floating torch.dtype, got {kv!r}")


def _frame_seqlen(lat_h: int, lat_w: int, patch=PATCH_SIZE) -> int:
    return (lat_h // patch[1]) * (lat_w // patch[2])


def cache_frames(lat_f: int, fast: FastConfig) -> int:
    """Latent frames the self-attention cache holds. A window at least as long as the clip never
    evicts, so it is allocated at the clip's length (upstream allocates the window; same values)."""
    return lat_f if fast.local_attn_size == -1 else min(fast.local_attn_size, lat_f)


def camera_cache_bytes(
    config: DiTConfig, lat_shape, fast: FastConfig, compute_dtype=torch.bfloat16, ranks: int = 1
) -> int:
    """Bytes of the kept camera injections (`FastConfig.camera_cache` True; else 0): each block's scale and
    shift [chunk tokens, dim] in the compute dtype, of each rank's token share under sequence parallel."""
    if fast.camera_cache is not True or config.control_type is None:
        return 0
    _, lat_h, lat_w = lat_shape
    tokens = -(-_frame_seqlen(lat_h, lat_w, config.patch_size) * fast.chunk_frames // ranks)
    return 2 * config.num_layers * tokens * config.dim * compute_dtype.itemsize


def kv_cache_bytes_for(
    config: DiTConfig, lat_shape, fast: FastConfig, compute_dtype=torch.bfloat16, ranks: int = 1
) -> int:
    """Bytes a Fast generation's caches hold (planner), on each of `ranks` sequence-parallel ranks: the self- and
    cross-attention keys (each rank keeps its share of the heads' self-attention keys, the text keys whole) and
    the kept camera injections (`camera_cache_bytes`)."""
    lat_f, lat_h, lat_w = lat_shape
    tokens = _frame_seqlen(lat_h, lat_w, config.patch_size) * cache_frames(lat_f, fast)
    per_token = 2 * config.num_layers * config.dim
    kv_itemsize = (fast.kv_dtype or compute_dtype).itemsize
    return per_token * (
        tokens * kv_itemsize // ranks + config.text_len * compute_dtype.itemsize
    ) + camera_cache_bytes(config, lat_shape, fast, compute_dtype, ranks)


def move_rows(t: torch.Tensor, src: int, dst: int, rows: int) -> None:
    """t[dst : dst + rows] = t[src : src + rows] for dst < src (the ranges may overlap), in place: blocks of src - dst
    rows from the first on, none overlapping its own source, each source read before a later block writes over it
    (one stream). Half the bytes of a copy through a clone, and nothing allocated."""
    step = src - dst
    if step <= 0:
        raise ValueError(f"move_rows moves rows towards the start: dst {dst} must be below src {src}")
    for a in range(0, rows, step):
        n = min(step, rows - a)
        t[dst + a : dst + a + n] = t[src + a : src + a + n]


class SelfKVCache:
    """Per-layer self-attention keys and values [tokens, heads, head_dim] with upstream's indices.

    `global_end`: token end of the latest chunk in the whole clip; `local_end`: where it ends in the
    cache. `begin(start, n)` places a chunk whose clip tokens start at `start`, once per chunk (the same
    placement for every layer and forward: a new chunk that overflows rolls the cache first);
    `write(layer, k, v)` then stores a layer's keys (None: the q/k kernel wrote them there, `slot`) and values in
    the chunk's slots and returns what its queries
    attend to, cache[:end], as stored (an fp8 cache's e4m3 values: the attention backend casts them to the
    compute dtype, or the fp8 backend takes them as they are). The placement is plain integers, fixed per chunk and the
    same for every chunk once the window is full: the fixed-shape compiled blocks see constants (live play's
    growing chunks' blocks see symbols), no host sync.

    `right` (FlashAttention-3's backends, compiled): the cache holds the same rows aligned to its end instead of its
    start, so the chunk's slots are the last `n` for every chunk, growing or not, and the past sits before them from
    row `start[0]`, a tensor on the device that FA3 reads (`CachedRows`, its cache_leftpad). One compiled graph and
    one recorded CUDA graph then serve every chunk from the first. The rows before `start` are zeros (never
    written) until the window fills; from then on `start` is 0 and the layout is upstream's.
    """

    def __init__(self, num_layers, tokens, heads, head_dim, sink_tokens, dtype, device, right=False):
        self.size, self.sink = tokens, sink_tokens
        self.dtype = dtype
        shape = (tokens, heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.global_end = 0
        self.local_end = 0
        self.span = (0, 0)  # token slots [a, b) of the chunk being made (`begin`)
        self.rolled = False  # a chunk evicted: every later chunk has the same placement (the window is full)
        self._limit = torch.finfo(dtype).max if dtype.itemsize == 1 else None  # fp8: no inf, saturate
        # aligned right: the first row the queries read, on the device (None: aligned left, upstream's layout)
        self.start = torch.zeros(1, dtype=torch.int32, device=device) if right else None

    def placement(self, start: int, n: int) -> tuple[int, int]:
        """(evicted tokens, local end) for a chunk of n tokens at clip position `start`."""
        end = start + n
        if end > self.global_end and n + self.local_end > self.size:
            evicted = n + self.local_end - self.size
            return evicted, self.local_end + end - self.global_end - evicted
        return 0, self.local_end + end - self.global_end

    def slot(self, k_cache: torch.Tensor, rows: int, dtype) -> KeySlot | None:
        """`k_cache`'s slots of the chunk being made (`span`), for the q/k kernel to write its `rows` keys of
        `dtype` into as `_store` would store them (`Bidirectional.key_slot`): in an e4m3 cache its codes clamped to
        448 at scale 1, or in a cache of the keys' own dtype. None: another cache dtype, or `rows` is not the
        chunk's. The chunk must be placed (`begin`) before the block's forward takes its slot."""
        a, b = self.span
        if b - a != rows or self.dtype not in (torch.float8_e4m3fn, dtype):
            return None
        return KeySlot(k_cache, a)

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == self.dtype:  # as stored already
            return t
        if self._limit is not None:
            t = t.clamp(-self._limit, self._limit)
        return t.to(self.dtype)

    def begin(self, start: int, n: int) -> None:
        """Place a chunk of n tokens at clip token `start`, once for all its forwards and layers (the placement is
        the same for each): a chunk that overflows rolls every layer's cache first (aligned right, every new chunk
        also shifts the past towards the start by its length); `span` is then its slots. Placing the same chunk
        again moves nothing."""
        evicted, local_end = self.placement(start, n)
        if local_end - n < 0 or local_end > self.size:
            raise RuntimeError(
                f"KV cache placement out of range: {local_end - n}..{local_end} of {self.size}"
            )
        right = self.start is not None
        # the past's rows (the sink, then what the eviction keeps) from where they are to where this chunk has them
        was, now = (self.size - self.local_end, self.size - local_end) if right else (0, 0)
        if evicted:
            keep = self.local_end - evicted - self.sink
            moves = ((was, now, self.sink), (was + self.sink + evicted, now + self.sink, keep))
            self.rolled = True
        else:
            moves = ((was, now, local_end - n),)
        for src, dst, rows in moves:
            if src != dst and rows > 0:
                for cache in self.k + self.v:
                    move_rows(cache, src, dst, rows)
        self.global_end, self.local_end = start + n, local_end
        self.span = (now + local_end - n, now + local_end)
        if right:
            self.start.fill_(now)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int | None = None):
        """`store` into layer `layer`; `start` given: `begin` the chunk there first (a no-op for its later
        forwards and layers)."""
        if start is not None:
            if k is None:  # keys already written into slots (`slot`), which only a placed chunk has
                raise ValueError(
                    "SelfKVCache.write: keys written into the cache need their chunk placed first"
                )
            self.begin(start, k.shape[0])
        return self.store(self.k[layer], self.v[layer], k, v)

    def store(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor):
        """Write a chunk's keys and values into one layer's cache at `span` (k None: the q/k kernel wrote them
        there, `slot`); returns what its queries attend to, the cache up to the chunk's end, in the cache's dtype
        (aligned right: the whole cache, as `CachedRows`)."""
        a, b = self.span
        for cache, new in ((k_cache, k), (v_cache, v)):
            if new is not None:
                cache[a:b] = self._store(new)
        if self.start is not None:
            return CachedRows(k_cache, self.start), CachedRows(v_cache, self.start)
        return k_cache[:b], v_cache[:b]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class ChunkCausal(Bidirectional):
    """The chunk-causal keys of a chunked generation (the pluggable piece of `wan.dit`'s one block): a block's
    self-attention writes the chunk's rotated keys and values into the `SelfKVCache` at clip token `start`
    and attends over the cached past and the chunk; its cross-attention reads the text's keys, computed on
    the first forward (from the embedded text) and kept for the whole generation."""

    def __init__(self, cache: SelfKVCache, num_layers: int):
        self.cache = cache
        self.text: list = [None] * num_layers
        self.cams: list | None = None  # each block's camera injection of the chunk, kept (`FastSession`)

    def key_slot(self, layer, rows, dtype):
        return self.cache.slot(self.cache.k[layer], rows, dtype)

    def self_kv(self, layer, k, v):
        return self.cache.write(layer, k, v)

    def text_kv(self, layer, cross, context, dtype):
        if self.text[layer] is None:
            self.text[layer] = cross.context_kv(context, dtype)
        return self.text[layer]

    def camera(self, layer, block, cam, dtype):
        if self.cams is not None:
            return self.cams[layer]
        return super().camera(layer, block, cam, dtype)

    def layer(self, i: int) -> "LayerKeys":
        """Block i's keys alone (its cache tensors and text keys, once the text's keys exist; its kept camera
        injection, if any)."""
        cams = None if self.cams is None else self.cams[i]
        return LayerKeys(self.cache, self.cache.k[i], self.cache.v[i], self.text[i], cams)


class LayerKeys(Bidirectional):
    """One block's chunk-causal keys: what a compiled block gets (`ChunkBlocks`) instead of a layer index and
    the whole `ChunkCausal`, so one graph serves every block (an index would be a constant of the graph).
    Its methods ignore the layer argument."""

    def __init__(self, cache: SelfKVCache, k: torch.Tensor, v: torch.Tensor, text, cam=None):
        self.cache, self.k, self.v, self.text, self.cam = cache, k, v, text, cam

    def key_slot(self, layer, rows, dtype):
        return self.cache.slot(self.k, rows, dtype)

    def self_kv(self, layer, k, v):
        return self.cache.store(self.k, self.v, k, v)

    def text_kv(self, layer, cross, context, dtype):
        return self.text

    def camera(self, layer, block, cam, dtype):
        return self.cam if self.cam is not None else super().camera(layer, block, cam, dtype)


class ChunkBlocks:
    """The chunk loop's compiled block runner: `speed.CompiledBlocks` of `speed.run_chunk_block`, given each
    block's `LayerKeys`. Shapes are fixed once the window is full, so its graphs are traced once, at the first
    chunk that evicts, and never again: two (a bf16 residual stream into block 0, fp32 after). Whole clips run
    the chunks before it eagerly (their key lengths grow chunk by chunk); live play, which starts every rollout
    with them, runs them from the second chunk through a second one, of `speed.run_growing_chunk_block`, whose
    two graphs take the cache's placement as symbols. A cache aligned right (`SelfKVCache`'s `right`) has fixed
    shapes from the first chunk: its graphs are traced at the first chunk's second forward and serve every chunk."""

    # each block hands its FFN update to the next block's graph (`WanAttentionBlock.forward`'s `defer`); the
    # bidirectional runner does not: its update would stay alive through the next block, [L, dim] more at peak
    defers = True

    def __init__(self, blocks):
        self.blocks = blocks

    @property
    def failed(self) -> bool:
        return self.blocks.failed

    def __call__(self, block, *args, **deferral):
        *args, layer, kv = args
        return self.blocks(block, *args, kv.layer(layer), **deferral)


class ForwardGraph:
    """One forward recorded as a CUDA graph and replayed: each call copies its inputs into the graph's own buffers
    and replays it; the output is the graph's buffer, valid until the next call. Whatever else the forward reads
    (weights, the K/V cache, the text's keys, the cache placement) must stay where it was when it was recorded:
    a chunked session's steady state (`FastSession`)."""

    def __init__(self, forward, inputs: dict, pool=None):
        """`pool`: another graph's memory pool (`memory_pool`) to record into, for a forward that returns nothing
        (the commit pass's) and runs on the other's stream, never beside it: what it writes that outlives it is
        outside the pool (the K/V cache), and the other's live output is not handed to it."""
        self.buffers = {name: t.clone() for name, t in inputs.items()}
        self.device = next(iter(self.buffers.values())).device
        self.pool = pool
        self.out = self.record(forward)

    def record(self, forward):
        """Record `forward(**buffers)` (nothing runs yet); returns its output buffer."""
        self.graph = torch.cuda.CUDAGraph()
        # under the inputs' device (the capture stream is the current device's, e.g. with --device cuda:1);
        # thread_local: a decode worker may launch its own work on another stream meanwhile
        capture = torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local")
        with torch.cuda.device(self.device), capture:
            return forward(**self.buffers)

    def memory_pool(self):
        """This graph's memory pool, for another graph to record into (`pool`)."""
        return self.graph.pool()

    def replay(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()

    def __call__(self, inputs: dict) -> torch.Tensor | None:
        for name, t in inputs.items():
            self.buffers[name].copy_(t)
        self.replay()
        return self.out


class FastSession:
    """One Fast generation: all noise drawn at construction (upstream's RNG order), y/context fixed.

    `stream=True` (live play, an open-ended rollout of up to lat_f latent frames): each chunk's initial noise is
    drawn when the chunk starts (before its re-noise draws), y may be shorter than lat_f (latent frames past
    its end take its last frame), finished chunks are not kept (`latent()` is empty) and `set_context`
    changes the prompt between chunks. Without it nothing changes: generate's outputs are upstream's."""

    def __init__(self, model, context, y, lat_shape, config: FastConfig, device, hooks=None, stream=False):
        config.validate()
        sp = getattr(model, "sequence_parallel", None)
        if sp is not None:
            sp.check_heads(model.blocks[0].self_attn.num_heads)
        if not (isinstance(lat_shape, (tuple, list)) and len(lat_shape) == 3):
            raise ValueError(f"lat_shape: expected (lat_f, lat_h, lat_w), got {lat_shape!r}")
        lat_f, lat_h, lat_w = (int(v) for v in lat_shape)
        p = model.patch_size
        chunk = self.chunk = config.chunk_frames
        if lat_f < chunk or lat_f % chunk or lat_h % p[1] or lat_w % p[2] or min(lat_h, lat_w) < 1:
            raise ValueError(
                f"lat_shape: lat_f must be a positive multiple of {chunk} (see fast_latent_frames) "
                f"and lat_h, lat_w positive multiples of {p[1]}, {p[2]}; got {tuple(lat_shape)}"
            )
        if lat_f > ROPE_FRAMES:
            raise ValueError(f"lat_shape: at most {ROPE_FRAMES} latent frames (RoPE table), got {lat_f}")
        want_y = (4 + LATENT_CHANNELS, lat_f, lat_h, lat_w)
        if stream and isinstance(y, torch.Tensor) and y.dim() == 4 and 1 <= y.shape[1] <= lat_f:
            want_y = (want_y[0], y.shape[1], lat_h, lat_w)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want_y:
            got = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"y: expected the i2v condition {list(want_y)} (mask + image latent), got {got}")
        if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.shape[0] > model.text_len:
            got = list(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
            raise ValueError(f"context: expected [tokens <= {model.text_len}, text_dim], got {got}")
        self.model = model
        self.config = config
        self.hooks = hooks or Hooks()
        self.device = torch.device(device)
        self.lat_shape = (lat_f, lat_h, lat_w)
        self.num_chunks = lat_f // chunk
        self.done = 0
        self.frame_seqlen = _frame_seqlen(lat_h, lat_w, p)
        self._skip_commit = False  # tests only: leave the cache with the last step's noisy keys

        self.stream = stream
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(config.seed))
        if stream:  # drawn chunk by chunk in next_chunk
            self._noise, self._y, self._y_all = {}, {}, y.to(self.device)
        else:
            self._noise = list(self._draw_noise(lat_f).split(chunk, dim=1))
            self._y = list(y.to(self.device).split(chunk, dim=1))
        self._context = context.to(self.device)

        timesteps, sigmas = sampling_sigmas(NUM_TRAIN_TIMESTEPS, config.shift)
        self._timesteps, self._sigmas = timesteps, sigmas
        self.timesteps = [timesteps[i] for i in config.timestep_index]
        # the schedule's per-step values, looked up once (on the CPU) and put on the device: the loop syncs nothing
        steps = self.timesteps
        self._t = [t.reshape(1).to(self.device) for t in (*steps, steps[-1] * 0.0)]  # the commit's last
        self._sigma0 = [self._sigma_x0(t).to(self.device) for t in steps]
        self._sigma_next = [self._sigma_noise(t).to(self.device) for t in steps[1:]]

        dtype = model.compute_dtype
        blk = model.blocks[0].self_attn
        # compiled with FlashAttention-3: the cache aligned to its end, so every chunk's blocks have the same shapes
        right = config.compile and sp is None and attention.takes_cached_rows(config.attention)
        self._cache = SelfKVCache(
            len(model.blocks),
            self.frame_seqlen * cache_frames(lat_f, config),
            blk.num_heads // (1 if sp is None else sp.world),  # sequence parallel: this rank's heads
            blk.head_dim,
            config.sink_size * self.frame_seqlen if config.local_attn_size != -1 else 0,
            config.kv_dtype or dtype,
            self.device,
            right=right,
        )
        self._kv = ChunkCausal(self._cache, len(model.blocks))
        if config.camera_cache is True:
            # made before a chunk's forwards, for whole blocks: every block on the device, the normal (not lean) blocks
            setting = "swap_blocks" if model.block_swap is not None else None
            setting = "lean_activations" if getattr(model, "lean_activations", False) else setting
            if setting is not None:
                raise ValueError(
                    f"camera_cache: the kept camera injections are made before a chunk's forwards, for whole blocks "
                    f"on the device; turn off camera_cache or {setting}"
                )
        self._cams: list | None = None  # the kept camera injections' buffers (`WanModel.camera_injections`)
        self._camera_runner = None
        self._runner = self._growing = None
        # compiled on CUDA: the steady forward as a CUDA graph (`_graphed`; not under sequence parallel, whose
        # collectives it would have to record, nor with blocks swapped in from the host)
        self._graphs = (
            config.compile and self.device.type == "cuda" and sp is None and model.block_swap is None
        )
        # the fixed-shape forwards' recorded graphs (`_graphed`) by kind: False the steps', True the commit pass's
        self._graph: dict[bool, ForwardGraph] = {}
        # the kept camera injections' (`_camera_injections`; False: its recording was refused)
        self._camera_graph: ForwardGraph | bool | None = None
        # the kinds of fixed-shape forward that ran compiled in this session: the next of each records
        self._graph_warm: set = set()
        self._graph_camera = None  # how the graphs' forwards read the camera (`_graphed`)
        if config.compile:
            if getattr(model, "lean_activations", False):
                raise ValueError("compile: the lean blocks do not run compiled; turn off lean_activations")
            blocks = speed.chunk_block_runner(self.device)
            if config.camera_cache is True:
                self._camera_runner = speed.shared_runner(
                    speed.run_camera, self.device, "the camera injections"
                )
            self._runner = None if blocks is None else ChunkBlocks(blocks)
            # live play's chunks before the window is full (each rollout's first), compiled with symbolic placement
            # (play traces them in its unseen warm-up); a whole clip's and sequence parallel's run eagerly; a cache
            # aligned right needs none: its chunks all run the fixed-shape blocks
            growing = stream and blocks is not None and sp is None and not right
            growing = speed.chunk_block_runner(self.device, growing=True) if growing else None
            self._growing = None if growing is None else ChunkBlocks(growing)
        self._chunks: list[torch.Tensor] = []
        self._closed = False

    # --- schedule ---------------------------------------------------------------------------------

    def _sigma_x0(self, t: torch.Tensor) -> torch.Tensor:
        """sigma of the timestep nearest t (the first on ties), float64: upstream's x0 conversion."""
        return self._sigmas.double()[torch.argmin((self._timesteps.double() - t).abs())]

    def _sigma_noise(self, t: torch.Tensor) -> torch.Tensor:
        """sigma of `t` by the scheduler's index_for_timestep: the second match when t repeats, fp32."""
        idx = (self._timesteps == t).nonzero()
        return self._sigmas[idx[1 if len(idx) > 1 else 0].item()]

    # --- the causal forward ---------------------------------------------------------------------

    def _forward(
        self, latent: torch.Tensor, t: torch.Tensor, chunk: int, cam_tokens, commit: bool = False
    ) -> torch.Tensor | None:
        """One forward of chunk `chunk` (placed in the cache by `SelfKVCache.begin`) at timestep t [1] on the
        device (`cam_tokens`: the chunk's, the same for all its forwards): the model's one forward with RoPE
        from the chunk's first frame and the chunk-causal keys. Compiled blocks (`FastConfig.compile`) run once
        the window is full and the text's keys exist; in live play (`stream`) also the chunks from the second on
        before that, through the growing chunks' runner. With a cache aligned right (FlashAttention-3) the shapes
        are fixed from the first chunk: every forward after the text's keys runs the fixed-shape blocks.
        `commit` (the commit pass, whose prediction nothing reads): compiled, the forward stops at the last
        block's keys (`WanModel.forward_tokens`' `keys_only`) and returns None; the exact loop runs upstream's
        whole forward."""
        m, kv = self.model, self._kv
        keys_only = commit and self.config.compile
        first = kv.text[-1] is None  # the first forward (or the first after set_context): the text's keys
        context = m.embed_text(self._context) if first else None
        fixed = self._cache.rolled or self._cache.start is not None  # the blocks' shapes stay as they are now
        # the growing runner from chunk 1: at chunk 0 the cache's first slot, 0, would trace as a constant
        run = None if first else self._runner if fixed else self._growing if chunk else None
        with attention.use(self.config.attention), fp8.accumulation(self.config.fp8_accum):
            if run is not None and fixed and self._graphs and not run.failed:
                return self._graphed(run, latent, t, chunk, cam_tokens, keys_only)
            return m.forward_tokens(
                latent,
                self._y[chunk],
                t,
                context,
                cam_tokens,
                start_frame=chunk * self.chunk,
                kv=kv,
                runner=run,
                keys_only=keys_only,
            )

    def _graphed(
        self, run, latent, t, chunk: int, cam_tokens, keys_only: bool = False
    ) -> torch.Tensor | None:
        """A forward of fixed shapes (the window full or the cache aligned right, the text's keys made, the blocks
        compiled) through the session's CUDA graph of its kind (the steps', or the commit pass's `keys_only` one,
        recorded into the steps' memory pool): the first of a kind runs as it is (the compiled blocks may still
        trace), the next records its graph, and that one and every later forward of the kind replay it with their
        inputs (latent, condition, timestep, RoPE table from the chunk's first frame, camera tokens) copied into its
        buffers. The same kernels as without it, bit for bit; what it saves is the host's launch work (measured in
        BENCHMARKS.md). A refused recording logs one line and leaves the session on the compiled blocks."""
        m, p = self.model, self.model.patch_size
        _, lat_h, lat_w = self.lat_shape
        grid = (self.chunk // p[0], lat_h // p[1], lat_w // p[2])
        inputs = {
            "x": latent,
            "y": self._y[chunk],
            "t": t,
            "rope": m.runner_rope(grid, chunk * self.chunk, latent.device),
        }
        if cam_tokens is not None:
            inputs["cam"] = cam_tokens

        def forward(x, y, t, rope, cam=None):
            return m.forward_tokens(
                x, y, t, None, cam, kv=self._kv, runner=run, rope=rope, keys_only=keys_only
            )

        # a graph reads the camera the way the chunk it recorded did (tokens, kept injections or none)
        camera = (cam_tokens is not None, self._kv.cams is not None)
        if self._graph and self._graph_camera != camera:
            self._graph, self._graph_warm = {}, set()
        self._graph_camera = camera
        graph = self._graph.get(keys_only)
        if graph is None:
            if keys_only not in self._graph_warm:
                self._graph_warm.add(keys_only)
                return forward(**inputs)
            # only the commit's graph, which returns nothing, records into the steps' pool (`ForwardGraph`)
            steps = self._graph.get(False) if keys_only else None
            pool = None if steps is None else steps.memory_pool()
            try:
                graph = self._graph[keys_only] = ForwardGraph(forward, inputs, pool)
            except RuntimeError as err:
                self._graphs, self._graph = False, {}  # no graph replays from here on: their pools go too
                text = (str(err).strip().splitlines() or [""])[0]
                log.warning(
                    "CUDA graph of the chunk forward refused (%s); running the compiled blocks", text[:300]
                )
                return forward(**inputs)
        return graph(inputs)

    # --- the chunk loop -------------------------------------------------------------------------

    def _check_cam(self, cam):
        if cam is None:
            return None
        _, lat_h, lat_w = self.lat_shape
        if (
            not isinstance(cam, torch.Tensor)
            or cam.dim() != 5
            or tuple(cam.shape[2:]) != (self.chunk, lat_h, lat_w)
        ):
            got = list(cam.shape) if isinstance(cam, torch.Tensor) else type(cam).__name__
            raise ValueError(
                f"cam: expected this chunk's camera slice [1, C, {self.chunk}, {lat_h}, {lat_w}], got {got}"
            )
        return cam.to(self.device)

    @torch.no_grad()
    def next_chunk(self, cam=None, on_latent: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Denoise the next chunk (4 steps + the commit pass); returns its clean latent [16, chunk, h, w] fp32.
        `on_latent(latent)` is called with it once its last step is queued, before the commit pass (which only
        refreshes the cache from it), so a consumer on another stream can start on it that much earlier: it must
        only read it, and order its reads after an event it records in the call (`decode_worker.hand_over`)."""
        if self._closed:
            raise RuntimeError("this FastSession is closed (finished, failed or interrupted)")
        if self.done >= self.num_chunks:
            raise RuntimeError(f"all {self.num_chunks} chunks are done")
        cam = self._check_cam(cam)
        k = self.done
        try:
            if self.stream:
                self._stream_inputs(k)
            m = self.model
            cam_tokens, self._kv.cams = None, None
            if cam is not None and self.config.camera_cache is True:
                self._kv.cams = self._cams = self._camera_injections(cam)  # the forwards read these
            elif cam is not None:
                cam_tokens = m.embed_camera(cam, m.compute_dtype)
            latent = self._noise[k]
            steps = len(self.timesteps)
            n = self.chunk * self.frame_seqlen
            self._cache.begin(k * n, n)  # the chunk's cache slots, for all its forwards and layers
            for j in range(steps):
                self.hooks.check()
                flow = self._forward(latent, self._t[j], k, cam_tokens)
                x0 = (latent.double() - self._sigma0[j] * flow.double()).to(flow.dtype)
                if j == steps - 1:
                    break
                sigma = self._sigma_next[j]
                eps = torch.randn(x0.shape, generator=self.generator, device=self.device, dtype=x0.dtype)
                latent = (1 - sigma) * x0 + sigma * eps
            if on_latent is not None:
                on_latent(x0)
            self.hooks.check()
            if not self._skip_commit:
                self._forward(x0, self._t[-1], k, cam_tokens, commit=True)  # refreshes the cache
            self._noise[k] = None
        except BaseException:
            self.close()
            raise
        if not self.stream:
            self._chunks.append(x0)
        self.done += 1
        if self.hooks.progress is not None:
            self.hooks.progress(self.done, self.num_chunks, x0)
        if self.done == self.num_chunks:
            self.close()
        return x0

    def _camera_injections(self, cam: torch.Tensor) -> list:
        """The kept camera injections of the chunk's camera `cam` (`WanModel.camera_injections` of its tokens, into
        the session's buffers). Where the chunk's forwards run as a CUDA graph (`_graphed`), the compiled
        injections run as one too: the first call traces, the next records, and later ones replay with `cam` copied
        in. Its 30-40 blocks' compiled calls otherwise take the host longer than the GPU takes to run them, before
        each chunk's first forward. Same kernels, bit for bit."""
        m = self.model

        def make(cam):
            tokens = m.embed_camera(cam, m.compute_dtype)
            with fp8.accumulation(self.config.fp8_accum):
                return m.camera_injections(tokens, m.compute_dtype, self._cams, self._camera_runner)

        runner, graph = self._camera_runner, self._camera_graph
        if not self._graphs or runner is None or runner.failed or self._cams is None or graph is False:
            return make(cam)
        if graph is None:
            try:
                graph = self._camera_graph = ForwardGraph(make, {"cam": cam})
            except RuntimeError as err:
                self._camera_graph = False  # this session's injections stay on the compiled calls
                text = (str(err).strip().splitlines() or [""])[0]
                log.warning(
                    "CUDA graph of the camera injections refused (%s); running them compiled", text[:300]
                )
                return make(cam)
        return graph({"cam": cam})

    def _stream_inputs(self, k: int) -> None:
        """Chunk k's initial noise and condition frames (stream mode)."""
        n = self.chunk
        frames = torch.arange(k * n, (k + 1) * n, device=self.device).clamp(max=self._y_all.shape[1] - 1)
        self._y = {k: self._y_all.index_select(1, frames)}
        self._noise = {k: self._draw_noise(n)}

    def _draw_noise(self, frames: int) -> torch.Tensor:
        """The next `frames` latent frames of initial noise from the session's generator (fp32)."""
        _, lat_h, lat_w = self.lat_shape
        return torch.randn(
            LATENT_CHANNELS,
            frames,
            lat_h,
            lat_w,
            dtype=torch.float32,
            generator=self.generator,
            device=self.device,
        )

    def set_context(self, context: torch.Tensor) -> None:
        """A new prompt's embedding [tokens, text_dim]: the next chunk's cross-attention uses it."""
        if (
            not isinstance(context, torch.Tensor)
            or context.dim() != 2
            or context.shape[0] > self.model.text_len
        ):
            got = list(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
            raise ValueError(f"context: expected [tokens <= {self.model.text_len}, text_dim], got {got}")
        self._context = context.to(self.device)
        self._kv.text = [None] * len(self.model.blocks)
        self._graph = {}  # they read the old text's keys

    def latent(self) -> torch.Tensor:
        """The finished chunks concatenated [16, chunk * done, lat_h, lat_w]."""
        if not self._chunks:
            _, lat_h, lat_w = self.lat_shape
            return torch.zeros(LATENT_CHANNELS, 0, lat_h, lat_w, device=self.device)
        return torch.cat(self._chunks, dim=1)

    def close(self) -> None:
        """Free the caches and the remaining noise (idempotent)."""
        self._closed = True
        self._graph, self._camera_graph = {}, None
        self._cams = self._kv.cams = None
        self._cache.k, self._cache.v = [], []
        self._kv.text = [None] * len(self.model.blocks)
        self._noise = []
        self._y_all = None

    def kv_cache_bytes(self) -> int:
        """Bytes the caches hold now: self- and cross-attention keys, and the kept camera injections."""
        kept = [t for pair in (self._kv.text + (self._cams or [])) if pair is not None for t in pair]
        return self._cache.nbytes() + sum(t.numel() * t.element_size() for t in kept)


def generate_fast(model, context, y, cam, lat_shape, config: FastConfig, device, hooks=None) -> torch.Tensor:
    """The whole clip: cam is the full packed tensor [1, C, lat_f, lat_h, lat_w] or None."""
    session = FastSession(model, context, y, lat_shape, config, device, hooks)
    try:
        if cam is not None and (
            not isinstance(cam, torch.Tensor) or cam.dim() != 5 or tuple(cam.shape[2:]) != session.lat_shape
        ):
            got = list(cam.shape) if isinstance(cam, torch.Tensor) else type(cam).__name__
            raise ValueError(f"cam: expected [1, C, {', '.join(map(str, session.lat_shape))}], got {got}")
        for k in range(session.num_chunks):
            part = None if cam is None else cam[:, :, k * session.chunk : (k + 1) * session.chunk]
            session.next_chunk(part)
        return session.latent()
    finally:
        session.close()
