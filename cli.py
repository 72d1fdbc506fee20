"""Command line: the same generation flow as the ComfyUI nodes, headless.

    python lingbot.py generate --ckpt_dir CKPT --image in.jpg --prompt "..." --action_path examples/00
    python lingbot.py demo          # tiny random checkpoints, CPU, no downloads
    python lingbot.py fast --ckpt_dir lingbot-world-base-cam --image in.jpg --prompt "..." --keys -
    python lingbot.py quantize CKPT/lingbot_world_fast CKPT/lingbot_world_fast_nf4   # fp32 -> NF4 folder
    python lingbot.py camera --preset "orbit left 30 + dolly in 1 40f ease" --save DIR --preview path.png

Option names follow upstream's generate.py (and the NF4 repack's generate_prequant.py); both
spellings are accepted where they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

# Only what the parser needs is imported here: torch and the model code load in `import_runtime`, once the
# arguments parse, so `--help` (and a mistyped flag) answers at once.
from .wan import camera_presets
from .wan.config import A14B, CHUNKED_KINDS, SampleConfig, max_frame_num


def import_runtime() -> None:
    """Import torch and the model code into this module (once). `main` does it after parsing; a library
    caller gets it on first use of one of these names (`cli.pipeline`, see `__getattr__`), or calls it."""
    global torch, tqdm, camera_authoring, camera_files, camera_preview, demo_assets, distributed
    global fast_run, monitor, text_encode, video, memplan, chunked, generate
    global LoraSpec, parse_lora_spec, RequestError, MAX_FRAMES, plan_request, plan_size, i2v, pipeline
    global fast_frame_num, fast_latent_frames, KeySteering, KINDS
    global SpeedOptions, SpeedStats, DEFAULT_OVERLAP, check_tile, decode_dtype, parallel
    if "_runtime_ready" in globals():
        return
    import torch
    from tqdm import tqdm

    from .loaders import (
        camera_authoring,
        camera_files,
        camera_preview,
        demo_assets,
        monitor,
        text_encode,
        video,
    )
    from .loaders.fast_checkpoint import KINDS
    from .loaders.lora import LoraSpec, parse_lora_spec
    from .session import chunked, distributed, fast_run, generate
    from .session import planner as memplan
    from .session.controls import KeySteering
    from .session.request import MAX_FRAMES, RequestError, plan_request, plan_size
    from .wan import i2v, parallel, pipeline
    from .wan.fast import fast_frame_num, fast_latent_frames
    from .wan.speed import SpeedOptions, SpeedStats
    from .wan.vae import DEFAULT_OVERLAP, check_tile, decode_dtype

    globals()["_runtime_ready"] = True  # last: an import that failed half way is tried again in full


def __getattr__(name: str):
    """The model code's names for a caller using this module as a library (tests patch `cli.text_encode`)."""
    if "_runtime_ready" not in globals() and not name.startswith(
        "__"
    ):  # (the import system asks for __path__)
        import_runtime()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ROOT = Path(__file__).resolve().parent
DEFAULTS = SampleConfig()


class PixelArea(int):
    """--size: upstream's pixel budget H*W that keeps the (H, W) typed; `plan` without --image takes their
    aspect ratio for the image's."""

    def __new__(cls, h: int, w: int):
        area = super().__new__(cls, h * w)
        area.hw = (h, w)
        return area


DEFAULT_SIZE = PixelArea(480, 832)  # upstream's --size default, SampleConfig.max_area


def parse_size(text: str) -> PixelArea:
    from .wan import i2v  # type converters run while parsing, before `import_runtime`

    try:
        return PixelArea(*i2v.parse_hw(text, "max_area"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--size: {err}") from None


def parse_lora(text: str) -> LoraSpec:
    from .loaders.lora import parse_lora_spec

    try:
        return parse_lora_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_gib(text: str) -> float:
    """--vram / --ram: a positive number of GiB."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def utf8_text(text: str) -> str:
    """A text argument that can be encoded: bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text (a byte that is not UTF-8 at character {err.start}); expected UTF-8 text"
        ) from None
    return text


DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when PyTorch sees a GPU, else cpu)"
KV_DTYPES = ["bf16", "fp8"]  # session.fast_run.KV_DTYPES' names, without importing torch to list them


def add_seed_arg(p: argparse.ArgumentParser):
    p.add_argument(
        "--seed",
        "--base_seed",
        dest="seed",
        type=int,
        default=DEFAULTS.seed,
        help="noise seed; negative: a random one",
    )


def add_generate_args(p: argparse.ArgumentParser, planning: bool = False):
    """The generate arguments; `planning` (the `plan` command): no files needed (--model instead)."""
    p.add_argument(
        "--ckpt_dir",
        type=Path,
        required=not planning,
        help="upstream layout or the NF4 repack layout" + (" (or --model: no files)" if planning else ""),
    )
    p.add_argument(
        "--image",
        type=Path,
        required=not planning,
        help="the first frame; its aspect ratio and --size give the video size"
        + (" (without it: --size's own aspect ratio)" if planning else ""),
    )
    p.add_argument(
        "--prompt",
        type=utf8_text,
        required=not planning,
        help="what the video shows" + (" (not needed)" if planning else ""),
    )
    p.add_argument(
        "--n_prompt", type=utf8_text, default="", help="negative prompt; empty = upstream's default"
    )
    p.add_argument(
        "--action_path", type=Path, help="folder with poses.npy + intrinsics.npy (and action.npy for Act)"
    )
    p.add_argument("--action_string", help="act2cam keys, e.g. 'w-10,a-10,iw-15,none-10' (Cam model)")
    p.add_argument(
        "--allow_act2cam", action="store_true", help="drive the Cam model from wasd/ijkl_action.npy"
    )
    add_preset_args(p, "--camera_preset")
    p.add_argument(
        "--size",
        type=parse_size,
        default=DEFAULT_SIZE,
        help="HEIGHT*WIDTH: the pixel budget, shaped to the image's aspect ratio (default 480*832)",
    )
    p.add_argument("--frame_num", type=int, default=None, help=f"4n+1 frames (default {DEFAULTS.frame_num})")
    p.add_argument(
        "--sampling_steps",
        "--sample_steps",
        dest="steps",
        type=int,
        default=DEFAULTS.sample_steps,
        help=f"denoising steps (default {DEFAULTS.sample_steps})",
    )
    p.add_argument(
        "--sample_shift",
        type=float,
        default=DEFAULTS.sample_shift,
        help=f"noise schedule shift (default {DEFAULTS.sample_shift:g})",
    )
    p.add_argument(
        "--boundary",
        type=float,
        default=DEFAULTS.boundary,
        help=f"the high-noise expert runs while t >= boundary x 1000 (default {DEFAULTS.boundary})",
    )
    p.add_argument(
        "--guide_scale",
        "--sample_guide_scale",
        dest="guide_scale",
        type=float,
        nargs="+",
        default=list(DEFAULTS.guide_scale),
        help="one value, or two: low-noise high-noise",
    )
    add_seed_arg(p)
    p.add_argument(
        "--solver",
        "--sample_solver",
        dest="solver",
        choices=["unipc", "euler"],
        default="unipc",
        help="sampler (default unipc, upstream's)",
    )
    p.add_argument(
        "--fps",
        type=int,
        default=DEFAULTS.sample_fps,
        help=f"the MP4's frame rate (default {DEFAULTS.sample_fps})",
    )
    p.add_argument(
        "--output", "--save_file", dest="output", type=Path, help="MP4 path (default: outputs/...)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--quantize", action="store_true", help="quantize bf16 experts to NF4 while loading")
    p.add_argument(
        "--lora",
        type=parse_lora,
        action="append",
        default=[],
        metavar="FILE[:STRENGTH[:high|low|both]]",
        help="apply a LoRA .safetensors (repeatable; default strength 1 on both experts) as a low-rank path "
        "beside the NF4 weights",
    )
    p.add_argument(
        "--lora_allow_unmatched",
        action="store_true",
        help="warn about LoRA keys that match no layer, not fail",
    )
    p.add_argument(
        "--lora_merge",
        action="store_true",
        help="with --quantize on bf16/fp32 experts: merge the LoRAs into the weights before quantizing "
        "(no side path at run time; changing them needs a reload)",
    )
    add_text_encoder_args(p)
    p.add_argument(
        "--t5_overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="encode the text in its child process while this one encodes the first frame and loads the "
        "first expert ('auto': when the planner finds both fit the card; needs --t5_mode subprocess)",
    )
    p.add_argument(
        "--vae_tile",
        default="auto",
        help="VAE encode and decode tiles: 'auto', 'none' or H,W in latent pixels",
    )
    add_vae_dtype_arg(p)
    p.add_argument(
        "--swap_blocks",
        default="0",
        help="DiT blocks of the resident expert kept in pinned host RAM and streamed to the GPU block by "
        "block (0..num_layers, or 'auto'); less VRAM, identical results",
    )
    add_parallel_args(p, "generate", "the 40 heads")
    speed = p.add_argument_group("speed (every option off: upstream's exact computation)")
    add_attention_arg(speed)
    speed.add_argument(
        "--compile", action="store_true", help="torch.compile the DiT blocks (one graph for all)"
    )
    add_fp8_arg(speed)
    speed.add_argument(
        "--lean_activations",
        choices=["on", "off", "auto"],
        default="auto",
        help="run each DiT block in token chunks, keeping only the full-length tensors (about 14 instead of "
        "35 vectors per token of activation memory; equal up to GEMM rounding). 'auto': on only when the "
        "planner says the run would not fit otherwise, before any block swap; not with --compile",
    )
    speed.add_argument(
        "--cache",
        choices=["none", "easycache"],
        default="none",
        help="training-free step cache (EasyCache): reuses the transformer's output on steps where it "
        "changes little; trades quality for speed",
    )
    # defaults None: SpeedOptions' own (`speed_options`), which needs torch to import
    speed.add_argument(
        "--cache_threshold",
        type=float,
        nargs="+",
        default=None,
        help="EasyCache threshold, one value or two (low-noise high-noise); 0 = never skip",
    )
    speed.add_argument(
        "--cache_keep_first",
        type=int,
        default=None,
        help="steps always computed at the start of each expert's stretch",
    )
    speed.add_argument(
        "--cache_keep_last",
        type=int,
        default=None,
        help="steps always computed at the end of each expert's stretch",
    )
    p.add_argument("--report", type=Path, help="also write the per-phase time/memory table as JSON here")
    p.add_argument(
        "--save_latent",
        type=Path,
        help="also save the final latent for ComfyUI's Load Latent node (.latent, safetensors)",
    )


