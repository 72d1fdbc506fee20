"""Base-cam generation (the two A14B experts): checkpoint checks -> memory check -> plan -> load -> run -> outputs.

The CLI's `generate` and `plan` and the ComfyUI sampler node go through here; the front ends turn their own
inputs (flags, widgets) into these arguments and say the errors in their own words (`RequestError.param`).
"""

import contextlib
import functools
from pathlib import Path
from types import SimpleNamespace

from ..loaders import checkpoints, stream, text_encode, video
from ..loaders.experts import ExpertSwitcher
from ..loaders.latent_file import save_comfy_latent
from ..loaders.text_encoder import read_encoder_config
from ..loaders.vae import check_vae, load_vae
from ..wan import pipeline
from ..wan.config import A14B
from . import distributed
from . import planner as memplan
from .fast_run import device_bytes, fp8_bytes, nf4_bytes
from .request import Plan, check_lora_merge, check_text_dim


def check_files(ckpt_dir, quantize: bool, loras, lora_merge: bool, quantize_setting: str = "--quantize"):
    """(CheckpointFiles, the text encoder's width): the folder's files, the text encoder against the experts,
    the VAE, and LoRA merging's needs, all from headers before anything loads."""
    files = checkpoints.resolve_checkpoint_dir(Path(ckpt_dir).expanduser().resolve())
    text_dim = read_encoder_config(files.text_encoder)["dim"]
    experts = " and ".join(str(files.experts[e]) for e in ("high", "low"))
    check_text_dim(text_dim, files.config, files.text_encoder, experts)
    check_vae(files.vae)
    if lora_merge:
        check_lora_merge(files.sources, quantize, loras, quantize_setting)
    return files, text_dim


def machine_memory(device) -> tuple:
    """(free VRAM, available RAM) bytes of this machine for a run on `device`; (None, None) off CUDA. The RAM
    counts this process's own share, which the plan's figures already hold."""
    if device.type != "cuda":
        return None, None
    vram, ram = memplan.free_memory(device)
    if ram is not None:
        ram += memplan.PROCESS_RAM
    return vram, ram


def memory_check(
    files,
    loras,
    device_type: str,
    budget: tuple = (None, None),
    names: dict | None = None,
    quantize=None,
    **settings,
) -> memplan.MemoryCheck:
    """What `plan_request` checks memory with. `files`: the CheckpointFiles (or None: two NF4 A14B experts
    sized from their architecture and upstream's umT5, for planning before downloading), or a dict of the
    experts' stored bytes (the text encoder then is not on the device: `settings` say so). `budget`: (free
    VRAM, available RAM) bytes, None where unknown (unchecked). `quantize`: the loader's ('fp8': the experts
    sized as fp8 linears). `settings`: MemoryRequest's (swap_blocks, vae_tile, t5_mode, t5_device,
    t5_overlap, t5_bytes, vae_dtype)."""
    if files is None:
        each = fp8_bytes(A14B) if quantize == "fp8" else nf4_bytes(A14B)
        experts, settings = {"high": each, "low": each}, {"t5_bytes": memplan.T5_DEFAULT_BYTES, **settings}
    elif isinstance(files, dict):
        experts = dict(files)
    else:
        experts = {
            e: device_bytes(s, quantize) if quantize == "fp8" else s.nbytes for e, s in files.sources.items()
        }
        settings = {"t5_bytes": files.text_encoder.stat().st_size, **settings}
    request = memplan.MemoryRequest(expert_bytes=experts, lora_bytes=memplan.lora_bytes(loras), **settings)
    vram, ram = budget
    return memplan.MemoryCheck(
        request, "cuda" if vram is not None else device_type, vram, free_ram=ram, names=names
    )


def run_tiles(tile, plan: Plan) -> tuple:
    """(encode tile, decode tile) a run uses for the `vae_tile` setting: for 'auto' with a plan made against
    a budget, the tiles that plan checked (not a second pick from the VRAM free at that moment)."""
    if tile == "auto" and plan.memory is not None and plan.memory.budget is not None:
        return plan.memory.encode_tile, plan.memory.vae_tile
    return tile, tile


def denoise(
    files,
    plan: Plan,
    image,
    device,
    prompts: list,
    *,
    t5_mode: str,
    t5_device: str,
    quantize: bool,
    lora_merge: bool,
    encode_tile,
    hooks: pipeline.Hooks,
    stats=None,
    progress=None,
):
    """Text -> camera -> VAE -> the two experts' sampling loop. Returns (latent, VAE or None off rank 0, the
    background text encode or None). `prompts`: [prompt] or [prompt, negative] (`plan.needs_negative`);
    `stats`: a SpeedStats the loop fills; `progress(total)`: a bar with update() and close(), or None."""
    lead = distributed.rank() == 0  # the rank that encodes text, runs the VAE
    phase = hooks.in_phase
    encode = functools.partial(
        text_encode.encode_prompts,
        files.text_encoder,
        prompts,
        tokenizer_path=files.tokenizer,
        mode=t5_mode,
        device=t5_device,
    )
    with contextlib.ExitStack() as stack:
        text = background = None
        if lead and plan.memory is not None and plan.memory.text_overlap:
            # the child encodes while this process encodes the first frame and loads the first expert
            background = stack.enter_context(text_encode.BackgroundEncode(*encode.args, **encode.keywords))
            context = context_null = None

            def text():
                return (*background.result(), None)[:2]
        else:
            with phase("text_encode"):
                context = None
                if lead:  # while the child encodes, this process imports what the experts' loader needs
                    context = encode(while_waiting=stream.preload_libraries)
                if plan.ulysses_size > 1:
                    context = distributed.broadcast_tensors(context, device)
                context, context_null = (*context, None)[:2]
        with phase("camera"):
            inputs = plan.inputs(image, context, context_null, device, text=text)
        del context, context_null
        with phase("load_vae"):
            vae = load_vae(files.vae, device) if lead else None
        switcher = ExpertSwitcher(
            files.experts,
            device,
            quantize=quantize or None,
            loras=plan.loras,
            swap_blocks=plan.swap_blocks,
            merge_loras=lora_merge,
        )
        bar = progress(plan.settings.sample_steps) if progress is not None else None
        if bar is not None:
            hooks.progress = lambda i, n, latent: bar.update(1)
        try:
            # the encode tile applies to the first-frame encode too (pipeline.sample only calls vae.encode)
            encoder = (
                SimpleNamespace(encode=functools.partial(vae.encode, tile=encode_tile)) if lead else None
            )
            latent = pipeline.sample(
                vae=encoder,
                experts=switcher,
                release_experts=switcher.close,
                hooks=hooks,
                stats=stats,
                **inputs,
            )
        finally:
            if bar is not None:
                bar.close()
            switcher.close()
        del inputs
    return latent, vae, background


def outputs(
    vae,
    latent,
    plan: Plan,
    decode_tile,
    output: Path,
    overwrite: bool,
    hooks,
    save_latent=None,
    decode_dtype=None,
) -> None:
    """The latent for ComfyUI's Load Latent node (`save_latent`), then the decode and the MP4."""
    if save_latent:
        save_comfy_latent(vae.to_comfy_latent(latent), save_latent, overwrite)
    hooks.check()
    with hooks.in_phase("vae_decode"):
        frames = vae.decode(latent, tile=decode_tile, dtype=decode_dtype)
    with hooks.in_phase("write_mp4"):
        video.write_mp4(
            pipeline.frames_to_uint8(frames), output, fps=plan.settings.sample_fps, overwrite=overwrite
        )
