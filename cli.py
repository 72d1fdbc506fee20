"""Command line: the same generation flow as the ComfyUI nodes, headless.

    python lingbot.py generate --ckpt_dir CKPT --image in.jpg --prompt "..." --action_path examples/00
    python lingbot.py demo          # tiny random checkpoints, CPU, no downloads
    python lingbot.py fast --ckpt_dir lingbot-world-base-cam --image in.jpg --prompt "..." --keys -
    python lingbot.py quantize CKPT/lingbot_world_fast CKPT/lingbot_world_fast_nf4   # fp32 -> NF4 folder
    python lingbot.py camera --preset "orbit left 30 + dolly in 1 40f ease" --save DIR --preview path.png

Option names follow upstream's generate.py (and the NF4 repack's generate_prequant.py); both
spellings are accepted where they differ.
"""

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from .loaders import (
    camera_authoring,
    camera_files,
    camera_preview,
    checkpoints,
    demo_assets,
    distributed,
    fast_run,
    monitor,
    stream,
    text_encode,
    video,
)
from .loaders import planner as memplan
from .loaders.experts import ExpertSwitcher
from .loaders.fast_checkpoint import resolve_fast_dir
from .loaders.latent_file import save_comfy_latent
from .loaders.lora import LoraSpec, parse_lora_spec
from .loaders.request import MAX_FRAMES, RequestError, check_lora_merge, check_text_dim, plan_request
from .loaders.text_encoder import read_encoder_config
from .loaders.vae import check_vae, load_vae
from .wan import i2v, pipeline
from .wan.block_swap import resolve_swap_blocks
from .wan.config import SampleConfig
from .wan.fast import (
    CHUNK_FRAMES,
    FastConfig,
    FastSession,
    fast_frame_num,
    fast_latent_frames,
)
from .wan.fast_camera import KeySteering
from .wan.speed import SpeedOptions, SpeedStats

ROOT = Path(__file__).resolve().parent
DEFAULTS = SampleConfig()


