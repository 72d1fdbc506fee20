"""Run planner: each phase's peak VRAM and host RAM predicted from the request alone, before anything loads.

The model is a handful of terms per phase, each tied to what the code allocates, with coefficients
fitted to whole runs measured on an H200 under a 24 GiB cap (480p x 81 and 720p x 81 frames, CFG,
two random NF4 A14B experts, text encoded in a child process):

- text_encode: the T5 weights plus a small working set, on whichever device encodes; in a child
  process the parent holds nothing, but the child shares the card and the host. With `t5_overlap`
  the child runs while this process encodes the first frame and loads the high-noise expert, and the
  phase's figures are the sum: the child's (its own CUDA context included) and the larger of those two.
- vae_encode: the VAE and the video on the device, plus the encoder's chunk activations, which scale
  with the pixel area of one tile (the first frame and 4-frame chunks stream through a causal cache;
  the whole frame when untiled): `wan.vae.encode_work_bytes`, whose fitted figure `WanVAE.encode` also
  picks its 'auto' tile with (`wan.vae.pick_encode_tile`, on the VRAM free then), so the planner counts
  the tile the encode picks.
- denoise_high / denoise_low: the resident expert's weights (less the blocks `swap_blocks` keeps in
  pinned host RAM, plus the two blocks in flight), LoRA side tensors, and the activations of one forward
  pass: a per-token term and the FFN intermediate, which `wan.dit` builds in chunks of FFN_CHUNK tokens.
  Under sequence parallel (`ulysses_size` N) each rank holds the whole expert but the per-token terms
  of only L/N tokens, plus the all-to-all buffers and the tokens embedded before the split (see
  `activation_vram`); rank 0 alone encodes the text and runs the VAE, so its figures are the largest.
  With block swap the expert is first assembled in host RAM (then its resident part moves to the device),
  so the denoise's RAM holds the whole expert beside the pinned copies of its swapped blocks. Every rank
  does this with its own copy, so the denoise's RAM (the host's total) counts N of each; 'auto' swap is
  resolved by each rank against its own GPU's free VRAM.
  With lean activations (`wan.dit.WanAttentionBlock.forward_lean`) the per-token term counts only the
  tensors that stay full length, plus one chunk's temporaries (see `lean_activation_vram`); 'auto' turns
  it on only when the normal forward would not fit, before any swap.
- vae_decode: the VAE, the fp32 output video and a per-latent-pixel cost of the decoder's caches over
  one tile (the whole frame when untiled). The fast decoder (`vae_dtype` bf16/fp16) holds every cache and
  activation at its dtype's size (the per-pixel cost scales with it, as `WanVAE.decode_bytes_per_latent_pixel`
  does) and adds its copy of the decoder's weights.

`MemoryPlan.check` compares the peaks with the free memory and, when something does not fit, raises a
`MemoryPlanError` naming the phase and the settings that would fit, found with the same model.
"""

import functools
import math
import warnings
from dataclasses import dataclass, field, replace

from ..wan import i2v
from ..wan.config import DiTConfig
from ..wan.dit import FFN_CHUNK, LEAN_CHUNK, ROPE_CHUNK
from ..wan.vae import (
    DECODE_DTYPES,
    DEFAULT_OVERLAP,
    check_tile,
    encode_work_bytes,
    pick_encode_tile,
    tile_spans,
)
from .errors import RequestError

GIB = 1 << 30

