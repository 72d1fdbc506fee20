"""The chunked models (v1 Fast, v2 14B and 1.3B causal-fast): files -> checks -> settings -> memory check ->
load -> the chunk loop.

The CLI's `fast` and `plan --model <chunked>` and the ComfyUI Fast sampler node go through here (with
`fast_run`'s pieces: the camera per chunk, the model's residency, the loop); each front end says the errors
in its own words.
"""

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable
from pathlib import Path

from ..loaders import text_encode
from ..loaders.fast_checkpoint import FastFiles, resolve_fast_dir
from ..loaders.latent_file import save_comfy_latent
from ..loaders.text_encoder import read_encoder_config
from ..loaders.vae import check_vae, load_vae
from ..wan.block_swap import resolve_swap_blocks
from ..wan.config import CHUNKED_KINDS
from ..wan.fast import FastConfig, FastSession, fast_latent_frames
from ..wan.parallel import SequenceParallel
from ..wan.vae import decoder_levers
from . import distributed, fast_run
from .request import check_text_dim


def check_files(ckpt_dir, model: str = "auto", assets_dir=None) -> FastFiles:
    """The model folder (its kind detected or named), the text encoder against the DiT, and the VAE, from
    their headers before anything loads."""
    assets = assets_dir and Path(assets_dir).expanduser().resolve()
    files = resolve_fast_dir(Path(ckpt_dir).expanduser().resolve(), model, assets)
    check_text_dim(
        read_encoder_config(files.text_encoder)["dim"], files.config, files.text_encoder, files.model
    )
    check_vae(files.vae)
    return files


def settings(
    kind,
    num_layers: int,
    shift,
    seed: int,
    local_attn_size,
    sink_size,
    kv_dtype: str,
    swap_blocks,
    frame_num: int | None,
    compile: bool = False,
    attention: str = "sdpa",
    camera_cache: bool | str = False,
    fp8_accum: str = "exact",
) -> tuple[FastConfig, int]:
    """(checked FastConfig of the model kind, blocks swapped); the frame count (None: the default) checked
    against the kind's chunk and RoPE table; a camera cache asked for (True) with blocks swapped refused."""
    config = fast_run.fast_config(
        shift, seed, local_attn_size, sink_size, kv_dtype, kind, compile, attention, camera_cache, fp8_accum
    )
    swap = resolve_swap_blocks(swap_blocks, num_layers)
    fast_run.check_camera_cache(config, swap)
    fast_latent_frames(fast_run.DEFAULT_FRAMES if frame_num is None else frame_num, kind.chunk_frames)
    return config, swap


def fit_issue(
    model,
    lat_shape: tuple,
    config: FastConfig,
    quantize: bool | None,
    swap: int,
    free: tuple,
    tile=None,
    decode: bool = True,
    names: dict | None = None,
    vae_dtype: str = "fp32",
    ranks: int = 1,
) -> str | None:
    """`fast_run.fast_fit_issue` against `free` ((VRAM, RAM) bytes, None where unknown); `names`: the
    planner's `--flag`s -> the front end's words (a flag not named keeps its bare name)."""
    issue = fast_run.fast_fit_issue(
        model,
        lat_shape,
        config,
        quantize,
        swap,
        free[0],
        tile,
        free_ram=free[1],
        decode=decode,
        vae_dtype=vae_dtype,
        ranks=ranks,
    )
    if issue is None or names is None:
        return issue
    return re.sub(r"--(\w+)", lambda m: names.get(m[1], m[1]), issue)


@dataclasses.dataclass
class Chunks:
    """What a chunked run makes and where: `frames` video frames at `size` from `image` (the first frame),
    with `config`, the next camera per chunk from `cameras`, on `device`, phases timed by `hooks`, each chunk
    handed to on_chunk(latent, video or None, ChunkTiming). The VAE (the first-frame encode, each chunk's
    decode) runs on `decode_device` (None: `device`); `overlap`: each chunk decodes in a decode worker while
    the next one is denoised (`fast_run.run_chunks`), on_chunk then called in the worker's thread."""

    image: object
    size: tuple
    frames: int
    config: FastConfig
    cameras: object
    device: object
    hooks: object
    on_chunk: Callable
    decode_device: object = None
    overlap: bool = False

    @property
    def vae_device(self):
        return self.device if self.decode_device is None else self.decode_device