def parse_size(text: str) -> int:
    try:
        return i2v.parse_max_area(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--size: {err}") from None


def parse_lora(text: str) -> LoraSpec:
    try:
        return parse_lora_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def utf8_text(text: str) -> str:
    """A text argument that can be encoded: bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text (a byte that is not UTF-8 at character {err.start}); expected UTF-8 text"
        ) from None
    return text


def add_generate_args(p: argparse.ArgumentParser):
    p.add_argument("--ckpt_dir", type=Path, required=True, help="upstream layout or the NF4 repack layout")
    p.add_argument("--image", type=Path, required=True)
    p.add_argument("--prompt", type=utf8_text, required=True)
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
    p.add_argument("--size", type=parse_size, default=DEFAULTS.max_area, help="max pixel area, e.g. 480*832")
    p.add_argument("--frame_num", type=int, default=None, help=f"4n+1 frames (default {DEFAULTS.frame_num})")
    p.add_argument(
        "--sampling_steps", "--sample_steps", dest="steps", type=int, default=DEFAULTS.sample_steps
    )
    p.add_argument("--sample_shift", type=float, default=DEFAULTS.sample_shift)
    p.add_argument("--boundary", type=float, default=DEFAULTS.boundary)
    p.add_argument(
        "--guide_scale",
        "--sample_guide_scale",
        dest="guide_scale",
        type=float,
        nargs="+",
        default=list(DEFAULTS.guide_scale),
        help="one value, or two: low-noise high-noise",
    )
    p.add_argument("--seed", "--base_seed", dest="seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--solver", "--sample_solver", dest="solver", choices=["unipc", "euler"], default="unipc")
    p.add_argument("--fps", type=int, default=DEFAULTS.sample_fps)
    p.add_argument(
        "--output", "--save_file", dest="output", type=Path, help="MP4 path (default: outputs/...)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    p.add_argument("--t5_mode", choices=["subprocess", "inprocess"], default="subprocess")
    p.add_argument("--t5_cpu", action="store_true", help="run the text encoder on the CPU")
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
    p.add_argument(
        "--swap_blocks",
        default="0",
        help="DiT blocks of the resident expert kept in pinned host RAM and streamed to the GPU block by "
        "block (0..num_layers, or 'auto'); less VRAM, identical results",
    )
    p.add_argument(
        "--ulysses_size",
        type=int,
        default=1,
        help="sequence parallel over N GPUs (N divides the 40 heads): launch with "
        "`torchrun --nproc_per_node N lingbot.py generate ... --ulysses_size N`",
    )
    p.add_argument(
        "--parallel",
        choices=["none", "auto"],
        default="none",
        help="'auto': sequence parallel over every process torchrun started (its world size)",
    )
    speed = p.add_argument_group("speed (every option off: upstream's exact computation)")
    speed.add_argument(
        "--attention",
        default="sdpa",
        choices=["sdpa", "sage"],
        help="attention kernel: PyTorch SDPA, or SageAttention (needs the sageattention package)",
    )
    speed.add_argument(
        "--compile", action="store_true", help="torch.compile the DiT blocks (one graph for all)"
    )
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
    speed.add_argument(
        "--cache_threshold",
        type=float,
        nargs="+",
        default=[SpeedOptions.cache_threshold],
        help="EasyCache threshold, one value or two (low-noise high-noise); 0 = never skip",
    )
    speed.add_argument(
        "--cache_keep_first",
        type=int,
        default=SpeedOptions.cache_keep_first,
        help="steps always computed at the start of each expert's stretch",
    )
    speed.add_argument(
        "--cache_keep_last",
        type=int,
        default=SpeedOptions.cache_keep_last,
        help="steps always computed at the end of each expert's stretch",
    )
    p.add_argument("--report", type=Path, help="also write the per-phase time/memory table as JSON here")
    p.add_argument(
        "--save_latent",
        type=Path,
        help="also save the final latent for ComfyUI's Load Latent node (.latent, safetensors)",
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
        default=camera_authoring.DEFAULT_HFOV_DEG,
        help="preset's horizontal field of view in degrees",
    )


def parse_hw(text: str) -> tuple[int, int]:
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
            description=camera_authoring.PRESET_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    add_generate_args(
        sub.add_parser("plan", help="the generate arguments -> each phase's predicted peak VRAM/RAM")
    )
    doctor = sub.add_parser(
        "doctor", help="check the GPU, libraries and (with --ckpt_dir) the checkpoint files"
    )
    doctor.add_argument("--ckpt_dir", type=Path, help="also validate every checkpoint file from its headers")
    doctor.add_argument("--device", default="cuda", help="the CUDA device to check")
    quantize = sub.add_parser(
        "quantize",
        help="a bf16/fp32 expert (e.g. lingbot_world_fast/) -> an NF4 folder that loads in seconds",
    )
    quantize.add_argument(
        "src",
        type=Path,
        help="expert folder or file: lingbot_world_fast/ (or the base-cam folder holding it), "
        "high_noise_model/, a single .safetensors; fp32 or bf16, sharded or not",
    )
    quantize.add_argument("dst", type=Path, help="the NF4 folder to write (e.g. .../lingbot_world_fast_nf4)")
    quantize.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    quantize.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to quantize (cuda is much faster)",
    )
    add_fast_args(
        sub.add_parser(
            "fast",
            help="LingBot-World-Fast: chunk by chunk, 4 steps a chunk, steerable with keys while it runs",
            description=FAST_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    demo = sub.add_parser("demo", help="tiny random checkpoints on the CPU, shipped example, short MP4")
    demo.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lingbot-world-nf4" / "demo")
    demo.add_argument("--output", type=Path, default=None)
    demo.add_argument("--overwrite", action="store_true")
    return parser


LEAN_CHOICES = {"on": True, "off": False, "auto": "auto"}


def speed_options(args) -> SpeedOptions:
    thresholds = args.cache_threshold
    return SpeedOptions(
        attention=args.attention,
        compile=args.compile,
        cache=None if args.cache == "none" else args.cache,
        cache_threshold=thresholds[0] if len(thresholds) == 1 else (thresholds[0], thresholds[-1]),
        cache_keep_first=args.cache_keep_first,
        cache_keep_last=args.cache_keep_last,
        lean_activations=LEAN_CHOICES[getattr(args, "lean_activations", "auto")],
    )


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


def resolve_device(text: str) -> torch.device:
    """--device, checked before anything loads: cpu, cuda or cuda:N on a machine that has it."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: only cpu and cuda are supported, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {text}: CUDA is not available to this PyTorch ({torch.__version__}); "
                "use --device cpu or install a CUDA build of PyTorch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {text}: this machine has {count} CUDA device(s) (cuda:0..{count - 1})"
            )
    return device


