"""Speed options node: attention backend, compiled blocks, lean activations, the step cache, fp8 linears and their
accumulation, and the kept camera injections for the samplers."""

import comfy.ldm.modules.attention as comfy_attention

from ..wan import attention
from ..wan.fp8 import ACCUMULATIONS, fp8_problem
from ..wan.speed import SpeedOptions
from .models import CATEGORY

SPEED = "LINGBOT_SPEED"
COMFY = "comfy"
# ComfyUI's own kernel choice (--use-sage-attention, --use-flash-attention, xformers, ...), looked up on
# every call so the server's setting applies to our blocks as to core nodes.
attention.register_comfy(COMFY, lambda *args, **kwargs: comfy_attention.optimized_attention(*args, **kwargs))
DEFAULTS = SpeedOptions()
# widget -> SpeedOptions.lean_activations, camera_cache
AUTO_ON_OFF = {"auto": "auto", "on": True, "off": False}


def check_base_cam_speed(speed: SpeedOptions | None, device) -> None:
    """LingBot Speed wired into the base-cam sampler: `check_speed_input`, and camera_cache on refused (it keeps a
    chunk's camera injections; the base-cam sampler makes no chunks)."""
    if speed is not None and speed.camera_cache is True:
        raise ValueError(
            "speed camera_cache: on keeps a chunk's camera injections for the Fast and Play nodes; the base-cam "
            "sampler has no chunks; set it to auto or off"
        )
    check_speed_input(speed, device)


def check_speed_input(speed: SpeedOptions | None, device) -> None:
    """LingBot Speed's choices that cannot run on `device` (fp8_linears or fp8 attention without fp8 tensor
    cores): one clear error before any load."""
    if speed is None:
        return
    if speed.fp8:
        check_fp8_input(device)
    problem = attention.problem(speed.attention, device)
    if problem is not None:
        raise ValueError(f"speed attention: {problem}".replace("use --attention ", "pick "))


def check_chunked_speed(speed: SpeedOptions, device, node: str) -> None:
    """LingBot Speed wired into a chunked node (the Fast sampler, Play): attention, compile, fp8_linears,
    fp8_accumulation and camera_cache apply; the base-cam sampler's step cache and lean blocks are refused; a choice that cannot run on `device`
    is named before any work."""
    if speed.cache is not None or speed.lean_activations is True:
        raise ValueError(
            f"speed: {node} takes attention, compile, fp8_linears, fp8_accumulation and camera_cache from LingBot Speed; turn off "
            "step_cache and lean_activations there (they are the base-cam sampler's)"
        )
    check_speed_input(speed, device)  # an unknown backend or a missing package named before any work


def check_fp8_input(device) -> None:
    """LingBot Speed's fp8_linears on a device without fp8 tensor cores: one clear error before any load."""
    problem = fp8_problem(device)
    if problem is not None:
        raise ValueError(f"speed fp8_linears: {problem}".replace("leave fp8 off", "turn fp8_linears off"))