def add_text_encoder_args(p: argparse.ArgumentParser):
    p.add_argument(
        "--t5_mode",
        choices=["subprocess", "inprocess"],
        default="subprocess",
        help="run the text encoder in a child process that exits afterwards (default), or in this one",
    )
    p.add_argument("--t5_cpu", action="store_true", help="run the text encoder on the CPU")


def add_vae_dtype_arg(p: argparse.ArgumentParser):
    p.add_argument(
        "--vae_dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="VAE decoder precision: fp32 is exact (upstream's); bf16/fp16 decode with a channels-last copy "
        "of the decoder, faster on a GPU, half the decode memory, not bit-exact",
    )


def add_preset_args(p: argparse.ArgumentParser, flag: str):
    p.add_argument(
        flag,
        dest="camera_preset",
        metavar="TEXT",
        help="camera path from a preset, e.g. 'pan left 30 40f ease, dolly in 1 40f' (see `camera --help`)",
    )
    p.add_argument("--camera_speed", type=float, default=1.0, help="scale every preset amount")
    p.add_argument(
        "--camera_fov",
        type=float,
        default=camera_presets.DEFAULT_HFOV_DEG,
        help="preset's horizontal field of view in degrees",
    )


def parse_hw(text: str) -> tuple[int, int]:
    from .wan import i2v

    try:
        return i2v.parse_hw(text, "--size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_camera_args(p: argparse.ArgumentParser):
    add_preset_args(p, "--preset")
    p.add_argument("--action_path", type=Path, help="preview a pose folder (poses.npy + intrinsics.npy)")
    p.add_argument("--action_string", help="with --action_path: preview act2cam keys, e.g. 'w-10,l-8'")
    p.add_argument(
        "--frames", type=int, default=None, help="4n+1 frames (preset default: 81 or its segments')"
    )
    p.add_argument(
        "--size", type=parse_hw, default=(480, 832), help="HEIGHT*WIDTH the preset's intrinsics are for"
    )
    p.add_argument(
        "--save", type=Path, help="write the preset as poses.npy + intrinsics.npy into this folder"
    )
    p.add_argument("--preview", type=Path, help="write a PNG of the path (top-down and side view)")
    p.add_argument("--overwrite", action="store_true", help="replace existing --save/--preview files")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub.add_parser("generate", help="image + prompt + camera path -> MP4"))
    add_camera_args(
        sub.add_parser(
            "camera",
            help="camera preset or pose folder -> poses.npy + intrinsics.npy and/or a preview PNG",
            description=camera_presets.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    plan = sub.add_parser(
        "plan",
        help="each phase's predicted peak VRAM/RAM, from the generate arguments or a model's name (no files)",
        description=plan_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_args(plan, planning=True)
    add_plan_args(plan)
    doctor = sub.add_parser(
        "doctor", help="check the GPU, libraries and (with --ckpt_dir) the checkpoint files"
    )
    doctor.add_argument("--ckpt_dir", type=Path, help="also validate every checkpoint file from its headers")
    doctor.add_argument("--device", default="cuda", help="the CUDA device to check")
    doctor.add_argument(
        "--assets_dir",
        type=Path,
        help="text encoder, tokenizer and VAE for a folder without them (the v2 1.3B)",
    )
    quantize = sub.add_parser(
        "quantize",
        help="a bf16/fp32 expert (e.g. lingbot_world_fast/, a v2 DiT) -> an NF4 folder that loads in seconds",
    )
    quantize.add_argument(
        "src",
        type=Path,
        help="expert folder or file: lingbot_world_fast/ (or the base-cam folder holding it), a v2 14B "
        "folder (its transformers/), the v2 1.3B folder, high_noise_model/, a single .safetensors; fp32 or "
        "bf16, sharded or not",
    )
    quantize.add_argument("dst", type=Path, help="the NF4 folder to write (e.g. .../lingbot_world_fast_nf4)")
    quantize.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    quantize.add_argument(
        "--format",
        choices=["nf4", "fp8"],
        default="nf4",
        help="nf4: bitsandbytes 4-bit (the repack's format); fp8: the DiT blocks' Linears as e4m3 with a "
        "scale per row (~14 GB for a 14B model; runs with --fp8 on Ada/Hopper/Blackwell)",
    )
    quantize.add_argument(
        "--device", default=None, help=f"where to quantize (cuda is much faster): {DEVICE_HELP}"
    )
    add_fast_args(
        sub.add_parser(
            "fast",
            help="LingBot-World-Fast: chunk by chunk, 4 steps a chunk, steerable with keys while it runs",
            description=FAST_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    add_play_args(
        sub.add_parser(
            "play",
            help="play the world live in a browser tab: keys and mouse drive the camera (v1 Fast, v2)",
            description=PLAY_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    demo = sub.add_parser("demo", help="tiny random checkpoints on the CPU, shipped example, short MP4")
    demo.add_argument(
        "--workdir",
        type=Path,
        default=Path.home() / ".cache" / "lingbot-world-nf4" / "demo",
        help="where the tiny checkpoints are written once and reused "
        "(default ~/.cache/lingbot-world-nf4/demo)",
    )
    demo.add_argument("--output", type=Path, default=None, help="MP4 path (default: outputs/demo_<time>.mp4)")
    demo.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return parser


def plan_help() -> str:
    kinds = "\n".join(
        f"  {k.name:<10} chunk-causal, {k.dit.num_layers} blocks of width {k.dit.dim}: "
        f"chunks of {k.chunk_frames} latent frames, attention window "
        + ("all" if k.local_attn_size == -1 else f"{k.local_attn_size} with a sink of {k.sink_size}")
        for k in CHUNKED_KINDS.values()
    )
    return f"""Each phase's predicted peak VRAM and host RAM, before anything loads; with a GPU (this
machine's, or --vram), whether the run fits it, and if not, the settings that would (exit 2).

From the files: the generate arguments (--ckpt_dir, --image, --size, --frame_num, --swap_blocks, ...).
Before downloading: --model names a known model, sized from its architecture with NF4 weights:
  base-cam   the two A14B experts `generate` runs
{kinds}
(for those, --local_attn_size, --sink_size and --kv_dtype change the attention window and cache)
--vram GiB (and --ram GiB) plan for a card (and host) this machine need not have.

  python lingbot.py plan --model base-cam --size 720*1280 --frame_num 161 --vram 12
  python lingbot.py plan --model v2-14b --size 480*832 --frame_num 161 --vram 24
"""


def add_plan_args(p: argparse.ArgumentParser):
    p.add_argument(
        "--model",
        choices=["base-cam", *CHUNKED_KINDS],
        help="plan a known model from its architecture (NF4 weights), without its files",
    )
    p.add_argument(
        "--vram",
        type=parse_gib,
        metavar="GiB",
        help="free VRAM of the card to plan for (default: this machine's GPU, if any)",
    )
    p.add_argument(
        "--ram",
        type=parse_gib,
        metavar="GiB",
        help="available host RAM to plan for (default: this machine's, unless --vram names another card)",
    )
    chunked = p.add_argument_group("chunked models (--model fast, v2-14b, v2-1.3b)")
    chunked.add_argument(
        "--local_attn_size",
        type=int,
        default=None,
        help="latent frames the attention cache keeps, sink included (-1: all; default: the model's, above)",
    )
    chunked.add_argument(
        "--sink_size",
        type=int,
        default=None,
        help="latent frames at the start the window never evicts (default: the model's, above)",
    )
    chunked.add_argument(
        "--kv_dtype", choices=KV_DTYPES, default="bf16", help="attention cache dtype (fp8 halves it)"
    )


AUTO_ON_OFF = {"auto": "auto", "on": True, "off": False}  # --lean_activations, --camera_cache


def speed_options(args) -> SpeedOptions:
    """The speed flags; those left out (None) take SpeedOptions' defaults."""
    base = SpeedOptions()
    thresholds = args.cache_threshold or [base.cache_threshold]
    try:
        return SpeedOptions(
            attention=args.attention,
            compile=args.compile,
            cache=None if args.cache == "none" else args.cache,
            cache_threshold=thresholds[0] if len(thresholds) == 1 else (thresholds[0], thresholds[-1]),
            cache_keep_first=base.cache_keep_first
            if args.cache_keep_first is None
            else args.cache_keep_first,
            cache_keep_last=base.cache_keep_last if args.cache_keep_last is None else args.cache_keep_last,
            lean_activations=AUTO_ON_OFF[getattr(args, "lean_activations", "auto")],
            fp8=bool(getattr(args, "fp8", None)),
            fp8_accum=fp8_accum(args),
        )
    except ValueError as err:  # each message starts with the option's name
        raise ValueError(f"--{err}") from None


ATTENTION_HELP = (
    "attention kernel: sdpa (PyTorch's, exact), sage (SageAttention; needs the sageattention package), fp8 "
    "(cuDNN's fp8 attention: q, k, v, the softmax probabilities and the output in e4m3; a CUDA GPU with fp8 "
    "tensor cores, Hopper or newer, and the nvidia-cudnn-frontend package; faster, not exact), fa3 "
    "(FlashAttention-3's bf16 kernel: an H100/H200 and the flash_attn_3 package, built from flash-attention's "
    "hopper/ directory) or fa3_fp8 (its fp8 kernel: q, k, v in e4m3 with a scale per head, bf16 output; "
    "faster, not exact)"
)


# wan.attention.BUILT_IN, written out: the parser imports no torch (a test keeps the two equal)
ATTENTION_CHOICES = ("sdpa", "sage", "fp8", "fa3", "fa3_fp8")


def add_attention_arg(p) -> None:
    p.add_argument("--attention", default="sdpa", choices=ATTENTION_CHOICES, help=ATTENTION_HELP)


def check_attention(args, device) -> None:
    """--attention that cannot run on `device` (fp8 off an fp8-capable GPU, fa3 off a Hopper, a missing package):
    one clear error before loading."""
    from .wan import attention

    problem = attention.problem(args.attention, device)
    if problem is not None:
        raise ValueError(f"--attention: {problem}")


FP8_ACCUMULATIONS = ("exact", "fast")  # wan.fp8.ACCUMULATIONS, without importing torch to list them


def add_fp8_arg(p) -> None:
    p.add_argument(
        "--fp8",
        nargs="?",
        const="exact",
        choices=FP8_ACCUMULATIONS,
        default=None,
        metavar="exact|fast",
        help="run the DiT blocks' Linears in fp8 (e4m3, a scale per weight row and per token) on fp8 tensor "
        "cores (CUDA compute capability 8.9+: Ada, Hopper, Blackwell); quantized while loading from bf16/fp32 "
        "(or NF4, dequantized first), an fp8 folder from `quantize --format fp8` as stored. Faster, not exact. "
        "'--fp8 fast' also accumulates the matmuls in the tensor cores' own precision (cuBLAS fast "
        "accumulation): faster again, a little more rounding",
    )


def fp8_accum(args) -> str:
    """The fp8 linears' accumulation that --fp8 asked for ('exact' without --fp8)."""
    return getattr(args, "fp8", None) or "exact"


def load_quantize(args, device=None) -> bool | str | None:
    """What the loader's `quantize` gets from --quantize / --fp8 (checked against `device` when given)."""
    if not getattr(args, "fp8", False):
        return args.quantize or None
    if args.quantize:
        raise ValueError("--fp8: not with --quantize (NF4); pick one")
    if device is not None:
        from .wan.fp8 import fp8_problem

        problem = fp8_problem(device)
        if problem is not None:
            raise ValueError(f"--fp8: {problem}")
    return "fp8"


def guide_pair(values: list[float]) -> tuple[float, float]:
    """--guide_scale: one value for both experts, or (low-noise, high-noise)."""
    return (values[0], values[-1])


# Library parameter names -> the flags a user types: a RequestError's `param`, or the `name: ` a library
# ValueError's message starts with (after a "camera preset '...': " context); COMMAND_FLAGS per command.
FLAGS = {
    "sample_steps": "--sampling_steps",
    "sample_shift": "--sample_shift",
    "boundary": "--boundary",
    "guide_scale": "--guide_scale",
    "sample_fps": "--fps",
    "solver": "--solver",
    "seed": "--seed",
    "frame_num": "--frame_num",
    "max_area": "--size",
    "size": "--size/--frame_num",
    "action_string": "--action_string",
    "camera": "--action_path/--action_string/--camera_preset",
    "text": "text encoder",
    "lora": "--lora",
    "attention": "--attention",
    "memory": "not enough memory",
    "swap_blocks": "--swap_blocks",
    "lora_merge": "--lora_merge",
    "ulysses_size": "--ulysses_size",
    "lean_activations": "--lean_activations",
    "vae_tile": "--vae_tile",
    "vae_dtype": "--vae_dtype",
    "shift": "--sample_shift",
    "local_attn_size": "--local_attn_size",
    "sink_size": "--sink_size",
    "kv_dtype": "--kv_dtype",
    "speed": "--camera_speed",
    "fov": "--camera_fov",
}
COMMAND_FLAGS = {"camera": {"frame_num": "--frames"}}
_PARAM = re.compile(r"(camera preset .*?: )?([a-z][a-z_]*): ")


def flag_message(err: Exception, command: str) -> str:
    """An error's message with the library's parameter name replaced by the flag this command takes."""
    flags = {**FLAGS, **COMMAND_FLAGS.get(command, {})}
    if isinstance(err, RequestError):
        return f"{flags.get(err.param, err.param)}: {err.detail}"
    text = str(err)
    found = _PARAM.match(text)
    flag = found and flags.get(found.group(2))
    if not flag or not flag.startswith("--"):
        return text
    return text[: found.start(2)] + flag + text[found.end(2) :]


def resolve_device(text: str, flag: str = "--device") -> torch.device:
    """--device (or `flag`), checked before anything loads: cpu, cuda or cuda:N on a machine that has it."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag}: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag}: only cpu and cuda are supported, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            from .session.doctor import no_gpu_reason

            raise ValueError(f"{flag} {text}: CUDA is not available: {no_gpu_reason()}; or use {flag} cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{flag} {text}: this machine has {count} CUDA device(s) (cuda:0..{count - 1})")
    return device


def default_output(stem: str) -> Path:
    out = Path("outputs")
    out.mkdir(exist_ok=True)
    base = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{base}.mp4", 1
    while path.exists():
        path, n = out / f"{base}-{n}.mp4", n + 1
    return path


def run_inputs(args) -> list:
    """(flag, path) of what a generate/fast run reads: no output of the run may replace one of them."""
    keys = getattr(args, "keys", None)
    return [
        ("--ckpt_dir", args.ckpt_dir),
        ("--image", args.image),
        ("--action_path", args.action_path),
        ("--keys", None if keys in (None, "-") else keys),
        ("--assets_dir", getattr(args, "assets_dir", None)),
        *(("--lora", spec.path) for spec in getattr(args, "lora", ())),
    ]


def check_outputs(args, stem: str) -> Path:
    """--output (default outputs/<stem>_<time>.mp4), --report and --save_latent, checked before anything
    loads (`video.check_output`): none may replace an input of the run or another of them. Returns --output."""
    taken = run_inputs(args)
    output = video.check_output(args.output or default_output(stem), args.overwrite, taken)
    taken.append(("--output", output))
    for flag, path, overwrite in (
        ("--report", args.report, True),  # a report is always rewritten
        ("--save_latent", args.save_latent, args.overwrite),
    ):
        if path:
            video.check_output(path, overwrite, taken)
            taken.append((flag, path))
    return output


def camera_input(args, image_hw=None) -> camera_files.CameraInput | None:
    """--action_path (+ --action_string / --allow_act2cam), as upstream: keys drive the Cam model
    with synthetic poses and take their intrinsics from the folder. Or --camera_preset, its focal length
    meant for the video size --size gives the image (H, W)."""
    if getattr(args, "camera_preset", None):
        if args.action_path or args.action_string or args.allow_act2cam:
            raise ValueError(
                "--camera_preset replaces --action_path/--action_string/--allow_act2cam; give one"
            )
        size = i2v.latent_size(*image_hw, args.size)[2:] if image_hw is not None else (480, 832)
        return camera_authoring.preset_camera(
            args.camera_preset, args.frame_num, args.camera_speed, size, args.camera_fov
        )[0]
    if (args.action_string or args.allow_act2cam) and not args.action_path:
        raise ValueError(
            "--action_string/--allow_act2cam need --action_path for intrinsics.npy (as upstream)"
        )
    if not args.action_path:
        return None
    folder = args.action_path
    if args.allow_act2cam and args.action_string:  # upstream: the string implies the flag, its keys win
        print(f"--allow_act2cam: the keys come from --action_string, not from {folder}/wasd_action.npy")
    elif args.allow_act2cam and folder.is_dir() and not (folder / "wasd_action.npy").is_file():
        raise FileNotFoundError(
            f"--allow_act2cam: {folder} has no wasd_action.npy (act2cam from files reads wasd_action.npy "
            "and, if present, ijkl_action.npy); add it or give the keys with --action_string"
        )
    return camera_files.CameraInput.from_dir(args.action_path, args.action_string, args.allow_act2cam)


# The most pixels --image may have (PIL's own decompression-bomb warning limit, ~9459x9459): checked on the
# size in the file's header, before any pixel is decoded.
MAX_IMAGE_PIXELS = 89_478_485


def load_image(path: Path) -> torch.Tensor:
    import warnings

    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"--image: {path} not found")
    limit = f"at most {MAX_IMAGE_PIXELS:,} pixels (about 9459x9459) are read; downscale it"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below instead
            img = Image.open(path)
        with img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"--image: {path} is {img.width}x{img.height} pixels; {limit}")
            img.load()  # decode here: a truncated or damaged file fails now, not inside the conversion
            return i2v.image_to_tensor(img)
    except UnidentifiedImageError:
        raise ValueError(f"--image: {path} is not an image PIL can read") from None
    except Image.DecompressionBombError:  # PIL's own refusal from the header, at twice our limit
        raise ValueError(f"--image: {path} is too large by its header; {limit}") from None
    except OSError as err:
        raise ValueError(
            f"--image: {path} cannot be decoded ({err}); expected a complete image file"
        ) from None


def vae_tile(text: str):
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        th, tw = (int(v) for v in text.split(","))
        check_tile((th, tw), DEFAULT_OVERLAP)
    except ValueError:
        raise ValueError(
            f"--vae_tile must be 'auto', 'none' or H,W in latent pixels, each more than the {DEFAULT_OVERLAP} "
            f"neighbouring tiles share (e.g. 53,88; a tile as large as the frame is no tiling), got {text!r}"
        ) from None
    return (th, tw)


def memory_check(args, files, tile, device, free=True, budget=None) -> memplan.MemoryCheck:
    """The planner's inputs from the generate arguments; `free`: check against the device's free memory,
    or against `budget` ((VRAM, RAM) bytes, None where unknown) when given. `files` None (`plan --model
    base-cam`): two NF4 A14B experts sized from their architecture and upstream's umT5."""
    budget = budget if budget is not None else generate.machine_memory(device) if free else (None, None)
    return generate.memory_check(
        files,
        args.lora,
        device.type,
        budget,
        quantize=load_quantize(args),
        swap_blocks=getattr(args, "swap_blocks", 0),
        vae_tile=tile,
        t5_mode=args.t5_mode,
        t5_device="cpu" if args.t5_cpu else device.type,
        t5_overlap={"on": True, "off": False}.get(args.t5_overlap, "auto"),
        vae_dtype=args.vae_dtype,
    )


def prepare_generate(args, check_memory: bool = True, planning: bool = False):
    """Everything a user can get wrong, checked before any model loads, memory included. `planning`: for
    `plan`, which starts no ranks: --ulysses_size N is planned for N ranks without a process group."""
    device = plan_device(args) if planning else resolve_device(args.device)
    load_quantize(args, None if planning else device)
    if not planning:
        check_attention(args, device)
    files, config, text_dim = None, A14B, None
    if not getattr(args, "model", None):  # `plan --model base-cam`: the architecture, no files
        lora_merge = getattr(args, "lora_merge", False)
        files, text_dim = generate.check_files(
            args.ckpt_dir, load_quantize(args), args.lora, lora_merge, "--quantize or --fp8"
        )
        config = files.config
    tile = vae_tile(args.vae_tile)
    decode_dtype(args.vae_dtype, device)
    image = load_image(args.image) if args.image else None  # optional for `plan`
    image_hw = args.size.hw if image is None else image.shape[1:]
    cam_input = camera_input(args, image_hw)
    settings = SampleConfig(
        sample_shift=args.sample_shift,
        sample_steps=args.steps,
        boundary=args.boundary,
        guide_scale=guide_pair(args.guide_scale),
        sample_fps=args.fps,
        max_area=args.size,
        solver=args.solver,
        seed=i2v.resolve_seed(args.seed),
    )
    plan = plan_request(
        image_hw,
        config,
        settings,
        camera=cam_input,
        frame_num=args.frame_num,
        max_area=args.size,
        text_dim=text_dim,
        loras=args.lora,
        allow_unmatched_lora_keys=args.lora_allow_unmatched,
        speed=speed_options(args),
        memory=memory_check(args, files, tile, device, free=check_memory),
        swap_blocks=args.swap_blocks,
        ulysses_size=args.ulysses_size if planning else getattr(args, "ranks", 1),
        ulysses_world=args.ulysses_size if planning else None,
    )
    return device, files, tile, image, plan


def plan_device(args):
    """The device `plan` plans for: a CUDA card with --vram (this machine need not have one), else
    --device."""
    return torch.device("cuda") if args.vram is not None else resolve_device(args.device)


def plan_budget(args, device) -> tuple:
    """(free VRAM, available RAM) bytes `plan` checks against: --vram / --ram, for a card and host this
    machine need not have; else this machine's GPU and RAM. None where unknown (not checked)."""
    if args.vram is not None:  # another card: this host's RAM says nothing about its host
        vram, ram = int(args.vram * memplan.GIB), None
    else:
        vram, ram = generate.machine_memory(device)
    if args.ram is not None:
        ram = int(args.ram * memplan.GIB)
    return vram, ram


def fits_line(args, device, vram, ram) -> str:
    where = " (--vram)" if args.vram is not None else f" free on {device}"
    parts = [] if vram is None else [f"{vram / memplan.GIB:.1f} GiB of VRAM{where}"]
    if ram is not None:
        parts.append(f"{ram / memplan.GIB:.1f} GiB of RAM" + (" (--ram)" if args.ram is not None else ""))
    return "fits: " + " and ".join(parts)


NO_GPU_NOTE = (
    "(VRAM figures are for a CUDA device; on the CPU everything lives in RAM; --vram GiB checks a card)"
)


def run_plan(args) -> int:
    """`plan`: the table of predicted peaks; with a GPU (this machine's, or --vram), whether the run fits
    (exit 2 if not). From the files (--ckpt_dir), or from a model's name (--model) before downloading."""
    if (args.model is None) == (args.ckpt_dir is None):
        raise ValueError("plan: give --ckpt_dir DIR (the files) or --model NAME (before downloading them)")
    if args.parallel == "auto":
        args.ulysses_size = distributed.requested_size(args.ulysses_size, args.parallel)
    if args.model in CHUNKED_KINDS:
        return run_plan_chunked(args, CHUNKED_KINDS[args.model])
    device, files, tile, _, plan = prepare_generate(args, check_memory=False, planning=True)
    if files is None:
        expert = plan.memory.planner.request.expert_bytes["high"]
        stored = "fp8" if getattr(args, "fp8", False) else "NF4"
        print(
            f"{args.model}, from its architecture: two {stored} A14B experts of {expert / memplan.GIB:.2f} GiB, "
            f"umT5-XXL {memplan.T5_DEFAULT_BYTES / memplan.GIB:.2f} GiB (bf16)"
        )
    vram, ram = plan_budget(args, device)
    if vram is None and ram is None:
        print(plan.memory.table())
        print(NO_GPU_NOTE)
        return 0
    check = memory_check(args, files, tile, device, budget=(vram, ram))
    try:  # the plan for this card's free memory: its 'auto' settings as the run would resolve them
        fitted = check.run(plan.memory.planner)
    except memplan.MemoryPlanError:
        print(plan.memory.planner.plan(vram).table())  # as planned for this card ('auto' settings resolved)
        raise  # exit 2 with the settings that fit
    print(fitted.table())
    print(fits_line(args, device, vram, ram))
    return 0


def run_plan_chunked(args, kind) -> int:
    """`plan --model fast|v2-14b|v2-1.3b`: the text encoder's peak, then the chunk loop's (model, attention
    caches, a chunk's work: what `fast` checks before it loads), from the architecture with NF4 weights."""
    ranks = args.ulysses_size  # each GPU's share under torchrun (`fast --ulysses_size N`)
    if ranks < 1:
        raise ValueError(f"--ulysses_size: expected an integer >= 1, got {ranks}")
    check_heads(ranks, kind.dit.num_heads)
    if args.ram is not None:
        raise ValueError("--ram: the chunked models' plan predicts VRAM only")
    try:
        config, swap = chunked.settings(
            kind,
            kind.dit.num_layers,
            None,
            DEFAULTS.seed,
            args.local_attn_size,
            args.sink_size,
            args.kv_dtype,
            args.swap_blocks,
            args.frame_num,
        )
    except ValueError as err:
        raise ValueError(f"--{err}") from None
    asked = DEFAULTS.frame_num if args.frame_num is None else args.frame_num
    lat_f, frames = fast_latent_frames(asked, kind.chunk_frames), fast_frame_num(asked, kind.chunk_frames)
    local, sink, chunk = config.local_attn_size, config.sink_size, config.chunk_frames
    device = plan_device(args)
    image_hw = load_image(args.image).shape[1:] if args.image else args.size.hw
    lat_h, lat_w, h, w = plan_size(image_hw, args.size)
    model, shape, tile = fast_run.ChunkedModel.of_kind(kind), (lat_f, lat_h, lat_w), vae_tile(args.vae_tile)
    need = fast_run.fast_memory(model, shape, config, None, swap, tile, args.vae_dtype, ranks=ranks)
    text = 0 if args.t5_cpu else memplan.T5_DEFAULT_BYTES + memplan.T5_WORKING
    gib = memplan.GIB
    window = "all" if local == -1 else f"{local}, sink {sink}"
    made = f"{frames} frames" + (f" ({asked} asked: whole chunks)" if frames != asked else "")
    print(
        f"memory plan: {kind.name} (NF4 weights, from its architecture), {made} at {h}*{w}: "
        f"{lat_f // chunk} chunks of {chunk} latent frames; attention window {window}, K/V {args.kv_dtype}, "
        f"swap_blocks {swap}, VAE decoder {args.vae_dtype}"
        + (f"; per GPU of {ranks} (sequence parallel)" if ranks > 1 else "")
    )
    print(f"{'phase':<13} {'peak VRAM':>10}")
    where = "CPU" if args.t5_cpu else "GPU"
    print(f"{'text_encode':<13} {text / gib:>6.2f} GiB  umT5 on the {where}, done before the model loads")
    print(
        f"{'chunks':<13} {need.peak / gib:>6.2f} GiB  model {need.model / gib:.2f} + attention caches "
        f"{need.caches / gib:.2f} + a chunk's work {need.work / gib:.2f} GiB"
    )
    print(f"{'peak':<13} {max(text, need.peak) / gib:>6.2f} GiB")
    if not swap:  # swapped blocks take no kept camera injections
        kept = dataclasses.replace(config, camera_cache=True)
        cams = fast_run.fast_memory(model, shape, kept, None, swap, tile, args.vae_dtype, ranks=ranks).caches
        print(
            f"{'':<13} + {(cams - need.caches) / gib:.2f} GiB where `fast` / `play` keep each block's camera "
            "injection for a chunk's forwards (--camera_cache auto: only where it fits)"
        )
    vram, _ = plan_budget(args, device)
    if vram is None:
        print(NO_GPU_NOTE)
        return 0
    issue = fast_run.fast_fit_issue(
        model, shape, config, None, swap, vram, tile, vae_dtype=args.vae_dtype, ranks=ranks
    )
    if text > vram:
        t5 = f"text_encode needs {text / gib:.1f} GiB, more than {vram / gib:.1f} GiB free; add --t5_cpu"
        issue = t5 if issue is None else f"{issue}; {t5}"
    if issue is not None:
        raise ValueError(f"memory: {issue}")
    print(fits_line(args, device, vram, None))
    return 0


def run_generate(args) -> int:
    args.ranks = distributed.requested_size(args.ulysses_size, args.parallel)
    with distributed.process_group(args.ranks, args.device) as args.device:
        return _run_generate(args)


def _run_generate(args) -> int:
    output = check_outputs(args, "lingbot")
    device, files, tile, image, plan = prepare_generate(args)
    log = monitor.PhaseLog()
    hooks = pipeline.Hooks(phase=log.phase)
    try:
        return _generate(args, device, files, tile, image, plan, output, log, hooks)
    except torch.OutOfMemoryError:
        error = memplan.oom_error(hooks.current, plan.memory)
    # outside the handler: the traceback (and the tensors its frames held) is gone
    monitor.free_memory()
    raise error


def _generate(args, device, files, tile, image, plan, output, log, hooks) -> int:
    settings, (h, w) = plan.settings, plan.size[2:]
    lead = distributed.rank() == 0  # the rank that encodes text, runs the VAE, reports and writes the MP4
    enc_tile, dec_tile = generate.run_tiles(tile, plan)
    if lead:
        print(plan.memory.table())
    # guide scale 1 throughout runs no CFG: the negative prompt is never used, so it is not encoded
    prompts = [args.prompt, args.n_prompt or settings.negative_prompt][: 2 if plan.needs_negative else 1]
    stats = SpeedStats()
    latent, vae, background = generate.denoise(
        files,
        plan,
        image,
        device,
        prompts,
        t5_mode=args.t5_mode,
        t5_device="cpu" if args.t5_cpu else str(device),
        quantize=load_quantize(args),
        lora_merge=args.lora_merge,
        encode_tile=enc_tile,
        hooks=hooks,
        stats=stats,
        progress=lambda total: tqdm(total=total, desc="denoising", unit="step", disable=not lead),
    )
    if background is not None:
        log.add_background("text_encode", background.seconds)
        print(
            f"text encoder: {background.seconds:.1f} s in the background; the run waited {background.waited:.1f} s"
        )
    if not lead:  # the others' part ends with the last step
        return 0
    generate.outputs(
        vae,
        latent,
        plan,
        dec_tile,
        output,
        args.overwrite,
        hooks,
        args.save_latent,
        decode_dtype(args.vae_dtype, device),
    )
    print(log.table())
    print(stats.summary())
    print(
        f"wrote {output} ({plan.frame_num} frames, {h}*{w}, {settings.sample_fps} fps, seed {settings.seed})"
    )
    write_report(args.report, log)
    return 0


def run_demo(args) -> int:
    ckpt = demo_assets.ensure_demo_checkpoint(args.workdir)
    example = ROOT / "examples" / "00"
    output = args.output or default_output("demo")
    argv = [
        "generate",
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(example / "image.jpg"),
        "--prompt",
        (example / "prompt.txt").read_text().strip(),
        "--action_path",
        str(example),
        "--size",
        "64*112",
        "--frame_num",
        "9",
        "--sampling_steps",
        "6",
        "--device",
        "cpu",
        "--t5_mode",
        "subprocess",
        "--output",
        str(output),
        "--seed",
        "42",
    ]
    if args.overwrite:
        argv.append("--overwrite")
    print(f"demo: tiny random checkpoints in {ckpt} (random weights: expect noise, not a scene)")
    return run_generate(build_parser().parse_args(argv))


def run_quantize(args) -> int:
    """`quantize`: stream an expert through NF4 quantization into a new folder (renamed into place)."""
    from .loaders.quantize import quantize_expert

    device = resolve_device(args.device)
    res = quantize_expert(args.src, args.dst, device, args.overwrite, args.format)
    mib = 1 << 20
    vram = f", peak VRAM {res.peak_vram / mib:.0f} MiB" if res.peak_vram is not None else ""
    print(
        f"wrote {res.dst} ({res.tensors} tensors, {res.nbytes / mib:.1f} MiB from {res.source.nbytes / mib:.1f} "
        f"MiB) in {res.seconds:.1f} s on {device}; peak RSS {res.peak_rss / mib:.0f} MiB "
        f"(+{res.rss_growth / mib:.0f} MiB){vram}"
    )
    return 0


FAST_HELP = f"""LingBot-World-Fast and LingBot-World 2.0 causal-fast: one causal DiT generates the clip chunk
by chunk, 4 steps a chunk, no CFG, attending to a cache of what came before. v1 Fast: chunks of 3 latent
frames (9 video frames for the first chunk, 12 for each later one); v2 14B and 1.3B: 4 latent frames (13,
then 16). Frames are decoded and encoded into the MP4 as each chunk finishes: RAM holds one chunk's
frames, not the clip's. A clip is at most {max_frame_num(3)} frames for v1 Fast and {max_frame_num(4)} for v2
(--frame_num; the RoPE table's latent frames), --keys - included; what grows with --frame_num is set up
front and in the predicted peak: the attention cache (bounded by --local_attn_size), the i2v condition and
the first-frame encode's video.

--ckpt_dir: the base-cam folder holding lingbot_world_fast/ (or lingbot_world_fast_nf4/ written by
`lingbot.py quantize`), the v2 14B folder (its DiT in transformers/), the v2 1.3B folder (with
--assets_dir: the 14B folder, for the text encoder, tokenizer and VAE), or a DiT folder itself.
--model auto detects which it is from the files; the window, sink and shift default to the model's
documented run (v1 Fast: -1 / 0 / 10; v2 14B: 18 / 6 / 10; v2 1.3B: 18 / 6 / 5).

Camera: a whole path up front (--action_path poses, --action_string, --camera_preset), or steered with
--keys FILE / --keys - (stdin): one line per chunk naming the keys held through that chunk's frames,
any of w a s d (move) i j k l (look up/left/down/right), e.g. `w`, `wj`, `none`. Chunk k's camera is
built when chunk k starts, from the keys of chunks 0..k (act2cam's motion at a fixed step; see README).
"""


CHUNKED_HEADS = "the model's heads: 40 for v1 Fast and the v2 14B, 12 for the v2 1.3B"


def add_parallel_args(p: argparse.ArgumentParser, command: str, heads: str) -> None:
    p.add_argument(
        "--ulysses_size",
        type=int,
        default=1,
        help=f"sequence parallel over N GPUs (N divides {heads}): launch with "
        f"`torchrun --nproc_per_node N lingbot.py {command} ... --ulysses_size N`",
    )
    p.add_argument(
        "--parallel",
        choices=["none", "auto"],
        default="none",
        help="'auto': sequence parallel over every process torchrun started (its world size)",
    )


CHUNK_COMPILE_HELP = (
    "torch.compile the DiT blocks once the attention window is full (the first compiled chunk is slower while it "
    "compiles; a window that never fills never compiles); the chunks before it run eagerly, except in play, "
    "which runs them from the second on through graphs whose key length is a symbol (its unseen warm-up "
    "compiles both). On a "
    "GPU each steady forward then replays one CUDA graph (the same kernels, without the host's launch work). With "
    "--vae_dtype bf16/fp16 the VAE decoder compiles too (during the first chunk), its upsamples as sub-pixel "
    "convs; the exact fp32 decoder never compiles"
)


def add_chunked_model_args(p: argparse.ArgumentParser):
    """The checkpoint flags of the chunked models' commands (`fast`, `play`)."""
    p.add_argument(
        "--ckpt_dir",
        type=Path,
        required=True,
        help="base-cam folder with lingbot_world_fast/, a v2 14B or 1.3B folder, a DiT folder, or an NF4 "
        "folder from `quantize`",
    )
    p.add_argument(
        "--model",
        choices=("auto", *CHUNKED_KINDS),
        default="auto",
        help="which model the checkpoint is: auto (detected from its files), fast (v1), v2-14b, v2-1.3b",
    )
    p.add_argument(
        "--assets_dir",
        type=Path,
        help="folder with the text encoder, tokenizer and VAE when --ckpt_dir lacks them (the v2 1.3B: "
        "the v2 14B folder)",
    )


def add_chunked_runtime_args(p: argparse.ArgumentParser, vae_tile: str):
    """The cache, memory, device and encoder flags of the chunked models' commands (`fast`, `play`)."""
    p.add_argument(
        "--kv_dtype",
        choices=KV_DTYPES,
        default="bf16",
        help="attention cache dtype: fp8 (float8 e4m3) halves it, at some cost in accuracy",
    )
    p.add_argument(
        "--swap_blocks",
        default="0",
        help="DiT blocks kept in pinned host RAM and streamed to the GPU (0..num_layers, 'auto' = all)",
    )
    p.add_argument("--quantize", action="store_true", help="quantize a bf16/fp32 model to NF4 while loading")
    p.add_argument("--compile", action="store_true", help=CHUNK_COMPILE_HELP)
    p.add_argument(
        "--camera_cache",
        choices=tuple(AUTO_ON_OFF),
        default="auto",
        help="make each DiT block's camera injection once per chunk and keep it for the chunk's 5 forwards "
        "(the same values, a fifth of the camera layers' work) at the cost of its memory: 2 x layers x a chunk's "
        "tokens x dim in bf16 (1.0 GiB for the v2 1.3B at 480p, 4.6 GiB for the 14B); auto: on where the memory "
        "plan fits it, off with --swap_blocks",
    )
    add_attention_arg(p)
    add_fp8_arg(p)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    add_text_encoder_args(p)
    p.add_argument(
        "--vae_tile",
        default=vae_tile,
        help=f"VAE tiles: 'auto', 'none' or H,W in latent pixels (default {vae_tile})",
    )
    add_vae_dtype_arg(p)


def add_decode_device_arg(p: argparse.ArgumentParser) -> None:
    """--decode_device of the chunked models' commands (`fast`, `play`)."""
    p.add_argument(
        "--decode_device",
        help="run the VAE (the decode) on this device, e.g. cuda:1, while --device's GPU makes the next chunk "
        "(default: --device, where the decode overlaps the next chunk if the memory check finds room for both)",
    )


def resolve_decode_device(args):
    """--decode_device checked before anything loads (None: not given)."""
    return None if args.decode_device is None else resolve_device(args.decode_device, "--decode_device")


def add_fast_args(p: argparse.ArgumentParser):
    add_chunked_model_args(p)
    p.add_argument("--image", type=Path, required=True, help="the first frame")
    p.add_argument(
        "--prompt", type=utf8_text, required=True, help="no negative prompt: Fast runs without CFG"
    )
    p.add_argument(
        "--keys", metavar="FILE|-", help="steer with act2cam keys, one line per chunk ('-': stdin)"
    )
    p.add_argument(
        "--action_path",
        type=Path,
        help="folder with poses.npy + intrinsics.npy (with --keys: only its intrinsics.npy)",
    )
    p.add_argument("--action_string", help="act2cam keys for the whole clip, e.g. 'w-10,iw-15,none-10'")
    p.add_argument(
        "--allow_act2cam", action="store_true", help="drive the Cam model from wasd/ijkl_action.npy"
    )
    add_preset_args(p, "--camera_preset")
    p.add_argument("--size", type=parse_size, default=DEFAULTS.max_area, help="max pixel area, e.g. 480*832")
    p.add_argument(
        "--frame_num",
        type=int,
        default=None,
        help=f"video frames (default {DEFAULTS.frame_num}, at most {max_frame_num(3)} for v1 Fast, "
        f"{max_frame_num(4)} for v2); rounded down to whole chunks (v1 Fast: 3 latent frames, 81 -> 81, "
        "161 -> 153; v2: 4, 81 -> 77); with --keys - the most the clip may run",
    )
    add_seed_arg(p)
    p.add_argument(
        "--sample_shift",
        type=float,
        help="timestep shift (default: the model's; v1 Fast and v2 14B 10, v2 1.3B 5)",
    )
    p.add_argument(
        "--local_attn_size",
        type=int,
        help="latent frames the attention cache keeps, sink included; -1: all (default: the model's "
        "documented run; v1 Fast -1, v2 18)",
    )
    p.add_argument(
        "--sink_size",
        type=int,
        help="latent frames at the start the window never evicts (needs a --local_attn_size window; "
        "default: the model's; v1 Fast 0, v2 6)",
    )
    add_chunked_runtime_args(p, vae_tile="auto")
    add_decode_device_arg(p)
    p.add_argument(
        "--output", "--save_file", dest="output", type=Path, help="MP4 path (default: outputs/...)"
    )
    p.add_argument("--frames_dir", type=Path, help="also write each chunk's frames as PNGs here as they come")
    p.add_argument("--overwrite", action="store_true", help="replace --output (and --frames_dir PNGs)")
    p.add_argument("--report", type=Path, help="also write the per-phase time/memory table as JSON here")
    p.add_argument("--save_latent", type=Path, help="also save the latent for ComfyUI's Load Latent node")
    add_parallel_args(p, "fast", CHUNKED_HEADS)


def fast_camera(args, files, image, size, device):
    """(whole-path camera or None, KeySteering or None, key rows of a --keys file or None, video frames)."""
    requested = args.frame_num if args.frame_num is not None else DEFAULTS.frame_num
    chunk = files.kind.chunk_frames
    if args.keys is None:
        cam_input = camera_input(args, image.shape[1:])
        if cam_input is None:
            return None, None, None, fast_frame_num(requested, chunk)
        cam, frames = fast_run.camera_tensor(
            cam_input, files.control_type, args.frame_num, size, device, chunk
        )
        return cam, None, None, frames
    if args.camera_preset or args.action_string or args.allow_act2cam:
        raise ValueError("--keys steers the camera: give no --action_string/--camera_preset/--allow_act2cam")
    if files.control_type != "cam":
        raise ValueError(
            f"--keys: act2cam keys drive the Cam model; this model's control type is {files.control_type}"
        )
    folder = args.action_path and camera_files.load_camera_dir(args.action_path, require_poses=False)
    intrinsics = folder["intrinsics"] if folder else fast_run.steering_intrinsics(None, size, args.camera_fov)
    steering = KeySteering(size, intrinsics, device=device, chunk=chunk)
    frames = fast_frame_num(requested, chunk)
    rows = None
    if args.keys != "-":
        rows = fast_run.read_keys_file(args.keys)
        chunks = min(len(rows), fast_latent_frames(frames, chunk) // chunk)
        if len(rows) > chunks:
            print(f"--keys: {len(rows)} lines, {chunks} chunks fit {frames} frames; the rest is not used")
        rows, frames = rows[:chunks], (chunks * chunk - 1) * 4 + 1
    return None, steering, rows, frames


def check_heads(ranks: int, num_heads: int) -> None:
    """--ulysses_size against the model's heads (a size below 1 is refused where it is read)."""
    issue = parallel.heads_issue(ranks, num_heads) if ranks >= 1 else None
    if issue is not None:
        raise ValueError(f"--{issue}")


def chunked_ranks(args, files, command: str) -> int:
    """The sequence-parallel ranks a chunked command (`fast`, `play`) asks for (--ulysses_size, or --parallel
    auto: torchrun's world), checked against the model's heads before the process group starts."""
    asked = int(os.environ.get("WORLD_SIZE", "1")) if args.parallel == "auto" else args.ulysses_size
    check_heads(asked, files.config.num_heads)
    return distributed.requested_size(args.ulysses_size, args.parallel, command)


def run_fast(args) -> int:
    """`fast`; under torchrun with --ulysses_size N (or --parallel auto) every rank runs the chunk loop's
    forwards on its share of the tokens and rank 0 alone encodes the text and the first frame, decodes and
    writes (as `generate`), on --decode_device where given."""
    decode_device = resolve_decode_device(args)
    output = check_outputs(args, "lingbot_fast")
    files = chunked.check_files(args.ckpt_dir, args.model, args.assets_dir)
    ranks = chunked_ranks(args, files, "fast")
    with distributed.process_group(ranks, str(resolve_device(args.device))) as device:
        return _run_fast(args, files, torch.device(device), ranks, output, decode_device)


def _run_fast(args, files, device, ranks, output, decode_device=None) -> int:
    lead = distributed.rank() == 0  # encodes the text and the first frame, decodes, reports and writes
    # the VAE's device (the first-frame encode, each chunk's decode): rank 0's alone decodes
    vae_device = decode_device if lead and decode_device is not None else device
    quantize = load_quantize(args, device)
    check_attention(args, device)
    if args.keys == "-" and ranks > 1:
        raise ValueError("--keys -: stdin reaches rank 0 alone; under sequence parallel give a keys file")
    chunk, title = files.kind.chunk_frames, KINDS[files.kind.name].title
    tile = vae_tile(args.vae_tile)
    decode_dtype(args.vae_dtype, vae_device)
    config, swap = chunked.settings(
        files.kind,
        files.config.num_layers,
        args.sample_shift,
        i2v.resolve_seed(args.seed),
        args.local_attn_size,
        args.sink_size,
        args.kv_dtype,
        args.swap_blocks,
        args.frame_num,
        compile=args.compile,
        attention=args.attention,
        camera_cache=AUTO_ON_OFF[args.camera_cache],
        fp8_accum=fp8_accum(args),
    )
    image = load_image(args.image)
    size = plan_size(image.shape[1:], args.size)
    cam, steering, rows, frames = fast_camera(args, files, image, size, device)
    if cam is None and steering is None:  # no camera: no injections to keep, nor memory to plan for them
        config = dataclasses.replace(config, camera_cache=False)
    lat_f, (lat_h, lat_w, h, w) = fast_latent_frames(frames, chunk), size
    if args.frame_num is not None and frames != args.frame_num and lead:
        print(
            f"frames: {args.frame_num} asked, {frames} made ({lat_f} latent frames, whole chunks of {chunk})"
        )
    # apart: no VAE beside the DiT (on a decode device of its own, or none: the other ranks never load it)
    lat_shape, apart = (lat_f, lat_h, lat_w), not lead or not fast_run.same_device(device, vae_device)
    # on each GPU: the overlap of a chunk's decode and the next chunk's DiT decided where it is left to the plan
    loading = (quantize, swap, tile, args.vae_dtype)  # the planner's view of the run, beside its config
    overlap, config = fast_run.check_devices(
        files,
        lat_shape,
        config,
        *loading,
        device,
        vae_device if lead else None,
        memplan.free_memory,
        ranks=ranks,
    )  # the camera cache decided too
    free = generate.machine_memory(device)  # (None, None) off CUDA
    need = fast_run.fast_memory(
        files, lat_shape, config, *loading, ranks=ranks, budget=free[0], **fast_run.vae_where(apart, overlap)
    )
    if lead:
        decoding = ""
        if apart:
            budget = generate.machine_memory(vae_device)[0]
            vae_peak = fast_run.decode_memory(lat_shape, chunk, tile, args.vae_dtype, budget)
            decoding = f"; the VAE on {vae_device}, predicted peak {vae_peak / memplan.GIB:.1f} GiB"
        if overlap:
            decoding += "; each chunk decodes while the next one is made"
        print(
            f"{title}: {lat_f // chunk} chunks, {frames} frames at {h}*{w}, window {config.local_attn_size} / sink "
            f"{config.sink_size}, shift {config.shift:g}; {fast_run.caches_label(config)} up to "
            f"{need.caches / memplan.GIB:.2f} "
            f"GiB, predicted peak {need.peak / memplan.GIB:.1f} GiB (host RAM {need.ram / memplan.GIB:.1f} GiB)"
            + decoding
        )
    # each chunk's frames go into the MP4 as they come: RAM holds a chunk, not the clip (rank 0 alone writes)
    writer = video.Mp4Writer(output, fps=fast_run.REAL_TIME_FPS, overwrite=args.overwrite) if lead else None
    sink = fast_run.FrameSink(args.frames_dir, args.overwrite, writer) if lead else None
    log = monitor.PhaseLog()
    hooks = pipeline.Hooks(phase=log.phase)
    try:
        try:
            job = chunked.Chunks(image, size, frames, config, None, device, hooks, None, vae_device, overlap)
            _fast(args, files, job, tile, swap, cam, steering, rows, sink)
        except torch.OutOfMemoryError:
            error = memplan.oom_error(hooks.current, None)
        except KeyboardInterrupt:
            if sink is not None and sink.dir is not None and sink.count:
                print(f"{sink.count} frames were written to {sink.dir} before the interrupt", file=sys.stderr)
            raise
        else:
            error = None
        if error is not None:  # outside the handler: the failed step's tensors are gone
            monitor.free_memory()
            raise error
        if not lead:  # the others' part ends with the last chunk
            return 0
        with hooks.in_phase("write_mp4"):
            writer.close()
    finally:
        if writer is not None:
            writer.abort()  # no partial MP4 (nothing to do once closed)
    print(log.table())
    print(f"wrote {output} ({sink.count} frames, {h}*{w}, {fast_run.REAL_TIME_FPS} fps, seed {config.seed})")
    write_report(args.report, log)
    return 0


def write_report(path: Path | None, log: monitor.PhaseLog) -> None:
    """--report: the phase table as JSON, written whole or not at all (the video is already written)."""
    if path:
        video.write_atomic(path, json.dumps([r.as_dict() for r in log.records], indent=1).encode(), True)


def _fast(args, files, job, tile, swap, cam, steering, rows, sink):
    """The chunk loop of `job` (its cameras and on_chunk filled in here); `sink` None: a rank other than 0 of a
    sequence-parallel run (it receives the text and the condition from rank 0, runs its share of every forward
    and decodes nothing)."""
    config, device = job.config, job.device
    if steering is None:
        cameras = fast_run.whole_path_cameras(cam, config.chunk_frames)
    else:
        cameras = fast_run.steered_cameras(fast_run.stdin_keys() if rows is None else rows, steering)

    def on_chunk(chunk, frames_out, timing):
        sink.add(frames_out)
        print(timing.line(), flush=True)

    latent, made = chunked.run_files(
        files,
        args.prompt,
        dataclasses.replace(job, cameras=cameras, on_chunk=on_chunk),
        t5_mode=args.t5_mode,
        t5_device="cpu" if args.t5_cpu else str(device),
        quantize=load_quantize(args),
        swap=swap,
        tile=tile,
        save_latent=args.save_latent,
        overwrite=args.overwrite,
        decode_dtype=decode_dtype(args.vae_dtype, job.vae_device),
        ranks=parallel.world_size(),
    )
    if not made:
        raise ValueError("--keys: no key line arrived; nothing was generated")
    return latent


PLAY_HELP = """Play a chunked model (v1 Fast, v2 14B, v2 1.3B) live: a page on http://127.0.0.1:PORT/ shows the
picture as each latent frame decodes, with a HUD (FPS as played, seconds per chunk, key->pixel latency, VRAM).
Keys: W/A/S/D move, Shift runs, Q/E down/up, arrows look, drag the picture to look, R restarts from the image.
--mode history (default): each key press lands in the latent frame in which it happened; hold: the keys held
when a chunk starts act from its first frame. The first tab controls the session, later ones watch; closing
the controlling tab (or Stop, or Ctrl-C) ends it and frees the GPU. A rollout restarts from the image by
itself when the RoPE table's length is reached. Play needs an attention window (v2's documented 18 / 6;
v1 Fast, documented unbounded, plays at 18 / 6 too).

--record out.mp4 writes what was played and out_camera/ (poses.npy + intrinsics.npy per played video
frame; out_camera_2/ ... for later rollouts), which `generate` and `fast` replay with --action_path.

Several GPUs of one host: `torchrun --nproc_per_node N lingbot.py play ... --ulysses_size N` (or --parallel
auto): rank 0 serves the page, encodes and decodes; every rank runs its share of each chunk's DiT.
"""


def add_play_args(p: argparse.ArgumentParser):
    add_chunked_model_args(p)
    p.add_argument("--image", type=Path, required=True, help="the first frame (and every restart's)")
    p.add_argument("--prompt", type=utf8_text, required=True, help="the scene (changeable from the page)")
    p.add_argument("--port", type=int, default=8765, help="TCP port of the page (default 8765)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only; another opens the GPU to others)",
    )
    p.add_argument("--mode", choices=("history", "hold"), default="history", help="how key timing is read")
    p.add_argument("--record", type=Path, help="also write the played MP4 here, and its camera folder(s)")
    p.add_argument("--overwrite", action="store_true", help="replace --record's files")
    p.add_argument("--size", type=parse_size, default=DEFAULTS.max_area, help="max pixel area, e.g. 480*832")
    add_seed_arg(p)
    p.add_argument("--sample_shift", type=float, help="timestep shift (default: the model's)")
    p.add_argument("--local_attn_size", type=int, help="attention window in latent frames, sink included")
    p.add_argument("--sink_size", type=int, help="latent frames at the start the window keeps")
    add_chunked_runtime_args(p, vae_tile="none")
    add_decode_device_arg(p)
    add_parallel_args(p, "play", CHUNKED_HEADS)


def run_play(args) -> int:
    """`play`; under torchrun with --ulysses_size N (or --parallel auto) rank 0 serves the page, encodes, steers
    and decodes, and every rank runs its share of each chunk's DiT in lockstep with it (as `fast`)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected 0..65535, got {args.port}")
    decode_device = resolve_decode_device(args)
    requested = resolve_device(args.device)
    load_quantize(args, requested)  # --fp8 on a card without fp8 tensor cores: exit 2 here
    check_attention(args, requested)
    files = chunked.check_files(args.ckpt_dir, args.model, args.assets_dir)
    ranks = chunked_ranks(args, files, "play")
    with distributed.process_group(ranks, str(requested)) as device:
        return _run_play(args, files, torch.device(device), ranks, decode_device)


def _run_play(args, files, device, ranks, decode_device) -> int:
    from .session import play, play_server

    lead = distributed.rank() == 0  # serves the page, encodes, steers and decodes
    warning = play_server.host_warning(args.host)
    if warning and lead:
        print(warning, file=sys.stderr, flush=True)
    image = load_image(args.image)
    session = play.PlaySession(
        files,
        device,
        seed=i2v.resolve_seed(args.seed),
        shift=args.sample_shift,
        local_attn_size=args.local_attn_size,
        sink_size=args.sink_size,
        kv_dtype=args.kv_dtype,
        compile=args.compile,
        attention=args.attention,
        camera_cache=AUTO_ON_OFF[args.camera_cache],
        fp8_accum=fp8_accum(args),
        quantize=load_quantize(args, device),
        swap=chunked.resolve_swap_blocks(args.swap_blocks, files.config.num_layers),
        tile=vae_tile(args.vae_tile),
        vae_dtype=args.vae_dtype,
        area=args.size,
        mode=args.mode,
        t5_mode=args.t5_mode,
        t5_device="cpu" if args.t5_cpu else None,
        decode_device=decode_device,
        ranks=ranks,
    )
    recorder = None
    try:
        try:
            session.lat_shape(image)
        except ValueError as err:
            raise ValueError(f"--size: {err}") from None
        session.check_memory(image)
        if not lead:
            with sigint_ignored():  # Ctrl-C reaches every rank: rank 0 finishes the chunk and says stop
                session.follow()
            return 0
        if args.record:
            inputs = [
                ("--ckpt_dir", args.ckpt_dir),
                ("--image", args.image),
                ("--assets_dir", args.assets_dir),
            ]
            video.check_output(args.record, args.overwrite, inputs)
            recorder = play.PlayRecorder(args.record, args.overwrite)
        server = play_server.PlayServer(
            session, image, args.prompt, args.host, args.port, record=recorder and recorder.add
        )
        stats = server.serve(on_bound=play_server.announce)
    except BaseException:
        session.close()  # under sequence parallel: the others are told to stop
        if recorder is not None:
            recorder.abort()
        raise
    print(f"play ended ({server.end_reason}): {json.dumps(stats)}")
    if recorder is not None:
        folders = recorder.close(session)
        print(f"wrote {recorder.path} ({recorder.frames} frames, {fast_run.REAL_TIME_FPS} fps)")
        for folder, frames in folders:
            print(f"wrote {folder} ({frames} poses): replay with --action_path {folder} --frame_num {frames}")
    return 0


def run_camera(args) -> int:
    """`camera`: a preset (saved and/or drawn) or a pose folder / act2cam keys (drawn)."""
    if bool(args.camera_preset) == bool(args.action_path):
        raise ValueError("camera: give --preset TEXT or --action_path DIR")
    if args.action_string and not args.action_path:
        raise ValueError("--action_string needs --action_path (for intrinsics.npy, as upstream)")
    if args.frames is not None and args.frames > MAX_FRAMES:  # a pose folder would quietly cap it
        raise RequestError("frame_num", f"at most {MAX_FRAMES} frames (100 s at 16 fps), got {args.frames}")
    saved = (
        [args.save / n for n in ("poses.npy", "intrinsics.npy")] if args.save and args.save.is_dir() else []
    )
    for path in saved + ([args.preview] if args.preview else []):
        video.check_output(path, args.overwrite, [("--action_path", args.action_path)])
    if args.camera_preset:
        cam, built = camera_authoring.preset_camera(
            args.camera_preset, args.frames, args.camera_speed, args.size, args.camera_fov
        )
        title = f"preset: {built.description}"
        if args.save:
            camera_authoring.save_camera_dir(args.save, built.poses, built.intrinsics, args.overwrite)
            print(f"wrote {args.save}/poses.npy and intrinsics.npy ({built.frame_num} poses)")
    else:
        if args.save:
            raise ValueError("--save writes a preset; a pose folder is already saved")
        cam = camera_files.CameraInput.from_dir(args.action_path, args.action_string)
        title = f"{args.action_path}" + (f" keys {args.action_string}" if args.action_string else "")
    poses, intrinsics = camera_authoring.camera_path_arrays(cam, args.frames)
    print(camera_authoring.describe_path(poses, intrinsics))
    if args.preview:
        camera_preview.save_png(camera_preview.render_path(poses, intrinsics, title=title), args.preview)
        print(f"wrote {args.preview}")
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: models released, children stopped, no partial file."""


def _on_sigterm(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises `Terminated` in the block, which `main` ends like Ctrl-C (exit 143). Only the CLI's own
    entry (lingbot.py, the `lingbot-world` script) installs it: `main` called as a library leaves the signal
    to its caller, so a test runner that gets SIGTERM still stops."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigint_ignored():
    """Ctrl-C ignored in the block (a follower rank of `play`, which rank 0 stops); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Argument shapes argparse cannot express; reported the argparse way (usage, `error:`, exit 2)."""
    if getattr(args, "t5_overlap", None) == "on":
        if args.t5_mode != "subprocess":
            parser.error("argument --t5_overlap on: needs --t5_mode subprocess (the encoder's own process)")
        ranks = int(os.environ.get("WORLD_SIZE", "1")) if args.parallel == "auto" else args.ulysses_size
        if ranks > 1:
            parser.error(
                "argument --t5_overlap on: not with sequence parallel (rank 0 encodes the text alone)"
            )
    preset = getattr(args, "camera_preset", None)
    if preset is not None and not preset.strip():
        flag = "--preset" if args.command == "camera" else "--camera_preset"
        parser.error(
            f"argument {flag}: empty; give a path such as 'pan left 30 40f ease', or leave {flag} out"
        )
    for flag in ("guide_scale", "cache_threshold"):
        values = getattr(args, flag, None)
        if values is not None and len(values) > 2:
            parser.error(
                f"argument --{flag}: takes one or two values (low-noise high-noise), got {len(values)}"
            )


def main(argv=None) -> int:
    # Fewer fragmented gigabytes at 720p; read when CUDA first allocates, so set it before that.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        import_runtime()
    except KeyboardInterrupt as err:
        print("interrupted while starting", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    if getattr(args, "device", "") is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if args.command == "demo":
            return run_demo(args)
        if args.command == "camera":
            return run_camera(args)
        if args.command == "quantize":
            return run_quantize(args)
        if args.command == "fast":
            return run_fast(args)
        if args.command == "play":
            return run_play(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "doctor":
            from .session import doctor

            return doctor.main(args.ckpt_dir, args.device, args.assets_dir)
        return run_generate(args)
    except Terminated:
        print("terminated: models released, no output written", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted: models released, no output written", file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:  # bad input: files, arrays, arguments
        print(f"error: {flag_message(err, args.command)}", file=sys.stderr)
        return 2
    except (text_encode.EncoderProcessError, distributed.PeerLost) as err:  # no traceback: the cause is said
        print(f"error: {err}", file=sys.stderr)
        return 1