def default_output(stem: str) -> Path:
    out = Path("outputs")
    out.mkdir(exist_ok=True)
    base = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{base}.mp4", 1
    while path.exists():
        path, n = out / f"{base}-{n}.mp4", n + 1
    return path


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
    return camera_files.CameraInput.from_dir(args.action_path, args.action_string, args.allow_act2cam)


def load_image(path: Path) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"--image: {path} not found")
    try:
        with Image.open(path) as img:
            img.load()  # decode here: a truncated or damaged file fails now, not inside the conversion
            return i2v.image_to_tensor(img)
    except UnidentifiedImageError:
        raise ValueError(f"--image: {path} is not an image PIL can read") from None
    except OSError as err:
        raise ValueError(
            f"--image: {path} cannot be decoded ({err}); expected a complete image file"
        ) from None
    except ValueError as err:
        raise ValueError(f"--image: {path}: {err}") from None


def vae_tile(text: str):
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        th, tw = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--vae_tile must be 'auto', 'none' or H,W in latent pixels, got {text!r}") from None
    return (th, tw)


def memory_check(args, files, tile, device, free=True) -> memplan.MemoryCheck:
    """The planner's inputs from the generate arguments; `free`: check against the device's free memory."""
    request = memplan.MemoryRequest(
        expert_bytes={e: source.nbytes for e, source in files.sources.items()},
        lora_bytes=memplan.lora_bytes(args.lora),
        swap_blocks=getattr(args, "swap_blocks", 0),
        vae_tile=tile,
        t5_mode=args.t5_mode,
        t5_device="cpu" if args.t5_cpu else device.type,
        t5_bytes=files.text_encoder.stat().st_size,
        t5_overlap={"on": True, "off": False}.get(args.t5_overlap, "auto"),
    )
    vram, ram = memplan.free_memory(device) if free and device.type == "cuda" else (None, None)
    if ram is not None:
        ram += memplan.PROCESS_RAM  # this process's own share is already in the plan's figures
    return memplan.MemoryCheck(request, device.type, vram, free_ram=ram)


def prepare_generate(args, check_memory: bool = True, planning: bool = False):
    """Everything a user can get wrong, checked before any model loads, memory included. `planning`: for
    `plan`, which starts no ranks: --ulysses_size N is planned for N ranks without a process group."""
    device = resolve_device(args.device)
    files = checkpoints.resolve_checkpoint_dir(args.ckpt_dir.expanduser().resolve())
    text_dim = read_encoder_config(files.text_encoder)["dim"]
    experts = " and ".join(str(files.experts[e]) for e in ("high", "low"))
    check_text_dim(text_dim, files.config, files.text_encoder, experts)
    check_vae(files.vae)
    if getattr(args, "lora_merge", False):
        check_lora_merge(files.sources, args.quantize, args.lora)
    tile = vae_tile(args.vae_tile)
    image = load_image(args.image)
    cam_input = camera_input(args, image.shape[1:])
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
        image.shape[1:],
        files.config,
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


