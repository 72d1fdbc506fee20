"""Benchmark: the whole CLI generation flow at full scale on one GPU, under a 24 GB VRAM cap.

Builds a random checkpoint folder in the NF4 repack's layout under --workdir (two A14B cam experts in
the exact NF4 format, a random umT5-XXL in ComfyUI's safetensors layout with a synthetic
256384-piece tokenizer, a random Wan2.1 VAE), then runs `lingbot.py generate` in this process with
`torch.cuda.set_per_process_memory_fraction` capping the device at --vram-cap-gib. Records per-phase
wall time, peak anonymous RSS and peak VRAM (the CLI's own phase log).

    python benchmarks/bench_pipeline.py --scale full --workdir /tmp/bench_pipe     # GPU
    python benchmarks/bench_pipeline.py --scale tiny --workdir /tmp/bench_pipe     # CPU check

Prints one JSON line at the end.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_t5 import SCALES as T5_SCALES  # noqa: E402
from bench_t5 import write_random_safetensors, write_synthetic_tokenizer  # noqa: E402

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world import cli  # noqa: E402
from lingbot_world.loaders import demo_assets, synthetic  # noqa: E402
from lingbot_world.wan.config import A14B  # noqa: E402
from lingbot_world.wan.vae import WAN21_VAE_CONFIG, WanVAE, init_random_  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "00"


def build_full_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if (root / "COMPLETE").is_file():
        return root
    t0 = time.perf_counter()
    for seed, role in enumerate(("high", "low")):
        synthetic.write_nf4_expert(root / f"{role}_noise_model_bnb_nf4", A14B, seed=seed, mode="random")
    write_random_safetensors(root / "umt5_xxl_bf16.safetensors", T5_SCALES["full"])
    write_synthetic_tokenizer(root / "tokenizer", T5_SCALES["full"]["vocab"])
    torch.save(init_random_(WanVAE(**WAN21_VAE_CONFIG)).state_dict(), root / "Wan2.1_VAE.pth")
    (root / "COMPLETE").write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4, help="4 steps at shift 10: 2 high-noise + 2 low-noise")
    ap.add_argument("--frame_num", type=int, default=81)
    ap.add_argument("--size", default="480*832")
    ap.add_argument("--vram-cap-gib", type=float, default=24.0)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if args.scale == "full":
        if not cuda:
            raise SystemExit("--scale full needs a CUDA GPU")
        ckpt = build_full_checkpoint(args.workdir / "ckpt")
        size, frames = args.size, args.frame_num
    else:
        ckpt = demo_assets.ensure_demo_checkpoint(args.workdir)
        size, frames = "64*112", 9
    device = "cuda" if cuda else "cpu"
    try:
        import av  # noqa: F401
    except ImportError:  # a bare GPU box: measure everything but the MP4 encode
        from lingbot_world.loaders import video

        video.write_mp4 = lambda *a, **k: print("PyAV absent: MP4 not written")
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gib * (1 << 30) / total))
    report, out = args.workdir / "phases.json", args.workdir / "out.mp4"
    argv = [
        "generate", "--ckpt_dir", str(ckpt), "--image", str(EXAMPLE / "image.jpg"),
        "--prompt", (EXAMPLE / "prompt.txt").read_text().strip(), "--action_path", str(EXAMPLE),
        "--size", size, "--frame_num", str(frames), "--sampling_steps", str(args.steps),
        "--device", device, "--output", str(out), "--overwrite", "--report", str(report),
    ]  # fmt: skip
    t0 = time.perf_counter()
    rc = cli.main(argv)
    wall = time.perf_counter() - t0
    summary = {
        "bench": "pipeline",
        "scale": args.scale,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "vram_cap_gib": args.vram_cap_gib if cuda else None,
        "size": size,
        "frame_num": frames,
        "steps": args.steps,
        "rc": rc,
        "wall_s": round(wall, 2),
        "phases": json.loads(report.read_text()) if report.is_file() else None,
    }
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
