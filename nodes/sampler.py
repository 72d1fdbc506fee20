"""Sampler node: image + text + camera -> video latent, one expert on the device at a time."""

import logging

import torch

from ..session import planner as memplan
from ..session.generate import memory_check
from ..session.request import RequestError, plan_request
from ..wan import i2v, pipeline
from ..wan.config import SampleConfig
from ..wan.schedulers import SCHEDULERS
from ..wan.speed import SpeedStats
from . import memory
from .camera import CAMERA
from .models import CATEGORY, EXPERTS
from .speed import SPEED, check_base_cam_speed
from .text import TEXT, sampler_text
from .vae import VAE, sampler_vae

DEFAULTS = SampleConfig()
SIZING = ("max_area", "explicit")
# RequestError parameters -> this node's widget names.
WIDGETS = {
    "sample_steps": "steps",
    "sample_shift": "shift",
    "size": "width/height/frame_num",
    "guide_scale": "guide_scale_low/high",
    "action_string": "camera",
    "attention": "speed",
}
log = logging.getLogger("LingBot-World")
# Planner settings -> where a ComfyUI user changes them.
PLAN_NAMES = {
    "frame_num": "frame_num",
    "size": "max_area",
    "swap_blocks": "swap_blocks",
    "vae_tile": "VAE Decode tiling",
    "t5_cpu": "text encoder on CPU",
    "lean_activations": "speed lean_activations",
}


def image_to_input(image: torch.Tensor) -> torch.Tensor:
    """ComfyUI IMAGE [B, H, W, C] in 0..1 -> the first image as [3, H, W] in [-1, 1], upstream's
    to_tensor().sub_(0.5).div_(0.5) on the same float values."""
    if image.dim() != 4 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image: expected an IMAGE [B, H, W, C], got shape {list(image.shape)}")
    if min(image.shape[1:3]) < i2v.MIN_IMAGE_SIDE:
        raise ValueError(
            f"image: must be at least {i2v.MIN_IMAGE_SIDE} pixels a side, got {list(image.shape[1:3])}"
        )
    first = image[0, :, :, :3].float().cpu()
    if first.shape[-1] == 1:
        first = first.expand(-1, -1, 3)
    return first.permute(2, 0, 1).contiguous().sub_(0.5).div_(0.5)


def frame_inputs() -> dict:
    """The first-frame and size widgets both samplers share, in their order on the node."""
    return {
        "vae": (
            f"{VAE},VAE",
            {
                "tooltip": "Encodes the first frame: LingBot VAE Loader, or core Load VAE with wan_2.1_vae.",
            },
        ),
        "image": ("IMAGE", {"tooltip": "First frame of the video; the first image of a batch is used."}),
        "sizing": (
            list(SIZING),
            {
                "default": "max_area",
                "tooltip": "max_area: upstream's sizing, the image's aspect within a pixel budget, sides "
                "multiples of 16 (a 480x832 image at 480*832 gives 464x832, as upstream). explicit: "
                "width x height below.",
            },
        ),
        "max_area": (
            "STRING",
            {
                "default": "480*832",
                "tooltip": "Pixel budget h*w for max_area sizing, e.g. 480*832 or 720*1280.",
            },
        ),
        "width": (
            "INT",
            {
                "default": 832,
                "min": 16,
                "max": 4096,
                "step": 16,
                "tooltip": "explicit sizing: output width, a multiple of 16.",
            },
        ),
        "height": (
            "INT",
            {
                "default": 480,
                "min": 16,
                "max": 4096,
                "step": 16,
                "tooltip": "explicit sizing: output height, a multiple of 16.",
            },
        ),
    }