def run_plan(args) -> int:
    """`plan`: the table of predicted peaks; on a GPU, whether it fits the free memory (exit 2 if not)."""
    if args.parallel == "auto":
        args.ulysses_size = distributed.requested_size(args.ulysses_size, args.parallel)
    device, files, tile, _, plan = prepare_generate(args, check_memory=False, planning=True)
    if device.type != "cuda":
        print(plan.memory.table())
        print("(VRAM figures are for a CUDA device; on the CPU everything lives in RAM)")
        return 0
    check = memory_check(args, files, tile, device)
    try:  # the plan for this card's free memory: its 'auto' settings as the run would resolve them
        fitted = check.run(plan.memory.planner)
    except memplan.MemoryPlanError:
        print(plan.memory.table())
        raise  # exit 2 with the settings that fit
    print(fitted.table())
    print(f"fits: {check.free_vram / memplan.GIB:.1f} GiB of VRAM free on {device}")
    return 0


def run_generate(args) -> int:
    args.ranks = distributed.requested_size(args.ulysses_size, args.parallel)
    with distributed.process_group(args.ranks, args.device) as args.device:
        return _run_generate(args)


def _run_generate(args) -> int:
    output = video.check_output(args.output or default_output("lingbot"), args.overwrite)
    if args.report:
        video.check_output(args.report, overwrite=True)
    if args.save_latent:
        video.check_output(args.save_latent, args.overwrite)
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
    enc_tile = dec_tile = tile
    if tile == "auto" and plan.memory is not None and plan.memory.budget is not None:
        enc_tile, dec_tile = plan.memory.encode_tile, plan.memory.vae_tile  # the tiles the plan checked
    if lead:
        print(plan.memory.table())
    phase = hooks.in_phase

    # guide scale 1 throughout runs no CFG: the negative prompt is never used, so it is not encoded
    prompts = [args.prompt, args.n_prompt or settings.negative_prompt][: 2 if plan.needs_negative else 1]
    encode = functools.partial(
        text_encode.encode_prompts,
        files.text_encoder,
        prompts,
        tokenizer_path=files.tokenizer,
        mode=args.t5_mode,
        device="cpu" if args.t5_cpu else str(device),
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
            quantize=args.quantize or None,
            loras=plan.loras,
            swap_blocks=plan.swap_blocks,
            merge_loras=args.lora_merge,
        )
        stats = SpeedStats()
        bar = tqdm(total=settings.sample_steps, desc="denoising", unit="step", disable=not lead)
        hooks.progress = lambda i, n, latent: bar.update(1)
        try:
            # --vae_tile applies to the first-frame encode too (pipeline.sample only calls vae.encode)
            encoder = SimpleNamespace(encode=functools.partial(vae.encode, tile=enc_tile)) if lead else None
            latent = pipeline.sample(
                vae=encoder,
                experts=switcher,
                release_experts=switcher.close,
                hooks=hooks,
                stats=stats,
                **inputs,
            )
        finally:
            bar.close()
            switcher.close()
        del inputs
    if background is not None:
        log.add_background("text_encode", background.seconds)
        print(
            f"text encoder: {background.seconds:.1f} s in the background; the run waited {background.waited:.1f} s"
        )
    if not lead:  # the others' part ends with the last step
        return 0
    if args.save_latent:
        save_comfy_latent(vae.to_comfy_latent(latent), args.save_latent, args.overwrite)
    hooks.check()
    with phase("vae_decode"):
        frames = vae.decode(latent, tile=dec_tile)
    with phase("write_mp4"):
        video.write_mp4(
            pipeline.frames_to_uint8(frames), output, fps=settings.sample_fps, overwrite=args.overwrite
        )
    print(log.table())
    print(stats.summary())
    if args.report:
        args.report.write_text(json.dumps([r.as_dict() for r in log.records], indent=1))
    print(
        f"wrote {output} ({plan.frame_num} frames, {w}x{h}, {settings.sample_fps} fps, seed {settings.seed})"
    )
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
    res = quantize_expert(args.src, args.dst, device, args.overwrite)
    mib = 1 << 20
    vram = f", peak VRAM {res.peak_vram / mib:.0f} MiB" if res.peak_vram is not None else ""
    print(
        f"wrote {res.dst} ({res.tensors} tensors, {res.nbytes / mib:.1f} MiB from {res.source.nbytes / mib:.1f} "
        f"MiB) in {res.seconds:.1f} s on {device}; peak RSS {res.peak_rss / mib:.0f} MiB "
        f"(+{res.rss_growth / mib:.0f} MiB){vram}"
    )
    return 0


