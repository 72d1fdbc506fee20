"""Benchmark: chunked generation (v1 Fast, v2) under sequence parallel, against one GPU of the same host.

One torchrun launch measures both: rank 0 first runs the whole chunked clip alone (`wan.fast.FastSession`,
no sequence parallel) while the other ranks wait, then every rank runs the same clip with a
`wan.parallel.SequenceParallel` over the NCCL group. Each rank builds the same full-size random DiT of the
kind on its own GPU (seeded; bf16 weights, or NF4 from a random NF4 folder written once under --workdir),
with random inputs of the requested size. Prints one JSON line (rank 0): seconds per chunk of each run (the
mean, and the mean over the chunks after the first, whose cache is empty), the speed-up, each run's peak VRAM
per rank, and the deviation of the N-GPU latent from the one-GPU one.

    torchrun --nproc_per_node 2 benchmarks/bench_parallel_fast.py --scale full --model v2-14b --chunks 7
    torchrun --nproc_per_node 4 benchmarks/bench_parallel_fast.py --scale full --model v2-14b --chunks 9 --compile
    torchrun --nproc_per_node 2 benchmarks/bench_parallel_fast.py --scale tiny               # CPU, gloo

Full scale defaults to 464*832 with the documented window (18 frames, sink 6).
"""

import argparse
import dataclasses
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

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders import stream, synthetic  # noqa: E402
from lingbot_world.session import distributed  # noqa: E402
from lingbot_world.wan.config import CHUNKED_KINDS, CONTROL_CHANNELS  # noqa: E402
from lingbot_world.wan.dit import WanModel, init_random_  # noqa: E402
from lingbot_world.wan.fast import FastConfig, FastSession  # noqa: E402
from lingbot_world.wan.parallel import SequenceParallel  # noqa: E402