class LingBotSpeed:
    DESCRIPTION = (
        "Speed options for the LingBot-World sampler. Left at their defaults they change nothing (upstream's "
        "exact computation). The step cache trades quality for speed; a guide scale of 1 on the sampler "
        "already halves the work of each step."
    )
    CATEGORY = CATEGORY
    FUNCTION = "options"
    RETURN_TYPES = (SPEED,)
    RETURN_NAMES = ("speed",)
    OUTPUT_TOOLTIPS = ("Wire into the sampler's speed input.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "attention": (
                    [*attention.BUILT_IN, COMFY],
                    {
                        "default": DEFAULTS.attention,
                        "tooltip": "sdpa: PyTorch's kernels. sage: SageAttention (needs the sageattention package). "
                        "fp8: cuDNN's fp8 attention (a GPU with fp8 tensor cores, Hopper or newer, and the "
                        "nvidia-cudnn-frontend package; faster, not exact). "
                        "fa3: FlashAttention-3 (an H100-class GPU and the flash_attn_3 package). fa3_fp8: its fp8 "
                        "kernel, a scale per head (faster, not exact). "
                        "comfy: ComfyUI's optimized attention, as set by --use-sage-attention / --use-flash-attention.",
                    },
                ),
                "compile": (
                    "BOOLEAN",
                    {
                        "default": DEFAULTS.compile,
                        "tooltip": "torch.compile the transformer blocks (one graph for all 40; the first step is slower "
                        "while it compiles; the chunked models compile once their attention window is full (Play also its earlier chunks), "
                        "then replay each steady forward as one CUDA graph). Falls back to eager with one log line if Triton or a compiler is missing.",
                    },
                ),
                "step_cache": (
                    ["none", "easycache"],
                    {
                        "default": "none",
                        "tooltip": "EasyCache: reuse the transformer's output on steps where it changes little (per "
                        "expert, reset at the switch). Faster, at some cost in quality.",
                    },
                ),
                "cache_threshold": (
                    "FLOAT",
                    {
                        "default": DEFAULTS.cache_threshold,
                        "min": 0.0,
                        "max": 10.0,
                        "step": 0.005,
                        "tooltip": "EasyCache threshold: higher skips more steps. 0 never skips.",
                    },
                ),
                "cache_keep_first": (
                    "INT",
                    {
                        "default": DEFAULTS.cache_keep_first,
                        "min": 0,
                        "max": 1000,
                        "tooltip": "Steps always computed at the start of each expert's stretch.",
                    },
                ),
                "cache_keep_last": (
                    "INT",
                    {
                        "default": DEFAULTS.cache_keep_last,
                        "min": 0,
                        "max": 1000,
                        "tooltip": "Steps always computed at the end of each expert's stretch.",
                    },
                ),
            },
            # optional, so saved workflows and API prompts from before it keep loading (default auto)
            "optional": {
                "lean_activations": (
                    ["auto", "on", "off"],
                    {
                        "default": DEFAULTS.lean_activations,
                        "tooltip": "Run each transformer block in token chunks so only the full-length tensors stay in "
                        "VRAM (about 14 instead of 35 vectors per token; equal up to GEMM rounding). auto: on only when "
                        "the memory plan says the run would not fit otherwise, before any block swap. Not with compile.",
                    },
                ),
                "fp8_linears": (
                    "BOOLEAN",
                    {
                        "default": DEFAULTS.fp8,
                        "tooltip": "Run the transformer blocks' linear layers in fp8 (e4m3, a scale per weight row and per "
                        "token) on fp8 tensor cores: Ada, Hopper or Blackwell GPUs only. The model is loaded that way "
                        "(quantized while streaming in; an fp8 folder from `lingbot.py quantize --format fp8` as "
                        "stored; overrides quantize_to_nf4). Faster and smaller than bf16, not exact.",
                    },
                ),
                "camera_cache": (
                    ["auto", "on", "off"],
                    {
                        "default": DEFAULTS.camera_cache,
                        "tooltip": "Fast and Play: make each transformer block's camera injection once per chunk and "
                        "keep it for the chunk's 5 forwards (the same values, a fifth of the camera layers' work) at "
                        "the cost of its memory (1.0 GiB for the v2 1.3B at 480p, 4.6 GiB for the 14B). auto: the "
                        "Fast sampler turns it on where the memory check fits it; Play, which has no memory check "
                        "here, keeps it off. Not with swapped blocks.",
                    },
                ),
                "fp8_accumulation": (
                    list(ACCUMULATIONS),
                    {
                        "default": DEFAULTS.fp8_accum,
                        "tooltip": "With fp8_linears: exact keeps cuBLAS's fp32 promotion of the matmuls' partial "
                        "sums; fast accumulates in the tensor cores' own precision (faster: a v2 1.3B chunk's "
                        "matmuls 78 -> 66 ms on an H100; a little more rounding, most in the long feed-forward "
                        "sums). fast needs fp8_linears on.",
                    },
                ),
            },
        }

    def options(
        self,
        attention,
        compile,
        step_cache,
        cache_threshold,
        cache_keep_first,
        cache_keep_last,
        lean_activations="auto",
        fp8_linears=False,
        camera_cache="auto",
        fp8_accumulation="exact",
    ):
        for name, value in (("lean_activations", lean_activations), ("camera_cache", camera_cache)):
            if value not in AUTO_ON_OFF:
                raise ValueError(f"{name}: expected one of {list(AUTO_ON_OFF)}, got {value!r}")
        if fp8_accumulation not in ACCUMULATIONS:
            raise ValueError(
                f"fp8_accumulation: expected one of {list(ACCUMULATIONS)}, got {fp8_accumulation!r}"
            )
        if fp8_accumulation != "exact" and not fp8_linears:
            raise ValueError(
                f"fp8_accumulation: {fp8_accumulation} is the fp8 linears' accumulation; turn fp8_linears on, "
                "or set it to exact"
            )
        return (
            SpeedOptions(
                attention=attention,
                compile=compile,
                cache=None if step_cache == "none" else step_cache,
                cache_threshold=cache_threshold,
                cache_keep_first=cache_keep_first,
                cache_keep_last=cache_keep_last,
                lean_activations=AUTO_ON_OFF[lean_activations],
                fp8=fp8_linears,
                camera_cache=AUTO_ON_OFF[camera_cache],
                fp8_accum=fp8_accumulation,
            ),
        )