FAST_HELP = """LingBot-World-Fast: one causal DiT generates the clip chunk by chunk (3 latent frames = 9 video
frames for the first chunk, 12 for each later one), 4 steps a chunk, no CFG, attending to a cache of
what came before. Frames are decoded and written as each chunk finishes.

--ckpt_dir: the base-cam folder holding lingbot_world_fast/ (or lingbot_world_fast_nf4/ written by
`lingbot.py quantize`), or the Fast model folder itself.

Camera: a whole path up front (--action_path poses, --action_string, --camera_preset), or steered with
--keys FILE / --keys - (stdin): one line per chunk naming the keys held through that chunk's frames,
any of w a s d (move) i j k l (look up/left/down/right), e.g. `w`, `wj`, `none`. Chunk k's camera is
built when chunk k starts, from the keys of chunks 0..k (act2cam's motion at a fixed step; see README).
"""


def add_fast_args(p: argparse.ArgumentParser):
    p.add_argument(
        "--ckpt_dir",
        type=Path,
        required=True,
        help="base-cam folder with lingbot_world_fast/, the Fast folder, or an NF4 folder from `quantize`",
    )
    p.add_argument("--image", type=Path, required=True)
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
        help=f"video frames (default {DEFAULTS.frame_num}); rounded down to whole chunks of 3 latent "
        "frames (81 -> 81, 161 -> 153); with --keys - the most the clip may run",
    )
    p.add_argument("--seed", "--base_seed", dest="seed", type=int, default=FastConfig.seed)
    p.add_argument("--sample_shift", type=float, default=FastConfig.shift)
    p.add_argument(
        "--local_attn_size",
        type=int,
        default=-1,
        help="latent frames the attention cache keeps, sink included (-1: all, upstream's default)",
    )
    p.add_argument(
        "--sink_size", type=int, default=0, help="latent frames at the start the window never evicts"
    )
    p.add_argument(
        "--kv_dtype",
        choices=list(fast_run.KV_DTYPES),
        default="bf16",
        help="attention cache dtype: fp8 (float8 e4m3) halves it, at some cost in accuracy",
    )
    p.add_argument(
        "--swap_blocks",
        default="0",
        help="DiT blocks kept in pinned host RAM and streamed to the GPU (0..num_layers, 'auto' = all)",
    )
    p.add_argument("--quantize", action="store_true", help="quantize a bf16/fp32 model to NF4 while loading")
    p.add_argument(
        "--output", "--save_file", dest="output", type=Path, help="MP4 path (default: outputs/...)"
    )
    p.add_argument("--frames_dir", type=Path, help="also write each chunk's frames as PNGs here as they come")
    p.add_argument("--overwrite", action="store_true", help="replace --output (and --frames_dir PNGs)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--t5_mode", choices=["subprocess", "inprocess"], default="subprocess")
    p.add_argument("--t5_cpu", action="store_true", help="run the text encoder on the CPU")
    p.add_argument("--vae_tile", default="auto", help="VAE tiles: 'auto', 'none' or H,W in latent pixels")
    p.add_argument("--report", type=Path, help="also write the per-phase time/memory table as JSON here")
    p.add_argument("--save_latent", type=Path, help="also save the latent for ComfyUI's Load Latent node")


