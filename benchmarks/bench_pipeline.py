"""Benchmark: the whole CLI generation flow at full scale on one GPU, under a 24 GB VRAM cap.

Builds a random checkpoint folder in the NF4 repack's layout under --workdir (two A14B cam experts in
the exact NF4 format, a random umT5-XXL in ComfyUI's safetensors layout with a synthetic
256384-piece tokenizer, a random Wan2.1 VAE), then runs `lingbot.py generate` in this process with
`torch.cuda.set_per_process_memory_fraction` capping the device at --vram-cap-gib. Records per-phase
wall time, peak anonymous RSS and peak VRAM (the CLI's own phase log), and the card's peak used memory
with every process on it (the text encoder's child included: `card_peak_used_gib`).

    python benchmarks/bench_pipeline.py --scale full --workdir /tmp/bench_pipe     # GPU
    python benchmarks/bench_pipeline.py --scale tiny --workdir /tmp/bench_pipe     # CPU check

Prints one JSON line at the end.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_speed import set_vram_cap  # noqa: E402
from bench_t5 import SCALES as T5_SCALES  # noqa: E402
from bench_t5 import write_random_safetensors, write_synthetic_tokenizer  # noqa: E402

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world import cli  # noqa: E402
from lingbot_world.loaders import checkpoints, demo_assets, synthetic  # noqa: E402
from lingbot_world.wan.config import A14B  # noqa: E402
from lingbot_world.wan.vae import WAN21_VAE_CONFIG, WanVAE, init_random_  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "00"


def build_full_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if (root / "COMPLETE").is_file():
        return root
    t0 = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(3, mp_context=spawn, initializer=load_pack) as pool:  # ~30 GB to write
        jobs = [
            pool.submit(
                synthetic.write_nf4_expert, root / f"{role}_noise_model_bnb_nf4", A14B, seed, mode="random"
            )
            for seed, role in enumerate(("high", "low"))
        ]
        jobs.append(
            pool.submit(write_random_safetensors, root / "umt5_xxl_bf16.safetensors", T5_SCALES["full"])
        )
        for job in jobs:
            job.result()
    write_synthetic_tokenizer(root / "tokenizer", T5_SCALES["full"]["vocab"])
    torch.save(init_random_(WanVAE(**WAN21_VAE_CONFIG)).state_dict(), root / "Wan2.1_VAE.pth")
    (root / "COMPLETE").write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
    return root


def write_random_lora(path: Path, config, rank: int) -> Path:
    """A random rank-`rank` LoRA on every Linear of the experts, kohya-style keys (ComfyUI names)."""
    from lingbot_world.loaders.formats import meta_model
    from lingbot_world.wan.lora import lora_targets
    from safetensors.torch import save_file

    if path.is_file():
        return path
    g = torch.Generator().manual_seed(rank)
    tensors = {}
    for name, t in lora_targets(meta_model(config)).items():
        if t.kind == "linear":
            out_f, in_f = t.weight
            key = f"diffusion_model.{name}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g).bfloat16() * in_f**-0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g).bfloat16() * 0.01
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return path


class CardPeak:
    """The card's peak used memory over a `with` block, every process on it counted (the text encoder's
    child too): total minus free, sampled on a thread."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        free, total = torch.cuda.mem_get_info()
        self.peak = max(self.peak, total - free)

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4, help="4 steps at shift 10: 2 high-noise + 2 low-noise")
    ap.add_argument("--frame_num", type=int, default=81)
    ap.add_argument("--size", default="480*832")
    ap.add_argument("--vram-cap-gib", type=float, default=24.0)
    ap.add_argument("--guide_scale", default="5", help="the CLI's --guide_scale (1 = one forward a step)")
    ap.add_argument(
        "--lora-rank", type=int, default=0, help="apply a random LoRA of this rank to both experts"
    )
    ap.add_argument("--extra", default="", help="more `generate` arguments, e.g. '--cache easycache'")
    args = ap.parse_args()

    # what `lingbot.py generate` sets before CUDA's first allocation; the cap below would come first here
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
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
        set_vram_cap(torch.device("cuda"), args.vram_cap_gib)
    report, out = args.workdir / "phases.json", args.workdir / "out.mp4"
    extra = ["--guide_scale", *args.guide_scale.split(), *args.extra.split()]
    if args.lora_rank:
        config = checkpoints.resolve_checkpoint_dir(ckpt).config
        lora = write_random_lora(args.workdir / f"lora_r{args.lora_rank}.safetensors", config, args.lora_rank)
        extra += ["--lora", str(lora)]
    argv = [
        "generate",
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(EXAMPLE / "image.jpg"),
        "--prompt",
        (EXAMPLE / "prompt.txt").read_text().strip(),
        "--action_path",
        str(EXAMPLE),
        "--size",
        size,
        "--frame_num",
        str(frames),
        "--sampling_steps",
        str(args.steps),
        "--device",
        device,
        "--output",
        str(out),
        "--overwrite",
        "--report",
        str(report),
        *extra,
    ]
    t0 = time.perf_counter()
    with CardPeak() if cuda else contextlib.nullcontext() as card:
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
        "extra": extra,
        "rc": rc,
        "wall_s": round(wall, 2),
        "card_peak_used_gib": round(card.peak / (1 << 30), 2) if cuda else None,
        "phases": json.loads(report.read_text()) if report.is_file() else None,
    }
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