# Fitted on the H200 runs (see the module docstring); bytes.
PROCESS_RAM = int(1.12 * GIB)  # anon RSS of the process with torch, the VAE and the small inputs
ENCODE_RAM_BASE = int(0.29 * GIB)
ENCODE_RAM_PER_PIXEL_FRAME = 27.2  # the input video on the host (fp32 and its staging copy)
VAE_BASE = int(0.55 * GIB)  # VAE weights, camera tensor, latents
# the fp32 first-frame video (vae_input) on the device; the encode's own work beside it (fitted on the same
# runs) is wan.vae.encode_work_bytes
VIDEO_PER_PIXEL_FRAME = 12
DECODE_BASE = int(0.39 * GIB)
DECODE_PER_LATENT_PIXEL = 1_076_700  # decoder caches + activations per latent pixel of a tile
# the causal caches' share of it (wan.vae's analytic split: 151,328 cache of 212,768 elements per pixel)
DECODE_CACHE_PER_LATENT_PIXEL = DECODE_PER_LATENT_PIXEL * 151_328 // 212_768
DECODE_MIN_TILE = 40  # latent pixels a side: 2 * overlap + 8, as wan.vae.pick_tile
DENOISE_PER_TOKEN = 175_976  # residual stream, q/k/v/attention output, camera tokens, norms (dim 5120)
DENOISE_BASE = -int(1.09 * GIB)  # fit intercept (allocator reuse across blocks); floored below
FFN_BYTES = 4  # bf16 FFN intermediate and its GELU output, per token per ffn channel
COMPILE_SAVING_PER_TOKEN = int(1.18 * GIB) // 31_668  # fused elementwise ops under --compile
T5_WORKING = 300_000_000  # the encoder's activations for two prompts
T5_DEFAULT_BYTES = 11_360_000_000  # umT5-XXL encoder, bf16
T5_CHILD_RAM = 800_000_000  # the child's interpreter and torch on top of its weights
T5_CHILD_CONTEXT = int(0.6 * GIB)  # the child's own CUDA context, beside this process's
FRAME_STEP = 4
# RoPE (wan.dit.rope_apply) per token of a ROPE_CHUNK chunk and channel: the fp64 copy (8), its complex128
# product with the table (8) and the fp32 rounding (4). A fixed ~0.8 GiB at dim 5120 that the fitted
# intercept absorbs at the calibration sizes; it is a term of its own in the floor, where few tokens (a
# sequence-parallel rank's share) leave the fitted line below what one block really holds.
ROPE_BYTES = 20
# Lean activations, bytes per token per model channel of the tensors kept full length (analytic): the fp32
# residual (4), q, k, v in bf16 (3 x 2) and the attention output in bf16 (2): 12, 71,680
# B/token at dim 5120 with the camera tokens' bf16 (LEAN_CAMERA_BYTES, 2) added. The rest is per chunk of
# LEAN_CHUNK tokens: while q/k/v are projected, the fp32 modulated norm, the projection's output and the
# q/k RMS norm's fp32 copies (LEAN_QKV_CHUNK_BYTES, ~16 per channel); in the FFN the fp32 normed input
# (4 per channel) and the bf16 intermediate and its GELU (FFN_BYTES per ffn channel).
LEAN_BYTES = 12
LEAN_CAMERA_BYTES = 2
LEAN_QKV_CHUNK_BYTES = 16
# Fitted on an H200 (bench_planner --lean, one CFG step, 720p x 81 and x 161 fully swapped): measured peaks
# sit above the analytic terms by 0.81 GiB + 5,966 B/token (allocator slack, the inputs, a dequantized
# weight, attention's per-token statistics); with them 480p x 81 all resident is predicted +1.7 % high.
LEAN_BASE = int(0.814 * GIB)
LEAN_FIT_PER_TOKEN = 5_966  # at dim 5120
# 'auto' swap and lean keep this share of the budget free: a plan packed to 11.92 of 12 GiB (720p x 81, lean)
# still ran out on the H200, where the allocator's reserve sits above the allocated bytes it predicts.
AUTO_HEADROOM = 0.06

PHASES = ("text_encode", "vae_encode", "denoise_high", "denoise_low", "vae_decode")
# the phases a run with t5_overlap goes through while the T5 child may still hold the card (until the
# first forward of denoise_high)
OVERLAPPED_PHASES = ("camera", "load_vae", "vae_encode", "denoise_high")


class MemoryPlanError(RequestError):
    """A request whose predicted peak does not fit; `phase` names it, `suggestions` what would fit."""

    def __init__(self, phase: str, message: str, suggestions: list):
        super().__init__("memory", message)
        self.phase = phase
        self.suggestions = suggestions


@dataclass(frozen=True)
class MemoryRequest:
    """What the planner needs besides the sizes: stored bytes and the memory-related settings.

    expert_bytes: {'high': int, 'low': int} stored bytes of each expert (`ExpertSource.nbytes`).
    lora_bytes: {'high': int, 'low': int} LoRA file bytes applied to each expert.
    swap_blocks: DiT blocks kept in pinned host RAM instead of VRAM (int, or 'auto': the fewest that fit).
    vae_tile: None (whole frame), 'auto' (from free VRAM) or (tile_h, tile_w) latent pixels.
    vae_dtype: the decoder's dtype by name ('fp32' exact; 'bf16'/'fp16' the fast decoder).
    t5_mode / t5_device: 'subprocess' or 'inprocess'; 'cpu' or 'cuda'.
    """

    expert_bytes: dict
    lora_bytes: dict | None = None
    swap_blocks: int | str = 0
    vae_tile: object = "auto"
    t5_mode: str = "subprocess"
    t5_device: str = "cuda"
    t5_bytes: int = T5_DEFAULT_BYTES
    compile: bool = False  # guide scale 1 (one forward per step) leaves the peak as it is: not an input
    lean_activations: bool | str = False  # chunked lean blocks (True), or 'auto': only when needed to fit
    # the T5 child runs while this process encodes the first frame and loads the high-noise expert (True),
    # or 'auto': only when both fit the card together (subprocess mode, one rank, nothing swapped)
    t5_overlap: bool | str = False
    ulysses_size: int = 1  # ranks splitting each forward's tokens (sequence parallel); figures are per rank
    vae_dtype: str = "fp32"
    # attention 'fp8' or 'fa3_fp8': its quantized copies beside each block's attention
    fp8_attention: bool = False

    def __post_init__(self):
        if self.vae_dtype not in DECODE_DTYPES:
            raise RequestError(
                "vae_dtype", f"expected one of {', '.join(DECODE_DTYPES)}, got {self.vae_dtype!r}"
            )
        if self.vae_tile is not None and self.vae_tile != "auto":
            try:
                check_tile(self.vae_tile, DEFAULT_OVERLAP)
            except ValueError:
                raise RequestError(
                    "vae_tile",
                    f"expected None, 'auto' or (tile_h, tile_w) latent pixels, each more than the "
                    f"{DEFAULT_OVERLAP} neighbouring tiles share, got {self.vae_tile!r}",
                ) from None


