"""Command line: the same generation flow as the ComfyUI nodes, headless.

    python lingbot.py generate --ckpt_dir CKPT --image in.jpg --prompt "..." --action_path examples/00
    python lingbot.py demo          # tiny random checkpoints, CPU, no downloads

Option names follow upstream's generate.py (and the NF4 repack's generate_prequant.py); both
spellings are accepted where they differ.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .loaders import camera_files, checkpoints, demo_assets, monitor, text_encode, video
from .loaders.experts import ExpertSwitcher
from .loaders.vae import load_vae
from .wan import actions, camera, i2v, pipeline
from .wan.config import SampleConfig

ROOT = Path(__file__).resolve().parent
DEFAULTS = SampleConfig()


def parse_size(text: str) -> int:
    """'480*832' -> max pixel area, as upstream's --size."""
    try:
        h, w = (int(v) for v in text.lower().replace("x", "*").split("*"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size must look like 480*832, got {text!r}") from None
    if h <= 0 or w <= 0:
        raise argparse.ArgumentTypeError(f"--size must be positive, got {text!r}")
    return h * w


def add_generate_args(p: argparse.ArgumentParser):
    p.add_argument("--ckpt_dir", type=Path, required=True, help="upstream layout or the NF4 repack layout")
    p.add_argument("--image", type=Path, required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--n_prompt", default="", help="negative prompt; empty = upstream's default")
    p.add_argument(
        "--action_path", type=Path, help="folder with poses.npy + intrinsics.npy (and action.npy for Act)"
    )
    p.add_argument("--action_string", help="act2cam keys, e.g. 'w-10,a-10,iw-15,none-10' (Cam model)")
    p.add_argument(
        "--allow_act2cam", action="store_true", help="drive the Cam model from wasd/ijkl_action.npy"
    )
    p.add_argument("--size", type=parse_size, default=DEFAULTS.max_area, help="max pixel area, e.g. 480*832")
    p.add_argument("--frame_num", type=int, default=None, help=f"4n+1 frames (default {DEFAULTS.frame_num})")
    p.add_argument(
        "--sampling_steps", "--sample_steps", dest="steps", type=int, default=DEFAULTS.sample_steps
    )
    p.add_argument("--sample_shift", type=float, default=DEFAULTS.sample_shift)
    p.add_argument("--boundary", type=float, default=DEFAULTS.boundary)
    p.add_argument(
        "--guide_scale", "--sample_guide_scale", dest="guide_scale", type=float, nargs="+",
        default=list(DEFAULTS.guide_scale), help="one value, or two: low-noise high-noise",
    )  # fmt: skip
    p.add_argument("--seed", "--base_seed", dest="seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--solver", "--sample_solver", dest="solver", choices=["unipc", "euler"], default="unipc")
    p.add_argument("--fps", type=int, default=DEFAULTS.sample_fps)
    p.add_argument(
        "--output", "--save_file", dest="output", type=Path, help="MP4 path (default: outputs/...)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quantize", action="store_true", help="quantize bf16 experts to NF4 while loading")
    p.add_argument("--t5_mode", choices=["subprocess", "inprocess"], default="subprocess")
    p.add_argument("--t5_cpu", action="store_true", help="run the text encoder on the CPU")
    p.add_argument("--vae_tile", default="auto", help="'auto', 'none' or H,W tile size in latent pixels")
    p.add_argument("--report", type=Path, help="also write the per-phase time/memory table as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lingbot.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub.add_parser("generate", help="image + prompt + camera path -> MP4"))
    demo = sub.add_parser("demo", help="tiny random checkpoints on the CPU, shipped example, short MP4")
    demo.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lingbot-world-nf4" / "demo")
    demo.add_argument("--output", type=Path, default=None)
    demo.add_argument("--overwrite", action="store_true")
    child = sub.add_parser("_encode-text", help=argparse.SUPPRESS)
    child.add_argument("request")
    return parser


def guide_pair(values: list[float]) -> tuple[float, float]:
    if len(values) == 1:
        return (values[0], values[0])
    if len(values) == 2:
        return (values[0], values[1])
    raise SystemExit(f"--guide_scale takes one or two values (low-noise high-noise), got {len(values)}")


def default_output(stem: str) -> Path:
    out = Path("outputs")
    out.mkdir(exist_ok=True)
    base = f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{base}.mp4", 1
    while path.exists():
        path, n = out / f"{base}-{n}.mp4", n + 1
    return path


def camera_plan(args):
    """(poses, intrinsics, actions, frame_num, act2cam) from --action_path / --action_string.

    As upstream: an action string (or --allow_act2cam with wasd/ijkl files) drives the Cam model with
    synthetic poses and takes its intrinsics from --action_path; a pose path caps the frame count.
    Without either, poses is None and the video has --frame_num frames.
    """
    if args.action_string or args.allow_act2cam:
        if not args.action_path:
            raise ValueError(
                "--action_string/--allow_act2cam need --action_path for intrinsics.npy (as upstream)"
            )
        files = camera_files.load_camera_dir(args.action_path, require_poses=False)
        if args.action_string:
            plan = actions.act2cam_trajectory(action_string=args.action_string, frame_num=args.frame_num)
        elif "wasd" not in files:
            raise ValueError(f"--allow_act2cam: {args.action_path} has no wasd_action.npy")
        else:
            plan = actions.act2cam_trajectory(
                wasd=files["wasd"], ijkl=files.get("ijkl"), frame_num=args.frame_num
            )
        return plan.poses, files["intrinsics"], None, plan.frame_num, True
    frame_num = DEFAULTS.frame_num if args.frame_num is None else args.frame_num
    i2v.latent_frames(frame_num)  # raises unless 4n+1, naming the nearest valid counts
    if not args.action_path:
        return None, None, None, frame_num, False
    files = camera_files.load_camera_dir(args.action_path)
    used = camera.used_frame_count(len(files["poses"]), frame_num)
    if used < frame_num:
        print(
            f"note: {args.action_path} has {len(files['poses'])} poses; generating {used} frames (upstream truncates)"
        )
    return files["poses"], files["intrinsics"], files.get("action"), used, False


def load_image(path: Path) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"--image: {path} not found")
    try:
        with Image.open(path) as img:
            return i2v.image_to_tensor(img)
    except UnidentifiedImageError:
        raise ValueError(f"--image: {path} is not an image PIL can read") from None


def vae_tile(text: str):
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        th, tw = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--vae_tile must be 'auto', 'none' or H,W in latent pixels, got {text!r}") from None
    return (th, tw)


def run_generate(args) -> int:
    device = torch.device(args.device)
    files = checkpoints.resolve_checkpoint_dir(args.ckpt_dir)  # lists every missing file at once
    output = args.output or default_output("lingbot")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    tile = vae_tile(args.vae_tile)
    image = load_image(args.image)
    poses, intrinsics, act, frame_num, act2cam = camera_plan(args)
    if poses is not None and files.control_type is None:
        raise ValueError(
            f"{args.ckpt_dir}: plain Wan2.2 i2v experts have no camera layers; drop the camera input"
        )
    settings = SampleConfig(
        sample_shift=args.sample_shift, sample_steps=args.steps, boundary=args.boundary,
        guide_scale=guide_pair(args.guide_scale), sample_fps=args.fps, frame_num=frame_num,
        max_area=args.size, solver=args.solver, seed=i2v.resolve_seed(args.seed),
    )  # fmt: skip
    lat_h, lat_w, h, w = i2v.latent_size(image.shape[1], image.shape[2], settings.max_area)
    log = monitor.PhaseLog()
    hooks = pipeline.Hooks(phase=log.phase)

    with log.phase("text_encode"):
        context, context_null = text_encode.encode_prompts(
            files.text_encoder, [args.prompt, args.n_prompt or settings.negative_prompt],
            tokenizer_path=files.tokenizer, mode=args.t5_mode,
            device="cpu" if args.t5_cpu else str(device),
        )  # fmt: skip
    cam = None
    if poses is not None:
        with log.phase("camera"):
            cam, _ = camera.camera_conditioning(
                poses, intrinsics, frame_num, h, w, lat_h, lat_w, control_type=files.control_type,
                actions=act, device=device, act2cam=act2cam,
            )  # fmt: skip
    with log.phase("load_vae"):
        vae = load_vae(files.vae, device)
    switcher = ExpertSwitcher(files.experts, device, quantize=args.quantize or None)
    bar = tqdm(total=settings.sample_steps, desc="denoising", unit="step")
    hooks.progress = lambda i, n, latent: bar.update(1)
    try:
        frames = pipeline.generate(
            image=image, context=context, context_null=context_null, vae=vae, experts=switcher,
            release_experts=switcher.close, size=(lat_h, lat_w, h, w), frame_num=frame_num,
            settings=settings, cam=cam, device=device, hooks=hooks,
            vae_decode=lambda z: vae.decode(z, tile=tile),
        )  # fmt: skip
    finally:
        bar.close()
        switcher.close()
    with log.phase("write_mp4"):
        video.write_mp4(
            pipeline.frames_to_uint8(frames), output, fps=settings.sample_fps, overwrite=args.overwrite
        )
    print(log.table())
    if args.report:
        args.report.write_text(json.dumps([r.as_dict() for r in log.records], indent=1))
    print(f"wrote {output} ({frame_num} frames, {w}x{h}, {settings.sample_fps} fps, seed {settings.seed})")
    return 0


def run_demo(args) -> int:
    ckpt = demo_assets.ensure_demo_checkpoint(args.workdir)
    example = ROOT / "examples" / "00"
    output = args.output or default_output("demo")
    argv = [
        "generate", "--ckpt_dir", str(ckpt), "--image", str(example / "image.jpg"),
        "--prompt", (example / "prompt.txt").read_text().strip(), "--action_path", str(example),
        "--size", "64*112", "--frame_num", "9", "--sampling_steps", "6", "--device", "cpu",
        "--t5_mode", "subprocess", "--output", str(output), "--seed", "42",
    ]  # fmt: skip
    if args.overwrite:
        argv.append("--overwrite")
    print(f"demo: tiny random checkpoints in {ckpt} (random weights: expect noise, not a scene)")
    return run_generate(build_parser().parse_args(argv))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "_encode-text":
            return text_encode.child_main(args.request)
        if args.command == "demo":
            return run_demo(args)
        return run_generate(args)
    except KeyboardInterrupt:
        print("interrupted: models released, no output written", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
