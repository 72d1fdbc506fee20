"""LingBot-World-Fast and 2.0 causal-fast nodes: the one causal DiT's loader, and the chunk-by-chunk sampler."""

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import folder_paths
import torch

from ..loaders.fast_checkpoint import KINDS, MODEL_CHOICES, detect_kind, fast_model_dir
from ..loaders.formats import DIFFUSERS_SINGLE, NF4_PT, NF4_WEIGHTS, ExpertSource, detect_expert_format
from ..session import chunked, fast_run
from ..session import planner as memplan
from ..session.request import RequestError, check_text_dim, plan_size
from ..wan import i2v
from ..wan.config import CHUNKED_KINDS, ChunkedKind
from ..wan.fast import fast_frame_num, fast_latent_frames
from . import memory
from .camera import CAMERA
from .models import CATEGORY, MODELS_KIND, ExpertsHandle, _default, resolve_model
from .sampler import frame_inputs, image_to_input
from .speed import SPEED, SpeedOptions, check_chunked_speed
from .text import TEXT, conditioning_to_context
from .vae import sampler_vae

FAST = "LINGBOT_FAST"
NO_MODEL = "(none found: set ckpt_dir)"
SHARD = re.compile(r"(diffusion_pytorch_model|model)-\d+-of-\d+\.safetensors")
# Sampler settings that mean "the model kind's documented run" (shift, local_attn_size, sink_size).
KIND_SHIFT, KIND_WINDOW, KIND_SINK = 0.0, -2, -1
# The planner's CLI flags -> this pack's widgets (the others have the same names: local_attn_size, sink_size,
# kv_dtype, swap_blocks).
WIDGETS = {"size": "max_area (or width/height)"}
SIZE_WIDGETS = {"size": "width/height"}  # plan_size's RequestError parameters -> the widgets
log = logging.getLogger("LingBot-World")


def fast_choices() -> list[str]:
    """Model folders under ComfyUI's diffusion_models folders (diffusers or Hugging Face shards, a single
    file, NF4 folders), listed as the folder; config.json is optional (Fast and the v2 1.3B ship none)."""
    out = set()
    for rel in folder_paths.get_filename_list(MODELS_KIND):
        name, folder = os.path.basename(rel), os.path.dirname(rel)
        shard = SHARD.fullmatch(name) is not None
        if folder and (name in (NF4_WEIGHTS, NF4_PT, DIFFUSERS_SINGLE) or shard):
            out.add(folder)
    return sorted(out)


@dataclass
class FastHandle(ExpertsHandle):
    """What flows on a LINGBOT_FAST link: the checked model source and load settings, no weights; the
    loaded model is kept (and parked within keep_in_ram_gb) as ExpertsHandle keeps an expert."""

    source: ExpertSource | None = None
    kind: ChunkedKind = field(default_factory=lambda: CHUNKED_KINDS["fast"])

    def model(self, device, working_bytes: int, fp8: bool = False):
        """The loaded model on `device` (ComfyUI asked for its resident bytes + `working_bytes` first); `fp8`:
        with fp8 linears."""
        return self.provider(device, working_bytes, {}, fp8)("high")

    def planned(self) -> fast_run.ChunkedModel:
        """What the planner's `fast_memory` needs of the model: its architecture and bytes on the device."""
        return fast_run.ChunkedModel(self.config, self.nbytes["high"])


@contextlib.contextmanager
def as_widgets():
    """A ValueError of the session layer's settings checks, which names `--flag`s, with the bare widget names."""
    try:
        yield
    except ValueError as e:
        raise ValueError(re.sub(r"--(\w+)", r"\1", str(e))) from None


def fit_issue(model: FastHandle, lat_shape: tuple, config, free_vram: int | None) -> str | None:
    """The planner's fit check (`chunked.fit_issue`) against `free_vram`, in the node's words, for what this
    node runs: the chunks' forwards, not their decode (the VAE Decode node's, which tiles to fit: 'auto')."""
    free = (free_vram, None)
    return chunked.fit_issue(
        model.planned(), lat_shape, config, None, model.swap_blocks, free, "auto", False, WIDGETS
    )