def gib(n: int) -> float:
    return round(n / (1 << 30), 2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def random_model(cfg, device: torch.device, seed: int = 0) -> WanModel:
    """The DiT in bf16 straight on `device`, filled by a seeded generator there (the same weights on every
    rank of one kind of GPU)."""
    with torch.device("meta"):
        model = WanModel.from_config(cfg)
    return init_random_(model.to(torch.bfloat16).to_empty(device=device), seed, device).eval()


def inputs(cfg, lat_shape, device, text_tokens: int = 60):
    """(y, context, cam): seeded on the CPU, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    lat_f, lat_h, lat_w = lat_shape
    y = torch.randn(20, lat_f, lat_h, lat_w, generator=g)
    context = torch.randn(text_tokens, cfg.text_dim, generator=g)
    cam = 0.1 * torch.randn(1, CONTROL_CHANNELS[cfg.control_type], lat_f, lat_h, lat_w, generator=g)
    return y.to(device), context.to(device), cam.to(device)


def run(model, cfg, lat_shape, config: FastConfig, device, sp) -> dict:
    """The whole clip: seconds per chunk, the latent (on the CPU) and this rank's peak VRAM."""
    y, context, cam = inputs(cfg, lat_shape, device)
    model.sequence_parallel = sp
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    session = FastSession(model, context, y, lat_shape, config, device)
    chunk, times = config.chunk_frames, []
    cache = session.kv_cache_bytes()  # the self-attention cache, allocated whole (the text keys come later)
    try:
        for k in range(session.num_chunks):
            if sp is not None:
                dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            session.next_chunk(cam[:, :, k * chunk : (k + 1) * chunk])
            sync(device)
            times.append(time.perf_counter() - t0)
        latent = session.latent().cpu()
    finally:
        session.close()
        model.sequence_parallel = None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    later = times[1:] or times
    # steady: after the first chunk that rolls the window (where compiled blocks start, and compile)
    steady = times[config.roll_chunks :] if config.local_attn_size > 0 else later
    return {
        "chunk_s": [round(t, 3) for t in times],
        "s_per_chunk": round(sum(times) / len(times), 3),
        "s_per_chunk_after_first": round(sum(later) / len(later), 3),
        "s_per_chunk_steady": round(sum(steady) / len(steady), 3) if steady else None,
        "kv_cache_bytes": cache,
        "kv_cache_gib": gib(cache),
        "peak_vram_gib": gib(peak),
        "latent": latent,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--model", choices=list(CHUNKED_KINDS), default="v2-14b")
    ap.add_argument("--size", default="464*832", help="H*W in pixels (full scale)")
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--local_attn_size", type=int, default=None, help="default: the kind's (v2: 18)")
    ap.add_argument("--sink_size", type=int, default=None, help="default: the kind's (v2: 6)")
    ap.add_argument("--weights", choices=["bf16", "nf4"], default="bf16")
    ap.add_argument("--workdir", type=Path, default=None, help="the NF4 folder (--weights nf4), shared")
    ap.add_argument(
        "--compile", action="store_true", help="both runs with compiled blocks (from the chunk that rolls)"
    )
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs CUDA GPUs")
    kind = CHUNKED_KINDS[args.model]
    cfg = kind.dit if args.scale == "full" else synthetic.tiny_config("cam", text_dim=64, text_len=64)
    if cfg.num_heads % world:
        raise SystemExit(f"{world} ranks do not divide the model's {cfg.num_heads} heads")
    h, w = (int(v) for v in args.size.split("*")) if args.scale == "full" else (32, 48)
    lat_h, lat_w = h // 8, w // 8
    lat_shape = (args.chunks * kind.chunk_frames, lat_h, lat_w)
    config = FastConfig.for_kind(kind, local_attn_size=args.local_attn_size, sink_size=args.sink_size)
    if args.scale == "tiny":  # a window that rolls within the tiny clip
        config = FastConfig.for_kind(kind, local_attn_size=2 * kind.chunk_frames + 1, sink_size=1)
    config = dataclasses.replace(config, compile=args.compile)
    with (
        tempfile.TemporaryDirectory() as tmp,
        distributed.process_group(world, "cuda" if cuda else "cpu") as dev,
    ):
        device = torch.device(dev)
        rank = distributed.rank()
        if args.weights == "nf4":
            if world > 1 and args.workdir is None:
                raise SystemExit("--weights nf4 with several ranks needs --workdir (they share the folder)")
            folder = (args.workdir or Path(tmp)) / f"{args.scale}_{args.model}_nf4"
            if rank == 0 and not (folder / "config.json").is_file():
                synthetic.write_nf4_expert(folder, cfg, seed=0, mode="random")
            if world > 1:
                dist.barrier()
            model = stream.load_expert(folder, device)
        else:
            model = random_model(cfg, device)
        if device.type == "cpu":
            model.compute_dtype = torch.float32
        sp = SequenceParallel() if world > 1 else None
        warm = (kind.chunk_frames, lat_h, lat_w)  # kernels (and NCCL's communicators) before any timing
        run(model, cfg, warm, config, device, None)
        if sp is not None:
            run(model, cfg, warm, config, device, sp)
        one = None
        if rank == 0:
            one = run(model, cfg, lat_shape, config, device, None)
        if world > 1:
            dist.barrier()  # the others wait for rank 0's one-GPU run
        many = run(model, cfg, lat_shape, config, device, sp) if sp is not None else None
        peaks = [many["peak_vram_gib"] if many else None] * world
        if world > 1:
            dist.all_gather_object(peaks, many["peak_vram_gib"])
        if rank == 0:
            ref = one.pop("latent")
            summary = {
                "bench": "parallel_fast",
                "scale": args.scale,
                "model": args.model,
                "weights": args.weights,
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "torch": torch.__version__,
                "size": [h, w],
                "latent_frames": lat_shape[0],
                "chunks": args.chunks,
                "compile": args.compile,
                "window": [config.local_attn_size, config.sink_size],
                "tokens_per_chunk": kind.chunk_frames * (lat_h // 2) * (lat_w // 2),
                "one_gpu": one,
            }
            if many is not None:
                got = many.pop("latent")
                many["peak_vram_gib_per_rank"] = peaks
                summary[f"{world}_gpus"] = many
                summary["speedup"] = round(one["s_per_chunk"] / many["s_per_chunk"], 3)
                summary["speedup_after_first"] = round(
                    one["s_per_chunk_after_first"] / many["s_per_chunk_after_first"], 3
                )
                if one["s_per_chunk_steady"] and many["s_per_chunk_steady"]:
                    summary["speedup_steady"] = round(
                        one["s_per_chunk_steady"] / many["s_per_chunk_steady"], 3
                    )
                diff = (got.float() - ref.float()).abs()
                summary["max_abs_dev_vs_1gpu"] = float(diff.max())
                summary["rel_dev_vs_1gpu"] = float(diff.norm() / ref.float().norm().clamp_min(1e-12))
                summary["latent_max_abs"] = float(ref.abs().max())
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