@dataclass(frozen=True)
class Phase:
    name: str
    vram: int
    ram: int
    note: str = ""


def _tokens(lat_f: int, lat_h: int, lat_w: int) -> int:
    return i2v.seq_len(lat_f, lat_h, lat_w)


def swap_host_ram(nbytes: int, num_layers: int, swap: int) -> tuple[int, int]:
    """Host RAM a model of `nbytes` takes with `swap` blocks swapped: (assembled, pinned). With swap the
    model is assembled in host RAM first (loaders.experts), beside the pinned copies of its swapped blocks."""
    if not swap:
        return 0, 0
    return nbytes, int(swap) * (nbytes // max(num_layers, 1))


def expert_vram(nbytes: int, num_layers: int, swap_blocks: int) -> int:
    """An expert's weights on the device with `swap_blocks` of its blocks in host RAM (two in flight)."""
    block = nbytes // max(num_layers, 1)
    swap = max(0, min(int(swap_blocks), num_layers))
    return nbytes - swap * block + min(swap, 2) * block


def _sequence_parallel_extra(act: float, tokens: int, local: int, config: DiTConfig) -> float:
    # Ulysses (wan.parallel): besides the local tokens' own q/k/v/output (in the per-token term), the
    # all-to-all gives each rank the full sequence of its H/N heads for q, k and v, and the output goes
    # back through a padded copy and a receive buffer: four [L_pad, H/N, d] bf16 buffers.
    act += 4 * local * config.dim * 2
    if config.control_type is not None:
        # the camera tokens are embedded for all L tokens and a rank keeps a slice (a view) of them,
        # so the whole bf16 [L, dim] stays alive through the forward; the per-token term has 1/N of it
        act += (tokens - local) * config.dim * 2
    # before the split every rank embeds all L tokens: the bf16 patch tokens, and the camera
    # embedding's input, hidden, activation and output; with many ranks this can be the peak
    embed = tokens * config.dim * 2 * (5 if config.control_type is not None else 1)
    return max(act, embed)


def lean_activation_vram(tokens: int, config: DiTConfig, ranks: int = 1) -> int:
    """Peak working memory of one lean forward pass (`wan.dit.WanAttentionBlock.forward_lean`): the
    full-length tensors (fp32 residual, bf16 q/k/v, attention output, camera tokens) plus the largest of
    one chunk's temporaries and the RoPE transient (while q/k/v are alive, before the attention output
    exists); per sequence-parallel rank as `activation_vram`."""
    local = -(-tokens // ranks)
    dim = config.dim
    per_token = LEAN_BYTES + (LEAN_CAMERA_BYTES if config.control_type is not None else 0)
    full = local * dim * per_token
    chunk = min(local, LEAN_CHUNK)
    qkv_phase = max(chunk * dim * LEAN_QKV_CHUNK_BYTES, min(tokens, ROPE_CHUNK) * (dim // ranks) * ROPE_BYTES)
    ffn_phase = chunk * (dim * 4 + config.ffn_dim * FFN_BYTES)
    act = max(
        full,  # the attention output beside q/k/v
        full - local * dim * 2 + qkv_phase,  # no attention output yet
        full - local * dim * 2 * 3 + ffn_phase,  # q/k/v freed
    )
    act += local * LEAN_FIT_PER_TOKEN * dim // 5120
    if ranks > 1:
        act = _sequence_parallel_extra(act, tokens, local, config)
    return int(LEAN_BASE + act)


def activation_vram(tokens: int, config: DiTConfig, compile_: bool = False, ranks: int = 1) -> int:
    """Peak working memory of one forward pass of `tokens` tokens (latents and conditions included), on
    each of `ranks` sequence-parallel ranks."""
    local = -(-tokens // ranks)  # a rank's share of the zero-padded tokens (wan.parallel.split)
    scale = config.dim / 5120
    per_token = DENOISE_PER_TOKEN * scale
    ffn = min(local, FFN_CHUNK) * config.ffn_dim * FFN_BYTES
    fitted = DENOISE_BASE + per_token * local + ffn
    rope = (
        min(tokens, ROPE_CHUNK) * (config.dim // ranks) * ROPE_BYTES
    )  # a rank ropes H/N heads of all tokens
    floor = local * config.dim * 4 * 3 + ffn + rope  # fp32 residual, its normed copy and the block output
    act = max(fitted, floor)
    if compile_:
        act = max(act - COMPILE_SAVING_PER_TOKEN * scale * local, floor)
    if ranks > 1:
        act = _sequence_parallel_extra(act, tokens, local, config)
    return int(act)


def fp8_attention_vram(q_tokens: int, kv_tokens: int, dim: int, ranks: int = 1, kv_fp8: bool = False) -> int:
    """fp8 attention's copies beside a block's attention (`wan.fp8_attention`): q, k and v in e4m3 (an fp8 K/V
    cache's keys are read as stored: none) and the output rescaled in fp32. Per sequence-parallel rank: the
    attention runs on every token of its 1/ranks of the heads. Measured on an H100 (bench_fp8): +0.12 GiB in the
    1.3B's chunk loop (this: 0.12), +0.9 GiB at the base-cam 480p step (this: 1.06)."""
    width = dim // ranks
    return (q_tokens + (0 if kv_fp8 else 2 * kv_tokens)) * width + q_tokens * width * 4


def encode_tile(frame_num: int, lat_h: int, lat_w: int, tile, budget: int | None):
    """The tile `WanVAE.encode` uses: None (whole frame) or (tile_h, tile_w). 'auto' resolves as the encode
    does (`pick_encode_tile`; `budget`: free VRAM before the VAE and the video come onto the device); a tile
    as big as the frame is the whole frame."""
    if tile == "auto":
        if budget is None:
            return None
        with warnings.catch_warnings():  # the plan itself says what does not fit
            warnings.simplefilter("ignore")
            beside = budget - VAE_BASE - VIDEO_PER_PIXEL_FRAME * frame_num * lat_h * lat_w * 64
            tile = pick_encode_tile(frame_num, lat_h, lat_w, beside)
    if tile is None or tile_count(lat_h, lat_w, tile) == 1:
        return None
    return min(tile[0], lat_h), min(tile[1], lat_w)


def tile_count(lat_h: int, lat_w: int, tile: tuple) -> int:
    """How many tiles of `tile` (latent pixels, DEFAULT_OVERLAP apart) the VAE cuts a frame into."""
    return len(tile_spans(lat_h, tile[0], DEFAULT_OVERLAP)) * len(tile_spans(lat_w, tile[1], DEFAULT_OVERLAP))


def encode_vram(frame_num: int, lat_h: int, lat_w: int, tile) -> int:
    """The first-frame encode's peak: the VAE and the video on the device and the encode's work over one tile
    (`tile`: None for the whole frame, as `encode_tile` gives it; `wan.vae.encode_work_bytes`)."""
    video = VIDEO_PER_PIXEL_FRAME * frame_num * lat_h * lat_w * 64
    return int(VAE_BASE + video + encode_work_bytes(frame_num, lat_h, lat_w, tile))


@functools.cache
def decoder_params() -> int:
    """Parameters of the Wan2.1 VAE's decoder (what the fast decoder copies), from its structure alone."""
    import torch

    from ..wan.vae import WanVAE

    with torch.device("meta"):
        return sum(p.numel() for p in WanVAE().decoder.parameters())


def decode_per_latent_pixel(vae_dtype: str = "fp32") -> int:
    """The fitted fp32 per-latent-pixel decode cost, scaled to the decoder's dtype (every cache and
    activation the analytic count holds is in it)."""
    return DECODE_PER_LATENT_PIXEL * DECODE_DTYPES[vae_dtype].itemsize // 4


def decode_vram(
    lat_f: int, lat_h: int, lat_w: int, tile, chunked: bool = False, vae_dtype: str = "fp32"
) -> int:
    """Peak VRAM of a decode with `tile` (None: whole frame). One decode frees each tile's causal caches
    when the tile is done; `chunked` (a latent handed over piece by piece, as LingBot-World-Fast does)
    keeps every tile's caches for the next piece. vae_dtype: 'fp32' (exact), or the fast decoder's
    ('bf16'/'fp16': its caches and activations at that size, plus its copy of the decoder's weights)."""
    area = lat_h * lat_w if tile is None else min(tile[0], lat_h) * min(tile[1], lat_w)
    video = 3 * (FRAME_STEP * (lat_f - 1) + 1) * lat_h * lat_w * 64 * 4
    weights = 0 if tile is None else lat_h * lat_w * 64 * 4  # the blend weight sum
    per_pixel = decode_per_latent_pixel(vae_dtype)
    others = 0
    if chunked and tile is not None:
        others = (
            (tile_count(lat_h, lat_w, tile) - 1)
            * area
            * (DECODE_CACHE_PER_LATENT_PIXEL * per_pixel // DECODE_PER_LATENT_PIXEL)
        )
    copy = 0 if vae_dtype == "fp32" else decoder_params() * DECODE_DTYPES[vae_dtype].itemsize
    return DECODE_BASE + video + weights + area * per_pixel + others + copy


def auto_tile(lat_f: int, lat_h: int, lat_w: int, budget: int | None, vae_dtype: str = "fp32"):
    """The decode tile 'auto' would use for `budget` bytes: None (whole frame) when it fits or no budget
    is known, else the largest square-ish tile that fits (at least DECODE_MIN_TILE a side)."""
    if budget is None or decode_vram(lat_f, lat_h, lat_w, None, vae_dtype=vae_dtype) <= budget:
        return None
    fixed = decode_vram(lat_f, lat_h, lat_w, (0, 0), vae_dtype=vae_dtype)
    area = max(budget - fixed, 0) / decode_per_latent_pixel(vae_dtype)
    side = max(int(math.sqrt(area)), DECODE_MIN_TILE)
    th, tw = min(side, lat_h), min(side, lat_w)
    if th < side:  # a short frame: widen the tile instead
        tw = min(max(int(area // th), DECODE_MIN_TILE), lat_w)
    elif tw < side:
        th = min(max(int(area // tw), DECODE_MIN_TILE), lat_h)
    return th, tw


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted peaks of one run: `phases` in run order, the swap and tile they assume."""

    phases: tuple
    swap_blocks: int
    vae_tile: object
    tokens: int
    size: tuple  # (lat_h, lat_w, h, w)
    frame_num: int
    planner: object = field(default=None, compare=False, repr=False)  # the Planner that made it
    encode_tile: object = None  # the first-frame encode's tile (None: whole frame)
    ranks: int = 1  # sequence-parallel ranks: VRAM figures are rank 0's GPU, RAM the host's total
    lean_activations: bool = False  # the denoise figures are for lean blocks ('auto' resolved)
    budget: int | None = None  # the free VRAM it was planned for ('auto' settings resolved against it)
    text_overlap: bool = False  # text_encode's figures are the T5 child's beside the encode and first load
    # the denoise's VRAM beyond the resident expert's weights (`expert_vram`, swap-reduced): the larger
    # expert's LoRA plus the activations (VAE and latents included); resident weights + this = the figure
    working_vram: int = 0

    @property
    def peak_vram(self) -> int:
        """Rank 0's peak (the only rank with a single device); the largest of all ranks."""
        return max(p.vram for p in self.phases)

    @property
    def rank_peak_vram(self) -> int:
        """Peak VRAM of each rank other than 0: the denoise alone (rank 0 encodes text and runs the VAE)."""
        return max(p.vram for p in self.phases if p.name.startswith("denoise"))

    @property
    def peak_ram(self) -> int:
        return max(p.ram for p in self.phases)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def table(self) -> str:
        h, w = self.size[2:]
        lines = [
            f"memory plan: {self.frame_num} frames at {h}*{w} ({self.tokens:,} tokens), "
            f"swap_blocks {self.swap_blocks}, VAE tile {_tile_text(self.vae_tile)}"
            + (", lean activations" if self.lean_activations else ""),
            f"{'phase':<13} {'peak VRAM':>10} {'peak RAM':>10}",
        ]
        if self.ranks > 1:
            lines.insert(
                1,
                f"sequence parallel over {self.ranks} ranks: VRAM per rank (rank 0's GPU), "
                f"RAM for all {self.ranks} processes on this host",
            )
        for p in self.phases:
            note = f"  {p.note}" if p.note else ""
            lines.append(f"{p.name:<13} {p.vram / GIB:>6.2f} GiB {p.ram / GIB:>6.2f} GiB{note}")
        lines.append(f"{'peak':<13} {self.peak_vram / GIB:>6.2f} GiB {self.peak_ram / GIB:>6.2f} GiB")
        if self.ranks > 1:
            others = "rank 1" if self.ranks == 2 else f"ranks 1-{self.ranks - 1}"
            lines.append(
                f"{others}: {self.rank_peak_vram / GIB:.2f} GiB of VRAM each (the denoise; "
                "rank 0 alone encodes the text and runs the VAE)"
            )
        return "\n".join(lines)

    def over(self, free_vram: int | None, free_ram: int | None = None) -> list:
        """[(phase, 'VRAM'|'RAM', needed, free)] for each phase that does not fit."""
        out = []
        for p in self.phases:
            if free_vram is not None and p.vram > free_vram:
                out.append((p.name, "VRAM", p.vram, free_vram))
            if free_ram is not None and p.ram > free_ram:
                out.append((p.name, "RAM", p.ram, free_ram))
        return out


def _tile_text(tile) -> str:
    return "none (whole frame)" if tile is None else f"{tile[0]}x{tile[1]} latent px"


class Planner:
    """Predicts a run's memory from sizes and settings; `plan()` for the table, `check()` to refuse."""

    def __init__(
        self,
        config: DiTConfig,
        size: tuple,
        frame_num: int,
        request: MemoryRequest,
        image_hw: tuple | None = None,
        max_area: int | None = None,
    ):
        self.config, self.size, self.frame_num, self.request = config, size, frame_num, request
        self.image_hw, self.max_area = image_hw, max_area

    def with_(self, size=None, frame_num=None, **request) -> "Planner":
        return Planner(
            self.config,
            size or self.size,
            frame_num or self.frame_num,
            replace(self.request, **request),
            self.image_hw,
            self.max_area,
        )

    def plan(self, budget: int | None = None) -> MemoryPlan:
        """Each phase's peaks; `budget` (free VRAM) resolves 'auto' swap and tiling as the run would."""
        r, cfg = self.request, self.config
        lat_h, lat_w, h, w = self.size
        lat_f = i2v.latent_frames(self.frame_num)
        tokens = _tokens(lat_f, lat_h, lat_w)
        pixels = h * w

        t5_gpu = r.t5_device != "cpu"
        t5_vram = r.t5_bytes + T5_WORKING if t5_gpu else 0
        if r.t5_mode == "subprocess":  # the child reads the weights into its own RAM either way
            t5_ram = PROCESS_RAM // 2 + r.t5_bytes + T5_CHILD_RAM
        else:
            t5_ram = PROCESS_RAM + (0 if t5_gpu else r.t5_bytes + T5_WORKING)
        where = "child process" if r.t5_mode == "subprocess" else "this process"
        text = Phase("text_encode", t5_vram, t5_ram, f"T5 on {'GPU' if t5_gpu else 'CPU'}, {where}")

        # 'auto' encode tiling decides from the VRAM free once the VAE and the video are on the device
        enc_tile = encode_tile(self.frame_num, lat_h, lat_w, r.vae_tile, budget)
        enc_vram = encode_vram(self.frame_num, lat_h, lat_w, enc_tile)
        enc_ram = max(PROCESS_RAM, ENCODE_RAM_BASE + ENCODE_RAM_PER_PIXEL_FRAME * pixels * self.frame_num)
        encode = Phase("vae_encode", int(enc_vram), int(enc_ram), f"tile {_tile_text(enc_tile)}")

        ranks = r.ulysses_size
        lora = r.lora_bytes or {}
        act = activation_vram(tokens, cfg, r.compile, ranks)
        if r.fp8_attention:
            act += fp8_attention_vram(tokens, tokens, cfg.dim, ranks)
        lean = r.lean_activations
        auto_budget = None if budget is None else int(budget * (1 - AUTO_HEADROOM))
        if lean == "auto":  # only when the normal forward does not fit, before any swap
            lean = (
                not r.compile
                and auto_budget is not None
                and not self._fits_denoise(
                    act, lora, auto_budget, 0 if r.swap_blocks == "auto" else r.swap_blocks
                )
            )
        if lean:
            act = lean_activation_vram(tokens, cfg, ranks)
        swap = r.swap_blocks
        if swap == "auto":
            swap = self._auto_swap(act, lora, auto_budget)
        denoise, work = [], 0
        for name in ("high", "low"):
            nbytes = int(r.expert_bytes[name])
            weights = expert_vram(nbytes, cfg.num_layers, swap)
            assembled, pinned = swap_host_ram(nbytes, cfg.num_layers, swap)
            extra = int(lora.get(name, 0)) + act  # the VAE and latents are in the fit
            work = max(work, extra)
            vram = weights + extra
            note = f"expert {nbytes / GIB:.2f} GiB" + (
                f" (assembled in host RAM), {swap} blocks in pinned RAM" if swap else ""
            )
            if ranks > 1:
                if swap:  # each rank is a process with its own expert: it pins its own swapped blocks
                    pinned *= ranks
                    assembled *= ranks
                    note += f" on each of {ranks} ranks ({pinned / GIB:.2f} GiB pinned in all)"
                note += f", {-(-tokens // ranks):,} tokens per rank"
            if lean:
                note += ", lean activations"
            denoise.append(Phase(f"denoise_{name}", int(vram), PROCESS_RAM + assembled + pinned, note))

        text, overlap = self._text_overlap(text, encode, denoise[0], act, t5_gpu, int(swap), auto_budget)

        tile = r.vae_tile
        if tile == "auto":  # the tile the run decodes with (the CLI passes it on), with the same headroom
            tile = auto_tile(lat_f, lat_h, lat_w, auto_budget, r.vae_dtype)
        dec_ram = PROCESS_RAM + 3 * self.frame_num * pixels  # the uint8 video for the MP4
        decode = Phase(
            "vae_decode",
            decode_vram(lat_f, lat_h, lat_w, tile, vae_dtype=r.vae_dtype),
            dec_ram,
            f"tile {_tile_text(tile)}" + ("" if r.vae_dtype == "fp32" else f", {r.vae_dtype} decoder"),
        )
        phases = (text, encode, *denoise, decode)
        if ranks > 1:  # every rank is a process of its own on this host: RAM is the host's total (the
            # denoise's pinned blocks already counted for every rank above)
            others = (ranks - 1) * PROCESS_RAM
            phases = tuple(replace(p, ram=p.ram + others) for p in phases)
        return MemoryPlan(
            phases=phases,
            swap_blocks=int(swap),
            vae_tile=tile,
            tokens=tokens,
            size=self.size,
            frame_num=self.frame_num,
            planner=self,
            encode_tile=enc_tile,
            ranks=ranks,
            lean_activations=bool(lean),
            budget=budget,
            text_overlap=overlap,
            working_vram=int(work),
        )

    def _text_overlap(
        self, text: Phase, encode: Phase, high: Phase, act: int, t5_gpu: bool, swap: int, budget
    ):
        """(text_encode's phase, overlapped?): with overlap the T5 child shares the card and the host with
        this process's first-frame encode and then its high-noise expert's load (VAE kept, no activations:
        the denoise figure less `act`)."""
        r = self.request
        loaded = VAE_BASE + high.vram - act
        vram = text.vram + (T5_CHILD_CONTEXT if t5_gpu else 0) + max(encode.vram, loaded)
        ram = text.ram - PROCESS_RAM // 2 + max(encode.ram, high.ram)
        overlap = r.t5_overlap
        if overlap == "auto":
            overlap = r.t5_mode == "subprocess" and r.ulysses_size == 1 and not swap and budget is not None
            overlap = overlap and vram <= budget
        if not overlap:
            return text, False
        note = text.note + ", beside the first-frame encode and the high-noise expert's load"
        return replace(text, vram=int(vram), ram=int(ram), note=note), True

    def _fits_denoise(self, act: int, lora: dict, budget: int, swap) -> bool:
        n = self.config.num_layers
        need = max(
            expert_vram(int(self.request.expert_bytes[e]), n, int(swap)) + int(lora.get(e, 0)) + act
            for e in ("high", "low")
        )
        return need <= budget

    def _auto_swap(self, act: int, lora: dict, budget: int | None) -> int:
        """The fewest swapped blocks whose denoise fits `budget` (0 without one; all if none fits)."""
        if budget is None:
            return 0
        n = self.config.num_layers
        for swap in range(n + 1):
            if self._fits_denoise(act, lora, budget, swap):
                return swap
        return n

    # -- refusing, with settings that fit --------------------------------------------------------------

    def suggestions(self, free_vram: int | None, free_ram: int | None = None) -> list:
        """Alternative settings that make the whole run fit, by the same model: a list of
        [(param, value), ...] change sets, the cheapest first (moving T5 to the CPU and tiling the VAE
        cost no quality, so they lead every set that needs them)."""

        def fits(p: "Planner") -> bool:
            return not p.plan(free_vram).over(free_vram, free_ram)

        failing = {f[0] for f in self.plan(free_vram).over(free_vram, free_ram)}
        base, planner = [], self
        if "text_encode" in failing and self.request.t5_overlap is True:  # encoding first costs seconds
            base.append(("t5_overlap", "off"))
            planner = planner.with_(t5_overlap=False)
            if fits(planner):
                return [base]
        if "text_encode" in failing and self.request.t5_device != "cpu":
            base.append(("t5_cpu", True))
            planner = planner.with_(t5_device="cpu")
        if {"vae_encode", "vae_decode"} & failing and self.request.vae_tile is None:
            base.append(("vae_tile", "auto"))
            planner = planner.with_(vae_tile="auto")
        if base and fits(planner):
            return [base]
        out = []
        if self.request.lean_activations is False and not self.request.compile:
            lean = planner.with_(lean_activations=True)
            if fits(lean):
                out.append([*base, ("lean_activations", "on")])
            elif (swap := lean._fitting_swap(fits)) is not None:
                out.append([*base, ("lean_activations", "on"), ("swap_blocks", swap)])
        swap = planner._fitting_swap(fits)
        if swap is not None:
            out.append([*base, ("swap_blocks", swap)])
        variants = [(planner, [])]
        if swap is None:  # swapping alone is not enough: pair the denoise's swap with a smaller clip
            denoise_swap = planner._fitting_swap(lambda p: not _denoise_over(p, free_vram))
            if denoise_swap:
                variants.append((planner.with_(swap_blocks=denoise_swap), [("swap_blocks", denoise_swap)]))
        for p, extra in variants:
            frames = p._fitting_frames(fits)
            if frames is not None:
                out.append([*base, *extra, ("frame_num", frames)])
            size = p._fitting_size(fits)
            if size is not None:
                out.append([*base, *extra, ("size", size)])
        return out

    def _fitting_swap(self, fits):
        start = 0 if self.request.swap_blocks == "auto" else int(self.request.swap_blocks)
        for swap in range(start + 1, self.config.num_layers + 1):
            if fits(self.with_(swap_blocks=swap)):
                return swap
        return None

    def _fitting_frames(self, fits):
        for frames in range(self.frame_num - FRAME_STEP, 0, -FRAME_STEP):
            if fits(self.with_(frame_num=frames)):
                return frames
        return None

    def _fitting_size(self, fits):
        for area, size in self._smaller_sizes():
            if fits(self.with_(size=size)):
                return area
        return None

    def _smaller_sizes(self):
        """(max_area or (h, w), latent size) steps below the current size, largest first."""
        lat_h, lat_w, h, w = self.size
        for k in range(1, 40):
            scale = 1 - k * 0.025
            if self.image_hw is not None and self.max_area is not None:
                area = int(self.max_area * scale * scale)
                try:
                    size = i2v.latent_size(*self.image_hw, area)
                except ValueError:
                    return
                th, tw = size[2:]
                area_text = _area_text(th, tw)
            else:
                th, tw = (max(16, int(v * scale) // 16 * 16) for v in (h, w))
                size, area_text = (th // 8, tw // 8, th, tw), (th, tw)
            if size[2] * size[3] < h * w:
                yield area_text, size


def _area_text(h: int, w: int) -> str:
    return f"{h}*{w}"


def _denoise_over(planner: Planner, free_vram) -> bool:
    return any(o[0].startswith("denoise") for o in planner.plan(free_vram).over(free_vram))


def format_suggestions(suggestions: list, names: dict | None = None) -> str:
    """'--swap_blocks 12, --frame_num 41 or --size 384*672' (names: param -> how a front end says it)."""
    names = names or {}
    parts = []
    for changes in suggestions:
        words = []
        for param, value in changes:
            label = names.get(param, f"--{param}")
            if value is True:
                words.append(label)
            elif isinstance(value, tuple):
                words.append(f"{label} {value[1]}x{value[0]}")
            else:
                words.append(f"{label} {value}")
        parts.append(" ".join(words))
    if not parts:
        return ""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def check(
    planner: Planner,
    free_vram: int | None,
    cap: int | None = None,
    free_ram: int | None = None,
    names: dict | None = None,
) -> MemoryPlan:
    """The plan for this much free memory (`cap`, if given, bounds the VRAM too). Raises MemoryPlanError
    naming the first phase that does not fit, its prediction, and single changes that would fit."""
    budget = free_vram if cap is None else (cap if free_vram is None else min(free_vram, cap))
    plan = planner.plan(budget)
    over = plan.over(budget, free_ram)
    if over and plan.text_overlap and planner.request.t5_overlap == "auto":
        # 'auto' weighed the VRAM only: when the overlap is what does not fit (host RAM), encode first
        planner = planner.with_(t5_overlap=False)
        plan = planner.plan(budget)
        over = plan.over(budget, free_ram)
    if not over:
        return plan
    phase, what, need, free = over[0]
    others = sorted({o[0] for o in over[1:]} - {phase})
    msg = f"{phase} needs {need / GIB:.1f} GiB of {what}, {free / GIB:.1f} GiB free" + (
        f" (also too big: {', '.join(others)})" if others else ""
    )
    fixes = planner.suggestions(budget, free_ram)
    text = format_suggestions(fixes, names)
    msg += f"; settings that fit: {text}" if text else "; no single smaller setting fits this card"
    raise MemoryPlanError(phase, msg, fixes)


def lora_bytes(specs) -> dict:
    """{'high': bytes, 'low': bytes} of the LoRA files each expert gets."""
    out = {"high": 0, "low": 0}
    for spec in specs:
        size = spec.path.stat().st_size
        for e in ("high", "low"):
            if spec.experts in (e, "both"):
                out[e] += size
    return out


@dataclass(frozen=True)
class MemoryCheck:
    """What `plan_request` checks memory with: the request's bytes and settings, the device and its free
    memory (passed in, so tests can inject them), an optional cap, and how the front end names settings."""

    request: MemoryRequest
    device: str = "cuda"
    free_vram: int | None = None
    cap: int | None = None
    free_ram: int | None = None
    names: dict | None = None

    def run(self, planner: Planner) -> MemoryPlan:
        gpu = str(self.device).startswith("cuda")
        return check(
            planner, self.free_vram if gpu else None, self.cap if gpu else None, self.free_ram, self.names
        )


def free_memory(device) -> tuple:
    """(free VRAM bytes this process can allocate or None on CPU, available host RAM bytes or None)."""
    import torch

    from ..wan.vae import free_vram

    vram = None
    if torch.device(device).type == "cuda":
        vram = free_vram(device)
    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return vram, ram


def oom_error(phase: str | None, plan: MemoryPlan | None, names: dict | None = None):
    """A MemoryPlanError for a CUDA out-of-memory that happened anyway: the phase, what the run's `plan`
    had predicted for it, and settings that fit with a margin for what the plan missed."""
    where = phase or "the run"
    if plan is None:
        return MemoryPlanError(where, f"CUDA ran out of memory during {where}; models released", [])
    predicted = next((p for p in plan.phases if p.name == phase), None)
    said = f"{predicted.vram / GIB:.1f} GiB" if predicted else f"a peak of {plan.peak_vram / GIB:.1f} GiB"
    if plan.budget is not None:
        said += f" of {plan.budget / GIB:.1f} GiB free"
    msg = f"CUDA ran out of memory during {where} (the plan predicted {said}); models released"
    fixes = []
    if plan.text_overlap and phase in OVERLAPPED_PHASES:  # the T5 child shared the card then
        msg += f" while the text encoder's child shared the card ({plan.phase('text_encode').vram / GIB:.1f} GiB together)"
        fixes = [[("t5_overlap", "off")]]
    elif plan.budget is not None and plan.planner is not None:
        gave = min(plan.budget, predicted.vram if predicted else plan.peak_vram)  # what the card really gave
        fixes = plan.planner.suggestions(int(gave * 0.9))  # less a margin for what the plan missed
    text = format_suggestions(fixes, names)
    if text:
        msg += f"; settings that would fit: {text}"
    return MemoryPlanError(where, msg, fixes)
