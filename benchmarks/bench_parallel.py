"""Benchmark: sequence-parallel (Ulysses) denoising steps across GPUs, against the same step on one GPU.

Every rank loads the same random full-size NF4 cam expert (written once under --workdir by the first
run), then times whole sampling steps (CFG: two forwards, through the real `wan.pipeline.denoise` with a
`wan.parallel.SequenceParallel` over the NCCL group) at each --shapes entry, and records every rank's
peak VRAM. Rank 0 saves each shape's final latent; a later run with another world size compares its
latent against the one-GPU run's file (bf16 tolerance is what to expect: the token split changes
reduction order in nothing but the all-to-all is exact, so differences come from kernel choice).

    python benchmarks/bench_parallel.py --scale full --workdir /tmp/bpar                      # 1 GPU
    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py --scale full --workdir /tmp/bpar  # 2 GPUs
    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py --scale tiny                      # CPU, gloo

The world size comes from torchrun (1 without it). Prints one JSON line (rank 0).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_speed import Step, rel_error, sync  # noqa: E402

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders import stream, synthetic  # noqa: E402
from lingbot_world.session import distributed  # noqa: E402
from lingbot_world.wan import pipeline  # noqa: E402
from lingbot_world.wan.config import A14B, SampleConfig  # noqa: E402
from lingbot_world.wan.parallel import SequenceParallel  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, SpeedStats  # noqa: E402

# name -> (height, width, frames, cond text tokens, uncond text tokens)
SHAPES = {
    "480x161": (464, 832, 161, 60, 120),
    "720x81": (720, 1280, 81, 60, 120),
    "480x81": (464, 832, 81, 60, 120),
    "480x961": (464, 832, 961, 60, 120),
    "tiny": (32, 48, 9, 7, 5),
}
WARMUP = {"full": (240, 416, 17, 60, 120), "tiny": (32, 48, 5, 7, 5)}


def gib(n: int) -> float:
    return round(n / (1 << 30), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="the random expert and the latents (shared)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per shape")
    ap.add_argument("--guide", type=float, default=5.0, help="guide scale (1: one forward per step)")
    args = ap.parse_args()
    shapes = (args.shapes or ("480x161,720x81" if args.scale == "full" else "tiny")).split(",")
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r}; expected some of {', '.join(SHAPES)}")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs CUDA GPUs")
    with (
        tempfile.TemporaryDirectory() as tmp,
        distributed.process_group(world, "cuda" if cuda else "cpu") as dev,
    ):
        device = torch.device(dev)
        rank = distributed.rank()
        workdir = args.workdir or Path(tmp)
        if world > 1 and args.workdir is None:
            raise SystemExit("--workdir is needed with several ranks (they share the expert file)")
        cfg = A14B if args.scale == "full" else synthetic.tiny_config("cam", text_dim=64, text_len=64)
        folder = workdir / f"{args.scale}_expert_nf4"
        if rank == 0 and not (folder / "config.json").is_file():
            synthetic.write_nf4_expert(folder, cfg, seed=0, mode="random")
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        model = stream.load_expert(folder, device)
        load_s = time.perf_counter() - t0
        sp = SequenceParallel() if world > 1 else None

        settings = SampleConfig(sample_steps=1, guide_scale=(args.guide, args.guide), boundary=0.0)

        def step(inputs: Step):
            return pipeline.denoise(
                lambda which: model,
                inputs.noise,
                inputs.y,
                inputs.context,
                inputs.context_null,
                inputs.cam,
                settings,
                speed=SpeedOptions(),
                stats=SpeedStats(),
                parallel=sp,
            )

        step(Step(model, cfg, device, WARMUP[args.scale]))  # kernels, NCCL communicators
        summary = {
            "bench": "parallel",
            "scale": args.scale,
            "world_size": world,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "guide": args.guide,
            "load_s": round(load_s, 2),
        }
        for name in shapes:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            inputs = Step(model, cfg, device, SHAPES[name])  # random inputs, built outside the timing
            times = []
            for _ in range(args.repeats):
                if world > 1:
                    dist.barrier()
                sync(device)
                t0 = time.perf_counter()
                latent = step(inputs)
                sync(device)
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated(device) if cuda else 0
            reserved = torch.cuda.max_memory_reserved(device) if cuda else 0
            peaks = [None] * world
            if world > 1:
                dist.all_gather_object(peaks, (peak, reserved))
            else:
                peaks = [(peak, reserved)]
            result = {
                "tokens": inputs.tokens,
                "step_s": round(min(times), 3),
                "steps_s": [round(t, 3) for t in times],
                "peak_vram_gib_per_rank": [gib(p) for p, _ in peaks],
                "reserved_gib_per_rank": [gib(r) for _, r in peaks],
            }
            if rank == 0:
                mine = workdir / f"latent_{args.scale}_{name}_g{args.guide}_ws{world}.pt"
                torch.save(latent.cpu(), mine)
                base = workdir / f"latent_{args.scale}_{name}_g{args.guide}_ws1.pt"
                if world > 1 and base.is_file():
                    ref = torch.load(base, weights_only=True)
                    result["rel_error_vs_1gpu"] = rel_error(latent.cpu(), ref)
                    result["max_abs_vs_1gpu"] = float((latent.cpu().float() - ref.float()).abs().max())
                    one = workdir / f"step_{args.scale}_{name}_g{args.guide}_ws1.json"
                    if one.is_file():
                        result["speedup_vs_1gpu"] = round(
                            json.loads(one.read_text())["step_s"] / result["step_s"], 3
                        )
                if world == 1:
                    (workdir / f"step_{args.scale}_{name}_g{args.guide}_ws1.json").write_text(
                        json.dumps(result)
                    )
                print(f"{name}: {result}", file=sys.stderr, flush=True)
            summary[name] = result
            del latent, inputs
        if rank == 0:
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