class LingBotFastLoader:
    DESCRIPTION = (
        "Picks a chunk-causal model: LingBot-World-Fast (robbyant/lingbot-world-fast, ~69 GB of fp32 shards), "
        "LingBot-World 2.0 14B causal-fast (its transformers/ folder) or 2.0 1.3B causal-fast (its folder; "
        "text encoder and VAE from the 14B's files), or an NF4 folder `lingbot.py quantize` wrote. Checks it "
        "from its headers now and tells which it is; the Fast sampler streams it in, quantizing to NF4 on the "
        "way when asked."
    )
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (FAST,)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The Fast model's path and load settings; nothing is loaded until the sampler runs.",)

    @classmethod
    def INPUT_TYPES(cls):
        choices = fast_choices() or [NO_MODEL]
        return {
            "required": {
                "model": (
                    choices,
                    {
                        "default": _default(choices, "fast"),
                        "tooltip": "The model folder from models/diffusion_models, e.g. lingbot_world_fast "
                        "(huggingface-cli download robbyant/lingbot-world-fast), lingbot-world-v2-14b-causal-fast/"
                        "transformers, lingbot-world-v2-1.3b-causal-fast, or an NF4 folder.",
                    },
                ),
                "quantize_to_nf4": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Quantize a bf16/fp32 model to NF4 while streaming it in (~9.6 GB instead of "
                        "~37 GB in bf16). An NF4 folder is used as stored either way.",
                    },
                ),
                "keep_in_ram_gb": (
                    "FLOAT",
                    {
                        "default": 0.0,
                        "min": 0.0,
                        "max": 1024.0,
                        "step": 1.0,
                        "tooltip": "Host RAM allowed for keeping the loaded model between runs (NF4: ~10 GB). "
                        "0 = stream it from disk again on every run.",
                    },
                ),
            },
            "optional": {
                "ckpt_dir": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Optional: the model folder, the base-cam folder holding "
                        "lingbot_world_fast(_nf4)/ or the v2 14B folder; when set it replaces the list above.",
                    },
                ),
                "swap_blocks": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 40,
                        "step": 1,
                        "tooltip": "DiT blocks kept in pinned host RAM and streamed to the GPU one block ahead of "
                        "their turn: less VRAM, identical results, a little slower. 0 = all on the GPU.",
                    },
                ),
                "model_kind": (
                    list(MODEL_CHOICES),
                    {
                        "default": "auto",
                        "tooltip": "Which model it is: auto (from its files), fast (v1), v2-14b, v2-1.3b. It sets "
                        "the chunk (3 or 4 latent frames), the steps and the sampler's model defaults.",
                    },
                ),
            },
        }

    def load(self, model, quantize_to_nf4, keep_in_ram_gb, ckpt_dir="", swap_blocks=0, model_kind="auto"):
        if ckpt_dir.strip():
            path = fast_model_dir(Path(ckpt_dir.strip()).expanduser())
        else:
            if model == NO_MODEL:
                raise FileNotFoundError(
                    "no model folders found in the diffusion_models folders "
                    f"({', '.join(folder_paths.get_folder_paths(MODELS_KIND))}); put lingbot_world_fast/ there "
                    "or set ckpt_dir"
                )
            path = resolve_model(MODELS_KIND, model)
        source = detect_expert_format(path, require_config=False)
        kind = detect_kind(source, model_kind)
        config = source.dit_config
        if isinstance(swap_blocks, bool) or not isinstance(swap_blocks, int) or not 0 <= swap_blocks:
            raise ValueError(f"swap_blocks: expected an integer >= 0, got {swap_blocks!r}")
        if swap_blocks > config.num_layers:
            raise ValueError(f"swap_blocks: this model has {config.num_layers} blocks, got {swap_blocks}")
        quantize = True if quantize_to_nf4 else None
        nbytes = fast_run.device_bytes(source, quantize)
        handle = FastHandle(
            paths={"high": source, "low": source},
            config=config,
            nbytes={"high": nbytes, "low": nbytes},
            quantize=quantize,
            ram_budget=int(keep_in_ram_gb * memory.GIB),
            swap_blocks=swap_blocks,
            source=source,
            kind=kind,
        )
        log.info("LingBot Fast Loader: %s is %s", path, KINDS[kind.name].title)
        return (handle,)