def fast_camera(args, files, image, size, device):
    """(whole-path camera or None, KeySteering or None, key rows of a --keys file or None, video frames)."""
    requested = args.frame_num if args.frame_num is not None else DEFAULTS.frame_num
    if args.keys is None:
        cam_input = camera_input(args, image.shape[1:])
        if cam_input is None:
            return None, None, None, fast_frame_num(requested)
        cam, frames = fast_run.camera_tensor(cam_input, files.control_type, args.frame_num, size, device)
        return cam, None, None, frames
    if args.camera_preset or args.action_string or args.allow_act2cam:
        raise ValueError("--keys steers the camera: give no --action_string/--camera_preset/--allow_act2cam")
    if files.control_type != "cam":
        raise ValueError(
            f"--keys: act2cam keys drive the Cam model; this model's control type is {files.control_type}"
        )
    folder = args.action_path and camera_files.load_camera_dir(args.action_path, require_poses=False)
    intrinsics = folder["intrinsics"] if folder else fast_run.steering_intrinsics(None, size, args.camera_fov)
    steering = KeySteering(size, intrinsics, device=device)
    frames = fast_frame_num(requested)
    rows = None
    if args.keys != "-":
        rows = fast_run.read_keys_file(args.keys)
        chunks = min(len(rows), fast_latent_frames(frames) // CHUNK_FRAMES)
        if len(rows) > chunks:
            print(f"--keys: {len(rows)} lines, {chunks} chunks fit {frames} frames; the rest is not used")
        rows, frames = rows[:chunks], (chunks * CHUNK_FRAMES - 1) * 4 + 1
    return None, steering, rows, frames


def run_fast(args) -> int:
    output = video.check_output(args.output or default_output("lingbot_fast"), args.overwrite)
    for extra in (args.report, args.save_latent):
        if extra:
            video.check_output(extra, overwrite=args.overwrite or extra == args.report)
    device = resolve_device(args.device)
    files = resolve_fast_dir(args.ckpt_dir.expanduser().resolve())
    check_text_dim(
        read_encoder_config(files.text_encoder)["dim"], files.config, files.text_encoder, files.model
    )
    check_vae(files.vae)
    tile = vae_tile(args.vae_tile)
    config = fast_run.fast_config(
        args.sample_shift,
        i2v.resolve_seed(args.seed),
        args.local_attn_size,
        args.sink_size,
        args.kv_dtype,
    )
    swap = resolve_swap_blocks(args.swap_blocks, files.config.num_layers)
    image = load_image(args.image)
    try:
        size = i2v.latent_size(*image.shape[1:], args.size)
    except ValueError as err:
        raise ValueError(f"--size: {err}") from None
    cam, steering, rows, frames = fast_camera(args, files, image, size, device)
    lat_f, (lat_h, lat_w, h, w) = fast_latent_frames(frames), size
    if args.frame_num is not None and frames != args.frame_num:
        print(
            f"frames: {args.frame_num} asked, {frames} made ({lat_f} latent frames, whole chunks of {CHUNK_FRAMES})"
        )
    need = fast_run.fast_memory(files, (lat_f, lat_h, lat_w), config, args.quantize or None, swap, tile)
    print(
        f"LingBot-World-Fast: {lat_f // CHUNK_FRAMES} chunks, {frames} frames at {w}x{h}; attention caches "
        f"up to {need.caches / memplan.GIB:.2f} GiB, predicted peak {need.peak / memplan.GIB:.1f} GiB"
    )
    if device.type == "cuda":
        issue = fast_run.fast_fit_issue(
            files,
            (lat_f, lat_h, lat_w),
            config,
            args.quantize or None,
            swap,
            memplan.free_memory(device)[0],
            tile,
        )
        if issue is not None:
            raise ValueError(f"memory: {issue}")
    sink = fast_run.FrameSink(args.frames_dir, args.overwrite)
    log = monitor.PhaseLog()
    hooks = pipeline.Hooks(phase=log.phase)
    try:
        _fast(args, files, device, tile, image, size, frames, config, swap, cam, steering, rows, sink, hooks)
    except torch.OutOfMemoryError:
        error = memplan.oom_error(hooks.current, None)
    except KeyboardInterrupt:
        if sink.dir is not None and sink.count:
            print(f"{sink.count} frames were written to {sink.dir} before the interrupt", file=sys.stderr)
        raise
    else:
        error = None
    if error is not None:  # outside the handler: the failed step's tensors are gone
        monitor.free_memory()
        raise error
    with hooks.in_phase("write_mp4"):
        video.write_mp4(sink.video(), output, fps=fast_run.REAL_TIME_FPS, overwrite=args.overwrite)
    print(log.table())
    if args.report:
        args.report.write_text(json.dumps([r.as_dict() for r in log.records], indent=1))
    print(f"wrote {output} ({sink.count} frames, {w}x{h}, {fast_run.REAL_TIME_FPS} fps, seed {config.seed})")
    return 0


def _fast(args, files, device, tile, image, size, frames, config, swap, cam, steering, rows, sink, hooks):
    phase = hooks.in_phase
    with phase("text_encode"):
        (context,) = text_encode.encode_prompts(
            files.text_encoder,
            [args.prompt],
            tokenizer_path=files.tokenizer,
            mode=args.t5_mode,
            device="cpu" if args.t5_cpu else str(device),
        )
    with phase("load_vae"):
        vae = load_vae(files.vae, device)
    with phase("vae_encode"):
        y = fast_run.condition(image, functools.partial(vae.encode, tile=tile), frames, size, device)
    model = fast_run.FastModel(files, device, quantize=args.quantize or None, swap_blocks=swap)
    try:
        with phase("load_model"):
            dit = model()
        lat_shape = (fast_latent_frames(frames), *size[:2])
        session = FastSession(dit, context.to(device), y, lat_shape, config, device, hooks)
        del y
        if steering is None:
            cameras = fast_run.whole_path_cameras(cam)
        else:
            cameras = fast_run.steered_cameras(fast_run.stdin_keys() if rows is None else rows, steering)

        def on_chunk(chunk, frames_out, timing):
            sink.add(frames_out)
            print(timing.line(), flush=True)

        try:
            with phase("chunks"), vae.chunk_decoder(tile) as decoder:
                made = fast_run.run_chunks(session, cameras, decoder, on_chunk)
            if not made:
                raise ValueError("--keys: no key line arrived; nothing was generated")
            latent = session.latent()
        finally:
            session.close()
    finally:
        model.close()
    if args.save_latent:
        save_comfy_latent(vae.to_comfy_latent(latent), args.save_latent, args.overwrite)
    return latent


def run_camera(args) -> int:
    """`camera`: a preset (saved and/or drawn) or a pose folder / act2cam keys (drawn)."""
    if bool(args.camera_preset) == bool(args.action_path):
        raise ValueError("camera: give --preset TEXT or --action_path DIR")
    if args.action_string and not args.action_path:
        raise ValueError("--action_string needs --action_path (for intrinsics.npy, as upstream)")
    if args.frames is not None and args.frames > MAX_FRAMES:  # a pose folder would quietly cap it
        raise RequestError("frame_num", f"at most {MAX_FRAMES} frames (100 s at 16 fps), got {args.frames}")
    for path in (args.save and args.save / "poses.npy", args.preview):
        if path and path.exists() and not args.overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
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
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.command == "demo":
            return run_demo(args)
        if args.command == "camera":
            return run_camera(args)
        if args.command == "quantize":
            return run_quantize(args)
        if args.command == "fast":
            return run_fast(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "doctor":
            from .loaders import doctor

            return doctor.main(args.ckpt_dir, args.device)
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
    except text_encode.EncoderProcessError as err:  # the child's status and last lines, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