def run(load_model: Callable, encode: Callable, context, job: Chunks, decoding=None, ranks: int = 1):
    """The first-frame condition (`encode`: the VAE's), the model (`load_model()`), then `job`'s chunks.
    `decoding`: a context manager giving the chunk decoder (None: chunks are not decoded here). `ranks` > 1:
    sequence parallel in a process group; `encode` None on the ranks other than 0, which receive the
    condition and run their share of every forward. Returns (the whole latent, or None when no chunk was
    made; the chunks made)."""
    config, device, frames, size = job.config, job.device, job.frames, job.size
    phase = job.hooks.in_phase
    y = None
    if encode is not None:
        with phase("vae_encode"):
            y = fast_run.condition(job.image, encode, frames, size, job.vae_device).to(device)
    if ranks > 1:
        (y,) = distributed.broadcast_tensors(None if y is None else [y], device)
    with phase("load_model"):
        dit = load_model()
    if ranks > 1:
        dit.sequence_parallel = SequenceParallel()
    lat_shape = (fast_latent_frames(frames, config.chunk_frames), *size[:2])
    session = FastSession(dit, context.to(device), y, lat_shape, config, device, job.hooks)
    del y
    try:
        with phase("chunks"), decoding or contextlib.nullcontext() as decoder:
            decode_on = job.vae_device if job.overlap else None
            made = fast_run.run_chunks(session, job.cameras, decoder, job.on_chunk, decode_on)
        return (session.latent() if made else None), made
    finally:
        session.close()


def run_files(
    files: FastFiles,
    prompt: str,
    job: Chunks,
    *,
    t5_mode: str,
    t5_device: str,
    quantize: bool | None,
    swap: int,
    tile,
    save_latent=None,
    overwrite: bool = False,
    decode_dtype=None,
    ranks: int = 1,
):
    """A run from the model's files (the CLI's): the prompt's embeddings, the VAE, then `run` with the model
    streamed in (quantized if asked, `swap` blocks in host RAM) and each chunk decoded with `tile` (the
    decoder in `decode_dtype`, None: the exact one); the latent also saved for ComfyUI's Load Latent node
    (`save_latent`); the VAE on `job.vae_device`. Under sequence parallel (`ranks` > 1) rank 0 alone encodes
    the text and the first frame (the others receive them), decodes and saves. Returns `run`'s (latent or None,
    chunks made)."""
    lead, device = distributed.rank() == 0, job.device
    with job.hooks.in_phase("text_encode"):
        context = None
        if lead:
            context = text_encode.encode_prompts(
                files.text_encoder, [prompt], tokenizer_path=files.tokenizer, mode=t5_mode, device=t5_device
            )
        if ranks > 1:
            context = distributed.broadcast_tensors(context, device)
        (context,) = context
    vae = None
    if lead:
        with job.hooks.in_phase("load_vae"):
            vae = load_vae(files.vae, job.vae_device)
    model = fast_run.FastModel(files, device, quantize=quantize or None, swap_blocks=swap)
    levers = decoder_levers(decode_dtype, job.config.compile)  # --compile compiles the fast decoder too
    try:
        latent, made = run(
            model,
            functools.partial(vae.encode, tile=tile) if lead else None,
            context,
            job if lead else dataclasses.replace(job, on_chunk=lambda *_: None),
            decoding=vae.chunk_decoder(tile, dtype=decode_dtype, **levers) if lead else None,
            ranks=ranks,
        )
    finally:
        model.close()
    if made and save_latent and lead:
        save_comfy_latent(vae.to_comfy_latent(latent), save_latent, overwrite)
    return latent, made


def settings_issue(frame_num=None, local_attn_size=None, sink_size=None) -> str | None:
    """For a front end that does not know the model kind yet (a node's check when the prompt is queued): None
    when some chunked kind takes these settings (None: not given; the run checks them for its model's kind),
    else the first kind's (v1 Fast's) error."""
    first = None
    for kind in CHUNKED_KINDS.values():
        try:
            if frame_num is not None:
                fast_latent_frames(frame_num, kind.chunk_frames)
            if local_attn_size is not None and sink_size is not None:
                fast_run.fast_config(None, 0, local_attn_size, sink_size, "bf16", kind)
            return None
        except ValueError as e:
            first = first or str(e)
    return first
