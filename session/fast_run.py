"""LingBot-World-Fast and 2.0 (every chunk-causal kind) for the front ends: request checks, the i2v condition, the camera per chunk, the
Fast model's residency, steering keys and the chunk loop that decodes and hands out frames as they come.

The CLI's `fast` command and the ComfyUI Fast nodes both run `wan.fast.FastSession` through here.
"""

import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..loaders.camera_files import CameraInput
from ..loaders.experts import ExpertSwitcher
from ..loaders.fast_checkpoint import FastFiles
from ..loaders.formats import ExpertSource, expected_layout
from ..wan import attention, i2v
from ..wan.camera_presets import DEFAULT_HFOV_DEG, preset_intrinsics
from ..wan.config import A14B, CHUNKED_KINDS, ChunkedKind, DiTConfig, SampleConfig
from ..wan.fast import (
    CHUNK_FRAMES,
    LATENT_CHANNELS,
    FastConfig,
    FastSession,
    cache_frames,
    fast_frame_num,
    fast_latent_frames,
    kv_cache_bytes_for,
)
from ..wan.fast_camera import parse_keys_line, pose_camera
from ..wan.fp8 import fp8_layer
from ..wan.pipeline import frames_to_uint8
from .decode_worker import DecodeWorker, hand_over, same_device
from .planner import (
    DECODE_MIN_TILE,
    ENCODE_RAM_BASE,
    ENCODE_RAM_PER_PIXEL_FRAME,
    PROCESS_RAM,
    VAE_BASE,
    decode_vram,
    encode_tile,
    encode_vram,
    expert_vram,
    fp8_attention_vram,
    swap_host_ram,
)

KV_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn}
# the fast decoder a refusal suggests: fp16 keeps 3 more mantissa bits than bf16 (measured closer to the
# exact decode), and every CUDA card has fp16 tensor cores
FIT_VAE_DTYPE = "fp16"
REAL_TIME_FPS = 16  # the video's frame rate: a chunk produced faster than this keeps up with playback
DEFAULT_FRAMES = SampleConfig.frame_num


def fast_config(
    shift: float | None,
    seed: int,
    local_attn_size: int | None,
    sink_size: int | None,
    kv_dtype: str,
    kind: ChunkedKind = CHUNKED_KINDS["fast"],
    compile: bool = False,
    attention: str = "sdpa",
    camera_cache: bool | str = False,
    fp8_accum: str = "exact",
) -> FastConfig:
    """A checked FastConfig for the model kind (its chunk and step indices; shift, window and sink given
    as None are its documented run's); kv_dtype by name ('bf16' = the model's compute dtype, 'fp8' =
    float8 e4m3); `compile`: compiled blocks once the window is full (`FastConfig.compile`); `attention`: the
    forwards' attention backend (`wan.attention`); `camera_cache`: True, False or 'auto' (`check_devices` decides;
    `FastConfig.camera_cache`); `fp8_accum`: the fp8 linears' accumulation (`wan.fp8.accumulation`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype: expected one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    config = FastConfig.for_kind(
        kind,
        shift=shift,
        seed=seed,
        local_attn_size=local_attn_size,
        sink_size=sink_size,
        kv_dtype=KV_DTYPES[kv_dtype],
        compile=compile,
        attention=attention,
        camera_cache=camera_cache,
        fp8_accum=fp8_accum,
    )
    config.validate()
    return config


def check_camera_cache(config: FastConfig, swap: int) -> None:
    """A camera cache asked for (True) with blocks swapped in from the host: ValueError naming both `--flag`s, as
    the planner's messages do (its injections are made before a chunk's forwards, with every block on the
    device)."""
    if config.camera_cache is True and swap:
        raise ValueError(
            f"--camera_cache on: the kept camera injections are made with every DiT block on the device, and "
            f"--swap_blocks {swap} keeps blocks in host RAM; use --camera_cache auto or off with --swap_blocks"
        )


def caches_label(config: FastConfig) -> str:
    """What `FastMemory.caches` holds, in a message's words."""
    return "attention and camera caches" if config.camera_cache is True else "attention caches"


def camera_choices(config: FastConfig, swap: int) -> list:
    """The camera cache settings a memory check tries, in order: the one asked for; for 'auto' on (unless blocks are
    swapped in from the host), then off."""
    if config.camera_cache != "auto":
        return [config.camera_cache]
    return [True, False] if swap == 0 else [False]


