"""Benchmark: block swap. One random NF4 expert (full A14B cam size with --scale full, written under
--workdir and reused; a tiny one with --scale tiny) is loaded with the streaming loader, and one
denoising step (CFG, two forwards; bench_speed's Step, 464x832x81 at full scale) is timed with 0,
half and all of its blocks swapped (0, 20, 40 for A14B; override with --levels). Per level: step
time, its ratio to no swap, peak VRAM (CUDA), the pinned host bytes the swapper holds, peak
anonymous RSS during the step, and whether the latent is bit-identical to the no-swap one.

    python benchmarks/bench_swap.py --scale full --workdir /tmp/bench_speed     # CUDA
    python benchmarks/bench_swap.py --scale tiny                                # CPU, seconds

Prints one JSON line at the end.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from lingbot import load_pack  # noqa: E402

load_pack()
from bench_speed import SHAPES, Step, load_random_expert, summary_head, timed  # noqa: E402
from lingbot_world.loaders import monitor  # noqa: E402
from lingbot_world.wan.block_swap import BlockSwapper  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, SpeedStats  # noqa: E402

GIB = 1 << 30


def measure(step: Step, n: int, repeats: int) -> dict:
    device = step.device
    cuda = device.type == "cuda"
    swapper = BlockSwapper(step.model, n) if n else None
    try:
        monitor.free_memory()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
        out = {}
        first = timed(lambda: out.update(latent=step(SpeedOptions(), 5.0, SpeedStats())), device, 1)[0]
        with monitor.RssSampler() as rss:
            times = timed(lambda: step(SpeedOptions(), 5.0, SpeedStats()), device, repeats)
        result = {
            "swap_blocks": n,
            "step_s": round(min(times), 4),
            "steps_s": [round(t, 4) for t in times],
            "first_step_s": round(first, 4),
            "host_bytes": 0 if swapper is None else swapper.host_bytes,
            "rss_anon_peak_gib": round(rss.peak / GIB, 3),
        }
        if cuda:
            result["resident_weights_gib"] = round(resident / GIB, 3)
            result["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3)
        result["latent"] = out["latent"]
        return result
    finally:
        if swapper is not None:
            swapper.unpin()  # back to pageable RAM, then onto the device for the next level
            step.model.to(device)
            monitor.free_memory()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per level (after one warm-up)")
    ap.add_argument(
        "--levels", type=int, nargs="*", default=None, help="swap_blocks values (default 0, L/2, L)"
    )
    args = ap.parse_args()

    device, cfg, model, load_s = load_random_expert(args.scale, args.workdir)
    layers = cfg.num_layers
    levels = args.levels if args.levels is not None else [0, layers // 2, layers]
    if 0 not in levels:
        levels = [0, *levels]
    step = Step(model, cfg, device, SHAPES[args.scale])
    summary = {
        **summary_head("swap", args.scale, step, load_s),
        "num_layers": layers,
        "levels": {},
    }
    reference = None
    for n in sorted(set(levels)):
        res = measure(step, n, args.repeats)
        latent = res.pop("latent")
        if n == 0:
            reference = latent
        res["bit_identical"] = bool(torch.equal(latent, reference))
        res["over_no_swap"] = round(res["step_s"] / summary["levels"]["0"]["step_s"], 4) if n else 1.0
        summary["levels"][str(n)] = res
        print(f"swap {n}: {res}", file=sys.stderr)
    top = summary["levels"][str(max(levels))]
    summary["all_swapped"] = {
        "swap_blocks": max(levels),
        "over_no_swap": top["over_no_swap"],
        "bit_identical": top["bit_identical"],
        "le_1.15x": top["over_no_swap"] <= 1.15,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