class LingBotSampler:
    DESCRIPTION = (
        "LingBot-World image-to-video sampling: upstream's dual-expert flow-matching loop with CFG. The "
        "high-noise expert runs the first steps, then it is dropped and the low-noise expert streamed in."
    )
    CATEGORY = CATEGORY
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Video latent [1, 16, (frames-1)/4+1, H/8, W/8] (Wan2.1 VAE space).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "experts": (EXPERTS, {"tooltip": "From LingBot Experts Loader."}),
                **frame_inputs(),
                "frame_num": (
                    "INT",
                    {
                        "default": DEFAULTS.frame_num,
                        "min": 1,
                        "max": 1601,
                        "step": 4,
                        "tooltip": "Frames to generate, 4n+1 (81 = 5 s at 16 fps). A pose file with fewer "
                        "poses caps it; an action string sets it (wire the camera node's frame_num).",
                    },
                ),
                "steps": (
                    "INT",
                    {
                        "default": DEFAULTS.sample_steps,
                        "min": 1,
                        "max": 1000,
                        "tooltip": "Sampling steps (upstream: 70).",
                    },
                ),
                "shift": (
                    "FLOAT",
                    {
                        "default": DEFAULTS.sample_shift,
                        "min": 0.0,
                        "max": 100.0,
                        "step": 0.1,
                        "tooltip": "Flow-matching timestep shift (upstream: 10).",
                    },
                ),
                "boundary": (
                    "FLOAT",
                    {
                        "default": DEFAULTS.boundary,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.001,
                        "tooltip": "Timesteps t >= boundary*1000 use the high-noise expert (upstream: 0.947).",
                    },
                ),
                "guide_scale_low": (
                    "FLOAT",
                    {
                        "default": DEFAULTS.guide_scale[0],
                        "min": 0.0,
                        "max": 50.0,
                        "step": 0.1,
                        "tooltip": "CFG scale of the low-noise expert's steps (upstream: 5).",
                    },
                ),
                "guide_scale_high": (
                    "FLOAT",
                    {
                        "default": DEFAULTS.guide_scale[1],
                        "min": 0.0,
                        "max": 50.0,
                        "step": 0.1,
                        "tooltip": "CFG scale of the high-noise expert's steps (upstream: 5).",
                    },
                ),
                "seed": (
                    "INT",
                    {
                        "default": DEFAULTS.seed,
                        "min": 0,
                        "max": 0xFFFFFFFFFFFFFFFF,
                        "control_after_generate": True,
                        "tooltip": "Noise seed. Noise is drawn on the sampling device, so GPU and CPU differ.",
                    },
                ),
                "solver": (
                    list(SCHEDULERS),
                    {
                        "default": DEFAULTS.solver,
                        "tooltip": "unipc: upstream's multistep solver. euler: plain flow-matching Euler.",
                    },
                ),
            },
            "optional": {
                "camera": (
                    CAMERA,
                    {"tooltip": "From LingBot Camera. Without it the experts run with no camera input."},
                ),
                "text": (TEXT, {"tooltip": "From LingBot Text Encode (or use positive + negative instead)."}),
                "positive": (
                    "CONDITIONING",
                    {
                        "tooltip": "Instead of text: core CLIP Text Encode of the prompt with a wan CLIP (Load CLIP, type wan).",
                    },
                ),
                "negative": (
                    "CONDITIONING",
                    {
                        "tooltip": "With positive: CLIP Text Encode of the negative prompt (upstream's default is in the README).",
                    },
                ),
                "speed": (
                    SPEED,
                    {"tooltip": "From LingBot Speed. Without it: upstream's exact computation."},
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, max_area=None, frame_num=None):
        """Checked when the prompt is queued, before anything runs (a linked value arrives as None)."""
        try:
            if isinstance(max_area, str):
                i2v.parse_max_area(max_area)
        except ValueError as e:
            return str(e)
        if frame_num is not None:
            return i2v.frame_num_issue(frame_num) or True
        return True

    def sample(
        self,
        experts,
        vae,
        image,
        sizing,
        max_area,
        width,
        height,
        frame_num,
        steps,
        shift,
        boundary,
        guide_scale_low,
        guide_scale_high,
        seed,
        solver,
        camera=None,
        text=None,
        positive=None,
        negative=None,
        speed=None,
    ):
        text, vae = sampler_text(text, positive, negative), sampler_vae(vae)
        img = image_to_input(image)
        settings = SampleConfig(
            sample_shift=shift,
            sample_steps=steps,
            boundary=boundary,
            guide_scale=(guide_scale_low, guide_scale_high),
            solver=solver,
            seed=seed,
        )
        sizing = (
            {"max_area": i2v.parse_max_area(max_area)}
            if sizing == "max_area"
            else {"width": width, "height": height}
        )
        device = memory.torch_device()
        fp8 = speed is not None and speed.fp8
        check_base_cam_speed(speed, device)
        check = memory_check(
            experts.nbytes,
            experts.loras,
            device.type,
            (memory.device_budget(device), None),
            PLAN_NAMES,
            swap_blocks=getattr(experts, "swap_blocks", 0),
            t5_device="cpu",
            t5_bytes=0,
        )
        try:
            plan = plan_request(
                img.shape[1:],
                experts.config,
                settings,
                camera=camera,
                frame_num=frame_num,
                loras=experts.loras,
                allow_unmatched_lora_keys=experts.allow_unmatched_lora_keys,
                speed=speed,
                memory=check,
                **sizing,
                swap_blocks=experts.swap_blocks,
            )
            inputs = plan.inputs(img, text.context, text.context_null, device)
        except RequestError as e:
            raise ValueError(f"{WIDGETS.get(e.param, e.param)}: {e.detail}") from None
        size, frame_num = plan.size, plan.frame_num
        log.info("LingBot-World %s", plan.memory.table())
        hooks, phases = memory.sampling_hooks(steps)
        stats = SpeedStats()
        try:
            latent = pipeline.sample(
                vae=vae,
                experts=experts.provider(device, plan.memory.working_vram, plan.loras, fp8),
                release_experts=experts.release,
                hooks=hooks,
                stats=stats,
                **inputs,
            )
        except torch.OutOfMemoryError:
            experts.close()
            error = memplan.oom_error(hooks.current, plan.memory, PLAN_NAMES)
        except BaseException as e:
            experts.close()  # errors and interrupts also drop what keep_in_ram_gb parked
            log.info("LingBot-World sampling stopped (%s); experts released", type(e).__name__)
            raise
        else:
            error = None
        finally:
            del inputs
            memory.after_release()
        if error is not None:  # raised outside the handler, so the failed step's tensors are freed first
            memory.after_release()
            raise RuntimeError(f"LingBot-World: {error.detail}")
        log.info(
            "LingBot-World sampling, %d frames at %dx%d:\n%s\n%s",
            frame_num,
            size[3],
            size[2],
            phases.table(),
            stats.summary(),
        )
        samples = vae.to_comfy_latent(latent.cpu()).to(memory.intermediate_device())
        return ({"samples": samples},)