def decide_camera_cache(config: FastConfig, swap: int, fits: Callable[[FastConfig], bool]) -> FastConfig:
    """`config` with its camera cache decided (`camera_choices`): the first that `fits`, else the last (a front
    end without `check_devices`'s plan: the ComfyUI Fast sampler)."""
    *tries, last = (replace(config, camera_cache=c) for c in camera_choices(config, swap))
    return next((c for c in tries if fits(c)), last)


def condition(image: torch.Tensor, encode: Callable, frame_num: int, size: tuple, device) -> torch.Tensor:
    """The i2v condition y [20, lat_f, lat_h, lat_w] for the whole clip, computed once as upstream: the
    first-frame mask and the VAE latent of the image followed by frame_num - 1 zero frames."""
    lat_h, lat_w, h, w = size
    mask = i2v.first_frame_mask(frame_num, lat_h, lat_w, device)
    latent = encode(i2v.vae_input(image, frame_num, h, w).to(device))
    return torch.cat([mask, latent.to(device, torch.float32)])


def camera_frames(camera: CameraInput, frame_num: int | None) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(poses, actions, video frames) a camera input drives for `frame_num` (None: its own length or
    the default), upstream's rules: a pose file cut to the frames, act2cam's F+1 poses whole."""
    poses, actions, frames = camera.plan(frame_num)
    if not camera.act2cam:
        poses = poses[:frames]
    return poses, actions, frames


def camera_tensor(
    camera: CameraInput,
    control_type: str | None,
    frame_num: int | None,
    size: tuple,
    device,
    chunk: int = CHUNK_FRAMES,
):
    """(packed camera [1, C, lat_f, lat_h, lat_w] by upstream Fast's rule, the video frames Fast makes);
    chunk: latent frames a chunk (the clip is whole chunks)."""
    if control_type is None:
        raise ValueError("camera: this model has no camera layers; give no camera input")
    poses, actions, frames = camera_frames(camera, frame_num)
    lat_f = fast_latent_frames(frames, chunk)
    cam = pose_camera(poses, camera.intrinsics, lat_f, size, control_type, actions, device=device)
    return cam, fast_frame_num(frames, chunk)


def steering_intrinsics(camera: CameraInput | None, size: tuple, hfov_deg: float = DEFAULT_HFOV_DEG):
    """Intrinsics for keys steering: a camera folder's intrinsics.npy, else a centred pinhole of
    `hfov_deg` horizontal field of view at the video size."""
    if camera is not None:
        return camera.intrinsics
    return preset_intrinsics(np.ones(1), size[2:], hfov_deg)


# ------------------------------------------------------------------------------------------- the model


class FastModel:
    """The one Fast DiT: streamed in (quantized to NF4 on the way if asked) when first needed, optionally
    with block swap, kept until `release` (parked in RAM within `ram_budget`, else dropped)."""

    def __init__(
        self,
        files: FastFiles,
        device,
        quantize: bool | None = None,
        swap_blocks: int = 0,
        ram_budget: int = 0,
    ):
        # ExpertSwitcher's residency, swap and parking, for a single model under one role name
        self._switcher = ExpertSwitcher(
            {"high": files.source, "low": files.source},
            device,
            quantize=quantize,
            ram_budget=ram_budget,
            swap_blocks=swap_blocks,
        )
        self.files = files

    @property
    def device(self) -> torch.device:
        return self._switcher.device

    @property
    def loads(self) -> int:
        return self._switcher.loads

    def __call__(self):
        return self._switcher("high")

    def release(self) -> None:
        self._switcher.release()

    def close(self) -> None:
        self._switcher.close()


def _tensor_bytes(shape, quantize: bool | None) -> int:
    """bf16, or for a 2-D (Linear) weight quantized to NF4 ~4.1 bits: the 4-bit codes and the 8-bit
    absmax per 64 (double quant)."""
    n = math.prod(shape)
    return n * 33 // 64 if quantize and len(shape) == 2 else 2 * n


def device_bytes(source: ExpertSource, quantize: bool | str | None) -> int:
    """Device bytes of the loaded model (to ask the host for room): as stored for an NF4 or fp8 folder; else
    bf16, with the 2-D (Linear) weights at ~4.1 bits when quantized while loading; 'fp8': the blocks' Linears
    at 1 byte per weight plus 4 per row (`wan.fp8`), everything else bf16."""
    if quantize == "fp8" and not source.fp8_layers:
        return fp8_bytes(source.dit_config)
    if source.quantized:
        return source.nbytes
    return sum(_tensor_bytes(ref.shape, quantize) for ref in source.tensors.values())


def fp8_bytes(config: DiTConfig) -> int:
    """Device bytes of this architecture with fp8 linears (`wan.fp8`): the blocks' Linear weights at 1 byte
    per weight plus a 4-byte scale per row, every other tensor in bf16."""
    params, linears = expected_layout(config)
    dense = sum(2 * math.prod(shape) for shape in params.values())
    return dense + sum(o * i + 4 * o if fp8_layer(m, (o, i)) else 2 * o * i for m, (o, i) in linears.items())


def nf4_bytes(config: DiTConfig) -> int:
    """Device bytes of an NF4 model of this architecture, before any file exists (`plan --model`): the
    Linear weights as `device_bytes` counts them quantized, every other tensor in bf16."""
    params, linears = expected_layout(config)
    return sum(_tensor_bytes(shape, True) for shape in [*linears.values(), *params.values()])


@dataclass(frozen=True)
class ChunkedModel:
    """What the chunk loop's memory depends on besides its FastConfig: the DiT's architecture and its bytes
    on the device; from a Fast folder (`chunked_model`) or a model's name (`of_kind`)."""

    config: DiTConfig
    nbytes: int

    @classmethod
    def of_kind(cls, kind: ChunkedKind) -> "ChunkedModel":
        return cls(kind.dit, nf4_bytes(kind.dit))


def chunked_model(files, quantize: bool | None) -> ChunkedModel:
    """`files`: a FastFiles (its model as loaded, quantized or not) or a ChunkedModel already."""
    if isinstance(files, ChunkedModel):
        return files
    return ChunkedModel(files.config, device_bytes(files.source, quantize))


# ------------------------------------------------------------------------------------------- keys


def read_keys_file(path) -> list[np.ndarray]:
    """Every line of a keys file, checked before anything loads (ValueError naming the bad line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--keys: {path} not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--keys: {path} is not a text file (byte {err.start} is not UTF-8); expected one line of keys "
            "per chunk (e.g. 'w')"
        ) from None
    if not lines:
        raise ValueError(f"--keys: {path} is empty; expected one line of keys per chunk (e.g. 'w')")
    return [parse_keys_line(line, f"--keys {path} line {n}") for n, line in enumerate(lines, start=1)]


def stdin_keys(stream=None, prompt: bool | None = None) -> Iterator[np.ndarray]:
    """Key lines from stdin as the chunks need them; a bad line is reported on stderr and skipped (the
    run goes on with the next line); end of input ends the clip."""
    stream = stream or sys.stdin
    prompt = stream.isatty() if prompt is None else prompt
    n = 0
    while True:
        if prompt:
            print("keys for the next chunk (w a s d i j k l, none)> ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line:
            return
        n += 1
        try:
            yield parse_keys_line(line, f"--keys stdin line {n}")
        except ValueError as err:
            print(f"ignored: {err}", file=sys.stderr, flush=True)


def steered_cameras(keys: Iterable[np.ndarray], steering) -> Iterator[torch.Tensor]:
    """Chunk k's camera, built when chunk k starts from the keys of chunks 0..k."""
    for row in keys:
        steering.add(row)
        yield steering.camera(steering.chunks - 1)


def whole_path_cameras(cam: torch.Tensor | None, chunk: int = CHUNK_FRAMES) -> Iterator[torch.Tensor | None]:
    """The `chunk`-frame slices of a camera built up front (None forever for no camera)."""
    k = 0
    while True:
        yield None if cam is None else cam[:, :, k * chunk : (k + 1) * chunk]
        k += 1


# ------------------------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class ChunkTiming:
    index: int
    chunks: int
    frames: int  # video frames this chunk decoded to
    denoise_s: float  # 4 steps + the commit pass
    decode_s: float
    kv_cache_bytes: int
    overlap: bool = False  # decoded beside the next chunk's denoise (a decode worker)

    @property
    def seconds(self) -> float:
        """The chunk's wall time: its denoise and its decode, or the slower of them when they overlap."""
        return max(self.denoise_s, self.decode_s) if self.overlap else self.denoise_s + self.decode_s

    @property
    def fps(self) -> float:
        """Video frames produced per second of wall time for this chunk (real time: 16)."""
        return self.frames / max(self.seconds, 1e-9)

    def line(self) -> str:
        head = f"chunk {self.index + 1}/{self.chunks}: denoise {self.denoise_s * 1e3:.0f} ms"
        cache = f"KV cache {self.kv_cache_bytes / 2**30:.2f} GiB"
        if not self.frames:  # not decoded here
            return f"{head}, {cache}"
        pace = "faster than" if self.fps >= REAL_TIME_FPS else "slower than"
        return (
            f"{head}, decode {self.decode_s * 1e3:.0f} ms, {self.frames} frames -> {self.fps:.1f} fps "
            f"({pace} real time, {REAL_TIME_FPS} fps), {cache}"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_stream(device: torch.device) -> None:
    """Until this thread's current stream is done (not the other thread's, which `_sync` would wait for)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_chunks(session: FastSession, cameras: Iterable, decoder, on_chunk: Callable, decode_on=None) -> int:
    """Generate chunk after chunk, each with the next camera from `cameras` (running out ends the clip
    early), decode it at once with `decoder` (a `WanVAE.chunk_decoder()`, or None to skip decoding) and
    call on_chunk(latent [16, chunk, h, w], video [3, F, H, W] or None, ChunkTiming). Returns the chunks made.
    `decode_on`: the decoder's device, where a `DecodeWorker` decodes each chunk and calls on_chunk (in its
    thread, in order) while the next chunk is denoised (with compiled blocks one chunk at a time until they
    have traced: `compile_warm_chunks`); its exception is raised here, after it has stopped."""
    device = session.device
    worker = None
    if decoder is not None and decode_on is not None:
        decode_on = torch.device(decode_on)
        worker = DecodeWorker(decode_on, functools.partial(_decode_chunk, decoder, on_chunk))
    warm = compile_warm_chunks(session.config, session.num_chunks)
    try:
        for k, cam in zip(range(session.num_chunks), cameras, strict=False):
            t0 = time.perf_counter()
            latent = session.next_chunk(cam)
            if worker is not None:
                _sync_stream(device)
                timing = ChunkTiming(
                    k,
                    session.num_chunks,
                    0,
                    time.perf_counter() - t0,
                    0.0,
                    session.kv_cache_bytes(),
                    k >= warm,
                )
                latent, ready = hand_over(latent, decode_on)
                worker.submit((latent, timing), ready)  # waits while the previous chunk is in the decoder
                if k < warm:
                    worker.wait()
                continue
            _sync(device)
            t1 = time.perf_counter()
            video = None
            if decoder is not None:
                video = decoder.decode(latent)
                _sync(device)
            t2 = time.perf_counter()
            frames = 0 if video is None else video.shape[1]
            on_chunk(
                latent,
                video,
                ChunkTiming(k, session.num_chunks, frames, t1 - t0, t2 - t1, session.kv_cache_bytes()),
            )
    except BaseException:
        if worker is not None:
            with contextlib.suppress(Exception):  # the error that stopped the loop is the one to tell
                worker.close()
        raise
    if worker is not None:
        worker.close()
    return session.done


def _decode_chunk(decoder, on_chunk: Callable, job: tuple) -> None:
    """A decode worker's part of a chunk (`run_chunks`): decode it, time it, hand it to on_chunk."""
    latent, timing = job
    t0 = time.perf_counter()
    video = decoder.decode(latent)
    _sync_stream(latent.device)
    timing = replace(timing, frames=video.shape[1], decode_s=time.perf_counter() - t0)
    on_chunk(latent, video, timing)


class FrameSink:
    """Decoded chunks -> uint8 frames handed to `writer` as they come (a `video.Mp4Writer` encodes them at
    once, so an endless run holds one chunk's frames, not the clip's) and written as PNGs to `frames_dir`
    (each PNG written to a temporary name and renamed, so a viewer never reads half a file)."""

    def __init__(self, frames_dir: Path | None = None, overwrite: bool = False, writer=None):
        self.writer = writer
        self.count = 0
        self.dir = None if frames_dir is None else check_frames_dir(frames_dir, overwrite)

    def add(self, video: torch.Tensor) -> None:
        frames = frames_to_uint8(video)
        if self.writer is not None:
            self.writer.add(frames)
        if self.dir is not None:
            from PIL import Image

            for i, frame in enumerate(frames.numpy(), start=self.count):
                target = self.dir / f"frame_{i:05d}.png"
                tmp = self.dir / f".frame_{i:05d}.partial.png"
                Image.fromarray(frame).save(tmp)
                tmp.replace(target)
        self.count += len(frames)


def check_frames_dir(path, overwrite: bool = False) -> Path:
    """A folder for PNG frames: created if missing; one already holding frame_*.png only with overwrite."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"--frames_dir: {path} is a file; give a folder")
    path.mkdir(parents=True, exist_ok=True)
    old = sorted(path.glob("frame_*.png"))
    if old:
        if not overwrite:
            raise FileExistsError(
                f"--frames_dir: {path} already holds {len(old)} frame_*.png; pass --overwrite"
            )
        for p in old:
            p.unlink()
    return path


# ----------------------------------------------------------------------------------------- memory

# Working memory of one chunk's forward beyond the weights and the caches, per token of the chunk:
# measured on an H200 at 464x832 (4,524 tokens a chunk) as peak - resident model - caches, 1.20-1.26 GiB
# across the unbounded, windowed and fp8 settings (BENCHMARKS.md, bench_fast); the largest is kept.
FAST_CHUNK_PER_TOKEN = int(1.27 * (1 << 30)) // 4524


# Host RAM of the streamed MP4 per video pixel: one chunk's uint8 frames (12 x 3 B) and libx264's look-ahead
# and reference frames in YUV 4:2:0 (~40 x 1.5 B); the clip's frames are not kept.
MP4_RAM_PER_PIXEL = 100


@dataclass(frozen=True)
class FastMemory:
    model: int  # the DiT on the device (swapped blocks excluded, two in flight)
    caches: int  # self- and cross-attention K/V at their largest
    work_forward: int  # a chunk's forward
    work_decode: int = 0  # a chunk's VAE decode, when the run decodes each chunk (the CLI; not the node)
    condition: int = 0  # the i2v condition of the whole clip, kept on the device through the loop
    encode: int = 0  # the first-frame encode, before the model loads: the whole clip's video on the device
    ram: int = 0  # host RAM at its largest: the encode's input video, or the loop with the MP4 streamed
    overlap: bool = False  # a chunk's decode runs beside the next chunk's forward (play's decode worker)

    @property
    def work(self) -> int:
        """The larger of a chunk's forward and its decode, or both when they overlap."""
        if self.overlap:
            return self.work_forward + self.work_decode
        return max(self.work_forward, self.work_decode)

    @property
    def loop(self) -> int:
        return self.model + self.caches + self.work + self.condition

    @property
    def peak(self) -> int:
        return max(self.loop, self.encode)


def fast_memory(
    files: FastFiles | ChunkedModel,
    lat_shape: tuple,
    config: FastConfig,
    quantize: bool | None,
    swap: int,
    tile=None,
    vae_dtype: str = "fp32",
    ranks: int = 1,
    decode: bool = True,
    budget: int | None = None,
    encode: bool = True,
    overlap: bool = False,
) -> FastMemory:
    """Predicted peak VRAM of a Fast run (the first-frame encode, then the chunk loop) and its host RAM.
    Everything that grows with the clip is counted: the caches (unless windowed), the condition, and the
    encode's input video; decoded frames are encoded into the MP4 chunk by chunk and not kept. `files`: a
    FastFiles or a ChunkedModel (a chunked kind by its architecture, for planning without files).
    vae_dtype: the chunk decoder's ('fp32' exact, 'bf16'/'fp16' the fast decoder). `ranks`: sequence-parallel
    ranks (each holds 1/ranks of the self-attention cache; the rest is counted whole). `decode`: the loop
    decodes each chunk (the CLI); False where the decode runs elsewhere (the sampler node). `budget`: the free
    VRAM at the encode, which 'auto' tiles it to (as `WanVAE.encode` does; None: counted at its smallest tile).
    `encode`: False where the first-frame encode runs on another device (play's --decode_device). `overlap`: the
    decode runs beside the next chunk's forward (play's decode worker on the same device)."""
    m = chunked_model(files, quantize)
    cfg, chunk = m.config, config.chunk_frames
    lat_f, lat_h, lat_w = lat_shape
    frames, pixels = (lat_f - 1) * 4 + 1, lat_h * lat_w * 64
    tokens = chunk * lat_h * lat_w // (cfg.patch_size[1] * cfg.patch_size[2])
    model = expert_vram(m.nbytes, cfg.num_layers, swap)
    decoding = (
        decode_vram(chunk, lat_h, lat_w, fixed_tile(tile), chunked=True, vae_dtype=vae_dtype) if decode else 0
    )
    # measured on the A14B; a narrower model's activations scale with its widths (the larger ratio)
    scale = max(cfg.dim / A14B.dim, cfg.ffn_dim / A14B.ffn_dim)
    forward = int(tokens * FAST_CHUNK_PER_TOKEN * scale)
    if config.attention in attention.QUANTIZED:
        # its copies of q (and of the window's k/v, unless the cache holds e4m3)
        kv_tokens = tokens // chunk * cache_frames(lat_f, config)
        forward += fp8_attention_vram(
            tokens, kv_tokens, cfg.dim, ranks, config.kv_dtype == torch.float8_e4m3fn
        )
    condition = (4 + LATENT_CHANNELS) * lat_f * lat_h * lat_w * 4
    encoding = first_frame_encode(lat_shape, tile, budget) if encode else 0
    encode_ram = ENCODE_RAM_BASE + ENCODE_RAM_PER_PIXEL_FRAME * pixels * frames
    ram = int(
        max(
            encode_ram,
            PROCESS_RAM + MP4_RAM_PER_PIXEL * pixels + sum(swap_host_ram(m.nbytes, cfg.num_layers, swap)),
        )
    )
    caches = kv_cache_bytes_for(cfg, lat_shape, config, ranks=ranks)
    return FastMemory(model, caches, forward, decoding, condition, encoding, ram, overlap and decode)


def fixed_tile(tile) -> tuple | None:
    """A `--vae_tile` setting's fixed tile (h, w), or None for 'auto' or whole frames."""
    return tile if isinstance(tile, tuple) else None


def first_frame_encode(lat_shape: tuple, tile, budget: int | None) -> int:
    """The first-frame encode's peak VRAM (`fast_memory`'s `encode`; `tile`, `budget` as its)."""
    lat_f, lat_h, lat_w = lat_shape
    frames = (lat_f - 1) * 4 + 1
    fixed = fixed_tile(tile)
    # 'auto' tiles the encode to what is free when it runs (no model loaded yet): the tile it picks from
    # `budget`, or with none known its smallest tile
    enc_tile = (
        fixed if tile != "auto" else "auto" if budget is not None else (DECODE_MIN_TILE, DECODE_MIN_TILE)
    )
    return encode_vram(frames, lat_h, lat_w, encode_tile(frames, lat_h, lat_w, enc_tile, budget))


def decode_memory(
    lat_shape: tuple, chunk: int, tile=None, vae_dtype: str = "fp32", budget: int | None = None
) -> int:
    """Peak VRAM of a decode device of its own (`--decode_device` of play and fast): the first-frame encode, then the VAE's
    weights and a chunk's decode in the decoder's dtype (`vae_dtype`); `tile`, `budget` as `fast_memory`'s."""
    _, lat_h, lat_w = lat_shape
    decoding = VAE_BASE + decode_vram(
        chunk, lat_h, lat_w, fixed_tile(tile), chunked=True, vae_dtype=vae_dtype
    )
    return max(decoding, first_frame_encode(lat_shape, tile, budget))


def decode_fit_issue(lat_shape: tuple, chunk: int, tile, vae_dtype: str, free_vram: int | None) -> str | None:
    """None when `decode_memory` fits `free_vram` (None: unknown), else one message with the figure and what
    would fit."""
    need = decode_memory(lat_shape, chunk, tile, vae_dtype, free_vram)
    if free_vram is None or need <= free_vram:
        return None
    gib = 1 << 30
    hint = "; a smaller --size"
    if vae_dtype == "fp32" and decode_memory(lat_shape, chunk, tile, FIT_VAE_DTYPE, free_vram) <= free_vram:
        hint = f"; would fit with --vae_dtype {FIT_VAE_DTYPE}"
    return f"predicted peak {need / gib:.1f} GiB (the VAE and a chunk's decode, or the first-frame encode) is more than the {free_vram / gib:.1f} GiB free{hint}"


def fast_fit_issue(
    files: FastFiles | ChunkedModel,
    lat_shape: tuple,
    config: FastConfig,
    quantize: bool | None,
    swap: int,
    free_vram: int | None,
    tile=None,
    free_ram: int | None = None,
    vae_dtype: str = "fp32",
    ranks: int = 1,
    decode: bool = True,
    encode: bool = True,
    overlap: bool = False,
) -> str | None:
    """None when the run fits `free_vram` and `free_ram` (None: unknown, e.g. the CPU); else one message
    with the predicted peak and the settings that would fit (the fast decoder, a window with a 3-frame
    sink, fp8 K/V, block swap); `vae_dtype`, `ranks`, `decode`, `encode` and `overlap` as `fast_memory`'s."""
    gib = 1 << 30
    memory = functools.partial(
        fast_memory, ranks=ranks, decode=decode, budget=free_vram, encode=encode, overlap=overlap
    )
    files = chunked_model(files, quantize)

    def peak(config=config, swap=swap, vae_dtype=vae_dtype):
        return memory(files, lat_shape, config, quantize, swap, tile, vae_dtype).peak

    need = memory(files, lat_shape, config, quantize, swap, tile, vae_dtype)
    frames = (lat_shape[0] - 1) * 4 + 1
    if free_ram is not None and need.ram > free_ram:
        return (
            f"predicted host RAM {need.ram / gib:.1f} GiB (the first-frame encode's input video of {frames} "
            f"frames) is more than the {free_ram / gib:.1f} GiB available; fewer frames or a smaller --size"
        )
    if free_vram is None or need.peak <= free_vram:
        return None

    # swapped blocks take no kept camera injections (`check_camera_cache`): a swap is suggested with them off
    unkept = replace(config, camera_cache=False)
    swap_prefix = "--camera_cache off " if config.camera_cache is True else ""

    def alternatives(vae_dtype: str) -> list:
        options = []
        if swap_prefix and peak(unkept, vae_dtype=vae_dtype) <= free_vram:
            options.append("--camera_cache off")
        for window in (21, 15, 12, 9, 6):
            if window >= lat_shape[0] or (config.local_attn_size != -1 and window >= config.local_attn_size):
                continue
            trial = replace(config, local_attn_size=window, sink_size=min(3, window - config.chunk_frames))
            if peak(trial, vae_dtype=vae_dtype) <= free_vram:
                options.append(f"--local_attn_size {window} --sink_size {trial.sink_size}")
                break
        if config.kv_dtype is None:
            if peak(replace(config, kv_dtype=torch.float8_e4m3fn), vae_dtype=vae_dtype) <= free_vram:
                options.append("--kv_dtype fp8")
        layers = files.config.num_layers
        unkept_fits = "--camera_cache off" in options  # then no swap is needed
        if not unkept_fits and swap < layers and peak(unkept, swap=layers, vae_dtype=vae_dtype) <= free_vram:
            fitting = next(
                n for n in range(swap, layers + 1) if peak(unkept, swap=n, vae_dtype=vae_dtype) <= free_vram
            )
            options.append(f"{swap_prefix}--swap_blocks {fitting}")
        return options

    options = alternatives(vae_dtype)
    if decode and vae_dtype == "fp32":  # the fast decoder: a small model peaks at a chunk's decode
        if peak(vae_dtype=FIT_VAE_DTYPE) <= free_vram:
            options.insert(0, f"--vae_dtype {FIT_VAE_DTYPE}")
        elif not options:  # together with another setting
            options = [f"--vae_dtype {FIT_VAE_DTYPE} {o}" for o in alternatives(FIT_VAE_DTYPE)]
    hint = f"; would fit with {' or '.join(options)}" if options else "; fewer frames or a smaller --size"
    return (
        f"predicted peak {need.peak / gib:.1f} GiB (model {need.model / gib:.1f}, {caches_label(config)} "
        f"{need.caches / gib:.1f}, chunk work (forward {'and' if need.overlap else 'or'} decode) "
        f"{need.work / gib:.1f}, condition {need.condition / gib:.1f}"
        + (f"; first-frame encode of {frames} frames {need.encode / gib:.1f}" if need.encode else "")
        + f") is more than the {free_vram / gib:.1f} GiB free{hint}"
    )


def vae_where(apart: bool, overlap: bool) -> dict:
    """`fast_memory`'s figure of the DiT's device (`decode`, `encode`, `overlap`): with the VAE there (the
    first-frame encode and each chunk's decode, side by side with the next chunk's forward under `overlap`) or,
    with the decode device `apart`, without it."""
    return {"decode": not apart, "encode": not apart, "overlap": overlap and not apart}


def check_devices(
    files: FastFiles | ChunkedModel,
    lat_shape: tuple,
    config: FastConfig,
    quantize: bool | None,
    swap: int,
    tile,
    vae_dtype: str,
    device: torch.device,
    decode_device: torch.device | None,
    free: Callable,
    overlap: bool | None = None,
    ranks: int = 1,
) -> tuple[bool, FastConfig]:
    """The memory check of a chunked run that decodes each chunk (`play`, `fast`), before anything loads: the
    DiT's `device`, with the VAE where `decode_device` is the same one (`vae_where`), and a `decode_device` of
    its own with the VAE (`decode_fit_issue`), None where this process holds no VAE (a sequence-parallel
    follower); ValueError naming the device that would not fit. `free(device)`:
    (free VRAM, available host RAM) as `planner.free_memory`. `overlap`: each chunk decodes beside the next
    chunk's forward (a `DecodeWorker`); None: on with the decode device apart, on one GPU where the plan fits
    both side by side (else one after the other), off on the CPU. `config.camera_cache` 'auto': on where the plan
    fits it too (the overlap first), never with blocks swapped in from the host; on the CPU (no plan) with none
    swapped. Returns (`overlap` as decided, `config` with its camera cache decided)."""
    apart = decode_device is None or not same_device(device, decode_device)
    auto = overlap is None and not apart and device.type == "cuda"
    overlap = apart if overlap is None else overlap
    cameras = camera_choices(config, swap)
    camera = cameras[0]
    if device.type == "cuda":
        vram, ram = free(device)

        def fit_issue(overlap: bool, camera: bool) -> str | None:
            return fast_fit_issue(
                files,
                lat_shape,
                replace(config, camera_cache=camera),
                quantize,
                swap,
                vram,
                tile,
                free_ram=None if ram is None else ram + PROCESS_RAM,  # this process's share is counted
                vae_dtype=vae_dtype,
                ranks=ranks,
                **vae_where(apart, overlap),
            )

        # the overlap (asked, or 'auto' on) with each camera cache setting, then 'auto' overlap off (one after the
        # other): the first that fits
        tries = [(overlap or auto, c) for c in cameras] + ([(False, c) for c in cameras] if auto else [])
        for overlap, camera in tries:
            issue = fit_issue(overlap, camera)
            if issue is None:
                break
        if issue is not None:
            raise ValueError(f"memory on {device} (the DiT): {issue}" if apart else f"memory: {issue}")
    if apart and decode_device is not None and decode_device.type == "cuda":
        vram, _ = free(decode_device)
        issue = decode_fit_issue(lat_shape, config.chunk_frames, tile, vae_dtype, vram)
        if issue is not None:
            raise ValueError(f"memory on {decode_device} (the decode device, where the VAE runs): {issue}")
    return overlap, replace(config, camera_cache=camera)


def compile_warm_chunks(config: FastConfig, chunks: int) -> int:
    """Chunks up to the first that rolls the attention window, where compiled blocks (`config.compile`) trace (in
    live play also the growing chunks', at the second chunk), at most `chunks`; 0 without compile or a window. A
    compiled decoder must not run beside the tracing DiT (nor trace beside the compiled one), so a decode worker
    takes these chunks one at a time."""
    return min(config.roll_chunks, chunks) if config.compile else 0