class LingBotFastSampler:
    DESCRIPTION = (
        "LingBot-World-Fast / 2.0 sampling: the clip is made chunk by chunk (v1 Fast: 3 latent frames = 12 "
        "video frames; v2: 4 = 16), 4 steps a chunk and no CFG, each chunk attending to a cache of the ones "
        "before. local_attn_size and sink_size bound that cache (the model's documented run by default: v1 "
        "Fast unbounded, v2 18 / 6); kv_dtype fp8 halves it."
    )
    CATEGORY = CATEGORY
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Video latent [1, 16, T, H/8, W/8] (Wan2.1 VAE space), T whole chunks (3 or 4).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (FAST, {"tooltip": "From LingBot Fast Loader."}),
                **frame_inputs(),
                "length": (
                    "INT",
                    {
                        "default": 81,
                        "min": 9,
                        "max": 1601,
                        "step": 4,
                        "tooltip": "Video frames; rounded down to whole chunks (v1 Fast: 3 latent frames, 81 -> "
                        "81, 161 -> 153; v2: 4, 81 -> 77). A pose file with fewer poses caps it; an action string "
                        "sets it.",
                    },
                ),
                "seed": (
                    "INT",
                    {
                        "default": 42,
                        "min": 0,
                        "max": 0xFFFFFFFFFFFFFFFF,
                        "control_after_generate": True,
                        "tooltip": "Noise seed (upstream: 42). Noise is drawn on the sampling device.",
                    },
                ),
                "shift": (
                    "FLOAT",
                    {
                        "default": KIND_SHIFT,
                        "min": 0.0,
                        "max": 100.0,
                        "step": 0.1,
                        "tooltip": "Timestep shift; 0 = the model's (v1 Fast and v2 14B: 10, giving t = 999, 978, "
                        "947, 825 for v1; v2 1.3B: 5).",
                    },
                ),
                "local_attn_size": (
                    "INT",
                    {
                        "default": KIND_WINDOW,
                        "min": KIND_WINDOW,
                        "max": 1024,
                        "tooltip": "Latent frames the attention cache keeps, sink included; -1 = all; -2 = the "
                        "model's documented run (v1 Fast: all; v2: 18). A window bounds memory and per-chunk time "
                        "on long clips (e.g. 15 or 21).",
                    },
                ),
                "sink_size": (
                    "INT",
                    {
                        "default": KIND_SINK,
                        "min": KIND_SINK,
                        "max": 1024,
                        "tooltip": "Latent frames at the start the window never evicts (e.g. 3: v1's first chunk); "
                        "-1 = the model's (v1 Fast: 0; v2: 6).",
                    },
                ),
                "kv_dtype": (
                    list(fast_run.KV_DTYPES),
                    {
                        "default": "bf16",
                        "tooltip": "Attention cache dtype: bf16 as upstream, or fp8 (e4m3) at half the memory.",
                    },
                ),
            },
            "optional": {
                "camera": (
                    CAMERA,
                    {"tooltip": "From LingBot Camera / Camera Preset. Without it: no camera input."},
                ),
                "text": (TEXT, {"tooltip": "From LingBot Text Encode; only the prompt is used (no CFG)."}),
                "positive": (
                    "CONDITIONING",
                    {
                        "tooltip": "Instead of text: core CLIP Text Encode of the prompt with a wan CLIP.",
                    },
                ),
                "speed": (
                    SPEED,
                    {
                        "tooltip": "From LingBot Speed: its attention, compile (once the window is full), "
                        "fp8_linears, fp8_accumulation and camera_cache apply here (step cache and lean activations "
                        "are the base-cam sampler's). "
                        "Without it: the exact computation.",
                    },
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, max_area=None, length=None, local_attn_size=None, sink_size=None):
        """Checked when the prompt is queued (a linked value arrives as None)."""
        try:
            if isinstance(max_area, str):
                i2v.parse_max_area(max_area)
        except ValueError as e:
            return str(e)
        if local_attn_size in (None, KIND_WINDOW) or sink_size in (None, KIND_SINK):
            local_attn_size = sink_size = None  # the model's documented run, or not known yet
        # the model is not known here (a link): a setting some model kind takes waits for the run's check
        return chunked.settings_issue(length, local_attn_size, sink_size) or True

    def sample(
        self,
        model,
        vae,
        image,
        sizing,
        max_area,
        width,
        height,
        length,
        seed,
        shift,
        local_attn_size,
        sink_size,
        kv_dtype,
        camera=None,
        text=None,
        positive=None,
        speed=None,
    ):
        speed = speed or SpeedOptions()
        check_chunked_speed(speed, memory.torch_device(), "the Fast sampler")
        if (text is None) == (positive is None):
            raise ValueError(
                "text: connect LingBot Text Encode to 'text' or a CLIP Text Encode to 'positive' (one)"
            )
        context = text.context if text is not None else conditioning_to_context(positive, "positive")
        vae = sampler_vae(vae)
        img = image_to_input(image)
        with as_widgets():
            config, _ = chunked.settings(
                model.kind,
                model.config.num_layers,
                None if shift == KIND_SHIFT else shift,
                seed,
                None if local_attn_size == KIND_WINDOW else local_attn_size,
                None if sink_size == KIND_SINK else sink_size,
                kv_dtype,
                model.swap_blocks,
                length,
                compile=speed.compile,
                attention=speed.attention,
                camera_cache=speed.camera_cache,
                fp8_accum=speed.fp8_accum,
            )
        chunk = config.chunk_frames
        sizing = (
            {"max_area": i2v.parse_max_area(max_area)}
            if sizing == "max_area"
            else {"width": width, "height": height}
        )
        try:
            check_text_dim(context.shape[-1], model.config)
            size = plan_size(img.shape[1:], **sizing)
        except RequestError as e:
            raise ValueError(f"{SIZE_WIDGETS.get(e.param, e.param)}: {e.detail}") from None
        device = memory.torch_device()
        cam = None
        if camera is not None:
            cam, frames = fast_run.camera_tensor(
                camera, model.config.control_type, length, size, device, chunk
            )
        else:
            frames = fast_frame_num(length, chunk)
            config = replace(config, camera_cache=False)  # no camera: no injections to keep
        lat_f = fast_latent_frames(frames, chunk)
        chunks, lat_shape = lat_f // chunk, (lat_f, *size[:2])

        # what this node runs: the encode, then the chunks' forwards (the VAE Decode node decodes them)
        def planned(config):
            return fast_run.fast_memory(
                model.planned(), lat_shape, config, None, model.swap_blocks, "auto", decode=False
            )

        need = planned(config)
        free = None
        if device.type == "cuda":  # ComfyUI unloads its models first: the check sees what the run can have
            memory.make_room(need.peak, device)
            free = memplan.free_memory(device)[0]
            issue = fit_issue(model, lat_shape, config, free)  # a camera cache left to 'auto' counted as off
            if issue is not None:
                raise ValueError(f"memory: {issue}")
        # 'auto': on where it fits what is free after that room was made (no more of ComfyUI's models unloaded)
        config = fast_run.decide_camera_cache(
            config, model.swap_blocks, lambda on: fit_issue(model, lat_shape, on, free) is None
        )
        need = planned(config)
        hooks, phases = memory.sampling_hooks(chunks)
        timings, error = [], None
        try:
            latent, _ = chunked.run(
                # ComfyUI is asked for need.loop in all
                lambda: model.model(device, need.loop - need.model, speed.fp8),
                vae.encode,
                context,
                chunked.Chunks(
                    img,
                    size,
                    frames,
                    config,
                    fast_run.whole_path_cameras(cam, chunk),
                    device,
                    hooks,
                    lambda c, v, t: timings.append(t),
                ),
            )
        except torch.OutOfMemoryError:
            model.close()
            error = memplan.oom_error(hooks.current, None)
        except BaseException as e:
            model.close()  # errors and interrupts also drop what keep_in_ram_gb kept
            log.info("LingBot-World-Fast sampling stopped (%s); model released", type(e).__name__)
            raise
        finally:
            memory.after_release()
        if error is not None:  # raised outside the handler, so the failed step's tensors are freed first
            memory.after_release()
            raise RuntimeError(f"LingBot-World-Fast: {error.detail}")
        model.release()
        log.info(
            "%s, %d frames at %dx%d in %d chunks:\n%s\n%s",
            KINDS[model.kind.name].title,
            frames,
            size[3],
            size[2],
            chunks,
            phases.table(),
            "\n".join(t.line() for t in timings),
        )
        samples = vae.to_comfy_latent(latent.cpu()).to(memory.intermediate_device())
        return ({"samples": samples},)
