"""Speed options node: attention backend, compiled blocks, lean activations, the step cache and fp8 linears for the
samplers."""

import comfy.ldm.modules.attention as comfy_attention

from ..wan import attention
from ..wan.fp8 import fp8_problem
from ..wan.speed import SpeedOptions
from .models import CATEGORY

SPEED = "LINGBOT_SPEED"
COMFY = "comfy"
# ComfyUI's own kernel choice (--use-sage-attention, --use-flash-attention, xformers, ...), looked up on
# every call so the server's setting applies to our blocks as to core nodes.
attention.register_comfy(COMFY, lambda *args, **kwargs: comfy_attention.optimized_attention(*args, **kwargs))
DEFAULTS = SpeedOptions()
LEAN = {"auto": "auto", "on": True, "off": False}  # widget value -> SpeedOptions.lean_activations


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
    """LingBot Speed wired into a chunked node (the Fast sampler, Play): attention, compile and fp8_linears
    apply; the base-cam sampler's step cache and lean blocks are refused; a choice that cannot run on `device`
    is named before any work."""
    if speed.cache is not None or speed.lean_activations is True:
        raise ValueError(
            f"speed: {node} takes attention, compile and fp8_linears from LingBot Speed; turn off "
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
    ):
        if lean_activations not in LEAN:
            raise ValueError(f"lean_activations: expected one of {list(LEAN)}, got {lean_activations!r}")
        return (
            SpeedOptions(
                attention=attention,
                compile=compile,
                cache=None if step_cache == "none" else step_cache,
                cache_threshold=cache_threshold,
                cache_keep_first=cache_keep_first,
                cache_keep_last=cache_keep_last,
                lean_activations=LEAN[lean_activations],
                fp8=fp8_linears,
            ),
        )
