"""Benchmark: Wan2.1 VAE decode/encode time and peak VRAM, untiled vs tiled, ours vs upstream chunking.

Writes a random full-size Wan2.1 VAE (126.9M params, fp32 like upstream) to --workdir as
`Wan2.1_VAE.pth` and loads it through loaders/vae.py (or loads a real checkpoint given with --vae,
which also makes the tiled-vs-untiled error meaningful: random weights have no spatial decay).

Cases (full scale; latents are random normal, i.e. normalised-latent statistics):
- decode 480x832x81 (latent 21x60x104) and 720x1280x81 (21x90x160), each
  - `untiled`: whole frame, our default sub-chunking (chunk_frames=2 after temporal upsampling);
  - `untiled_c4`: the baseline, upstream's temporal chunking (4 output frames per step, no sub-chunks);
  - `tiled`: a 2x2 tile grid with the default overlap (16 latent px), blended;
- decode 720p with tile='auto' under a 24 GiB cap (torch.cuda.set_per_process_memory_fraction),
  reporting the tile it picked;
- encode of an 81-frame 480x832 input: the shipped example image, then 80 zero frames (as i2v does).
For each: wall time, peak allocated VRAM above what was held before (torch.cuda.max_memory_allocated),
peak reserved, the analytic estimate `decode_bytes_per_latent_pixel * tile area + output` and the
measured bytes per latent pixel, so AUTO_SAFETY in wan/vae.py can be checked. Tiled outputs are
compared with the untiled one (max / mean abs difference).

    python benchmarks/bench_vae.py --scale tiny --workdir /tmp/bench_vae          # CPU, seconds
    python benchmarks/bench_vae.py --scale full --workdir /tmp/bench_vae           # CUDA, ~5 min H100
    python benchmarks/bench_vae.py --scale full --workdir /tmp/bench_vae --vae /models/Wan2.1_VAE.pth

`--mode chunk` instead times the chunked decode of LingBot-World 2.0's loop at 464x832 (latent 58x104): a
`ChunkDecoder` takes chunks of 4 latent frames, the first giving 13 frames, every later one 16; the 16-frame
chunks are timed (median) after a warm-up stream. Variants: the exact fp32 decode (the default), the fast
decoder in bf16 and fp16, each channels-last (the product's option) and not (to show the layout's share), and
the fast decoder's levers (`wan.vae.DecoderLevers`): `subpixel` (each upsample's nearest 2x + 3x3 conv as the
equal 2x2 sub-pixel conv), `compiled` (the blocks through torch.compile, as `fast/play --compile` run them)
and both, with 2- or 4-frame sub-chunks. The warm-up stream (its own decoder, two chunks) compiles every graph;
a compiled row reports its warm-up time, the graphs it compiled and the graphs compiled while timed (0 when
nothing recompiles). A row that fails (compile error, out of memory) reports its error; the others still run.
On the CPU the compiled rows are skipped unless --cpu-compile. Each variant decodes the same latents; its
frames' PSNR against the fp32 decode's (peak-to-peak 2 for frames in [-1, 1]) is reported beside its time
ratio. Later chunks are handed out latent frame by latent frame (`ChunkDecoder.stream`), so the time to a
chunk's first 4 frames is reported too. Random weights cannot judge image quality: the PSNR shows the
arithmetic's deviation, not what an eye sees. `--rows a,b` runs only those variants (and fp32).

    python benchmarks/bench_vae.py --mode chunk --scale full --workdir /tmp/bench_vae   # CUDA, ~5 min (compiles)

Prints one JSON line at the end.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders.vae import load_vae  # noqa: E402
from lingbot_world.wan import i2v, speed  # noqa: E402
from lingbot_world.wan import vae as V  # noqa: E402
from lingbot_world.wan.speed import compiler_missing  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

GIB = 2**30
SCALES = {
    "full": dict(
        config=V.WAN21_VAE_CONFIG,
        frames=81,
        sizes={"480p": (480, 832), "720p": (720, 1280)},
        chunk_size=(464, 832),
        chunks=6,
    ),
    # CPU-sized: same structure, 4 channels wide, 9 frames, small frames
    "tiny": dict(
        config=dict(V.WAN21_VAE_CONFIG, dim=4),
        frames=9,
        sizes={"480p": (48, 80), "720p": (64, 112)},
        chunk_size=(16, 32),
        chunks=2,
    ),
}
CHUNK_LATENT_FRAMES = 4  # LingBot-World 2.0: 13 frames for the first chunk, 16 for each after
TARGET_RATIO, TARGET_PSNR_DB = 0.35, 40.0  # issue 21: <= 0.35x the fp32 decode's time, >= 40 dB against it
CAP_BYTES = 24 * GIB


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device, fn):
    """(result, seconds, peak allocated above the start, peak reserved) of fn()."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    dt = time.perf_counter() - t0
    if device.type != "cuda":
        return out, dt, None, None
    return out, dt, torch.cuda.max_memory_allocated(device) - base, torch.cuda.max_memory_reserved(device)


def gib(x):
    return None if x is None else round(x / GIB, 3)


def encode_input(frames, height, width, device):
    """[3, F, H, W]: the shipped example image as i2v prepares it (bicubic to the size), then zero frames."""
    try:
        from PIL import Image

        image = i2v.image_to_tensor(Image.open(ROOT / "examples" / "00" / "image.jpg"))
    except ImportError:  # a bare GPU box without Pillow: random pixels in [-1, 1] stand in
        image = torch.rand(3, height, width, generator=torch.Generator().manual_seed(0)).mul(2).sub(1)
    return i2v.vae_input(image, frames, height, width).to(device)


def get_vae(args, scale, device):
    if args.vae:
        path = Path(args.vae)
    else:
        path = Path(args.workdir) / f"Wan2.1_VAE_random_{args.scale}.pth"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            model = V.init_random_(V.WanVAE(**scale["config"]), seed=0)
            torch.save(model.state_dict(), path)
            del model
    t0 = time.perf_counter()
    vae = load_vae(path, device=device, dtype=torch.float32, config=None if args.vae else scale["config"])
    sync(device)
    return vae, path, time.perf_counter() - t0


def bench_decode(vae, size, scale, overlap, device, record, baseline):
    frames = scale["frames"]
    height, width = scale["sizes"][size]
    h, w = height // 8, width // 8
    z = torch.randn(16, (frames - 1) // 4 + 1, h, w, generator=torch.Generator().manual_seed(1)).to(device)
    out_bytes = 3 * frames * height * width * 4

    def est(th, tw, chunk=2):
        return gib(vae.decode_bytes_per_latent_pixel(chunk) * th * tw + out_bytes)

    ref, dt, peak, res = measure(device, lambda: vae.decode(z))
    per_px = None if peak is None else round((peak - out_bytes) / (h * w))
    record(f"decode_{size}_untiled", dt, peak, res, est_gib=est(h, w), measured_bytes_per_latent_px=per_px)

    if baseline:
        _, dt, peak, res = measure(device, lambda: vae.decode(z, chunk_frames=4))
        record(f"decode_{size}_untiled_c4", dt, peak, res, est_gib=est(h, w, 4))

    tile = (math.ceil((h + overlap) / 2), math.ceil((w + overlap) / 2))  # 2x2 grid
    out, dt, peak, res = measure(device, lambda: vae.decode(z, tile=tile, overlap=overlap))
    diff = (out - ref).abs()
    record(
        f"decode_{size}_tiled",
        dt,
        peak,
        res,
        tile=list(tile),
        est_gib=est(*tile),
        max_abs_diff_vs_untiled=round(diff.max().item(), 5),
        mean_abs_diff_vs_untiled=round(diff.mean().item(), 6),
    )
    del out, diff

    if size == "720p" and device.type == "cuda":
        # What 'auto' does on a 24 GiB card: the cap makes free_vram() see at most 24 GiB.
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, CAP_BYTES / total), torch.device(device).index or 0
        )
        name = "decode_720p_auto_24gib_cap"
        try:
            budget = V.free_vram(device) - out_bytes
            picked = V.pick_tile(vae, h, w, budget, overlap)
            out, dt, peak, res = measure(device, lambda: vae.decode(z, tile="auto", overlap=overlap))
            diff = (out - ref).abs().max().item()
            record(
                name,
                dt,
                peak,
                res,
                tile=picked and list(picked),
                budget_gib=gib(budget),
                max_abs_diff_vs_untiled=round(diff, 5),
            )
        except torch.cuda.OutOfMemoryError as e:
            record(name, float("nan"), None, None, oom=str(e).splitlines()[0])
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, torch.device(device).index or 0)


def bench_chunks(vae, scale, device, record, args) -> dict:
    """The chunked decode per variant: time per 16-frame chunk, PSNR against fp32, peak VRAM."""
    height, width = scale["chunk_size"]
    h, w, n, chunks = height // 8, width // 8, CHUNK_LATENT_FRAMES, scale["chunks"]
    z = torch.randn(16, n * chunks, h, w, generator=torch.Generator().manual_seed(2)).to(device)
    f16, b16 = torch.float16, torch.bfloat16
    variants = [  # (name, dtype, channels-last, frames per sub-chunk after a temporal upsample, levers)
        ("fp32", None, False, 2, {}),
        ("bf16", b16, False, 2, {}),
        ("bf16_channels_last", b16, True, 2, {}),
        ("fp16", f16, False, 2, {}),
        ("fp16_channels_last", f16, True, 2, {}),
        ("fp16_channels_last_c4", f16, True, 4, {}),  # upstream's 4 frames: larger convs, more memory
        ("fp16_channels_last_subpixel", f16, True, 2, {"subpixel": True}),
        ("fp16_channels_last_compiled", f16, True, 2, {"compile": True}),
        ("fp16_channels_last_compiled_subpixel", f16, True, 2, {"compile": True, "subpixel": True}),
        ("fp16_channels_last_compiled_subpixel_c4", f16, True, 4, {"compile": True, "subpixel": True}),
        ("bf16_channels_last_compiled_subpixel", b16, True, 2, {"compile": True, "subpixel": True}),
    ]
    if args.rows:
        wanted = set(args.rows.split(",")) | {"fp32"}  # fp32 is every row's reference
        unknown = wanted - {v[0] for v in variants}
        if unknown:
            raise SystemExit(
                f"--rows: unknown {', '.join(sorted(unknown))}; rows: {', '.join(v[0] for v in variants)}"
            )
        variants = [v for v in variants if v[0] in wanted]
    compile_issue = compiler_missing(device)
    if device.type == "cpu" and not args.cpu_compile:
        compile_issue = "CPU: inductor takes minutes to build; pass --cpu-compile"
    ref, fp32_s = None, None
    for name, dtype, channels_last, sub, levers in variants:
        if levers.get("compile") and compile_issue:
            record(f"chunk_{name}", float("nan"), None, None, skipped=compile_issue)
            continue
        settings = dict(chunk_frames=sub, dtype=dtype, channels_last=channels_last, **levers)
        try:
            # warm-up, untimed: kernels, cuDNN's algorithm search and, compiled, every graph (a stream's first
            # latent frame runs eagerly, the later ones compile); two chunks through a decoder of their own
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            with vae.chunk_decoder(**settings) as dec:
                for k in range(2):
                    dec.decode(z[:, k * n : (k + 1) * n])
            sync(device)
            warmup_s, graphs_warmup = time.perf_counter() - t0, counters["stats"]["unique_graphs"] - graphs
            if levers.get("compile") and (
                speed._shared_runners.get(V._call_step) is None or speed._shared_runners[V._call_step].failed
            ):
                raise RuntimeError("torch.compile failed; the decoder ran eagerly (see the log line above)")
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            outs, times, first = [], [], []
            graphs = counters["stats"]["unique_graphs"]
            with vae.chunk_decoder(**settings) as dec:
                t0 = time.perf_counter()
                outs.append(dec.decode(z[:, :n]))
                sync(device)
                first_chunk_s = time.perf_counter() - t0
                for k in range(1, chunks):
                    t0, pieces = time.perf_counter(), []
                    for piece in dec.stream(z[:, k * n : (k + 1) * n]):
                        pieces.append(piece)
                        if len(pieces) == 1:
                            sync(device)
                            first.append(time.perf_counter() - t0)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                    outs.append(torch.cat(pieces, dim=1))
            peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
            graphs_timed = counters["stats"]["unique_graphs"] - graphs
        except Exception as e:  # a variant's failure (compile error, out of memory) is its row; the rest run
            if name == "fp32":
                raise
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            record(f"chunk_{name}", float("nan"), None, None, error=error)
            dec = outs = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        video = torch.cat(outs, dim=1)
        chunk_s = statistics.median(times)
        row = dict(
            chunk_s=round(chunk_s, 4),
            first_chunk_s=round(first_chunk_s, 4),
            first_4_frames_s=round(statistics.median(first), 4),
            fps=round(n * 4 / chunk_s, 1),
            est_decode_gib=gib(vae.decode_bytes_per_latent_pixel(sub, dtype) * h * w),
        )
        if levers.get("compile"):  # the warm-up compiled every graph; the timed stream compiled none
            row.update(
                warmup_s=round(warmup_s, 1), graphs_compiled=graphs_warmup, graphs_while_timed=graphs_timed
            )
        if ref is None:
            ref, fp32_s = video, chunk_s
        else:
            mse = (video - ref).square().mean().item()
            row["psnr_db_vs_fp32"] = round(10 * math.log10(4 / mse), 2) if mse > 0 else math.inf
            row["time_vs_fp32"] = round(chunk_s / fp32_s, 3)
            row["meets_target"] = (
                row["time_vs_fp32"] <= TARGET_RATIO and row["psnr_db_vs_fp32"] >= TARGET_PSNR_DB
            )
        record(f"chunk_{name}", chunk_s, peak, None, **row)
        del video, outs
    return {
        "size": [height, width],
        "latent": [h, w],
        "latent_frames_per_chunk": n,
        "frames_per_chunk": 4 * n,
        "chunks_timed": chunks - 1,
        "target": {"time_vs_fp32_max": TARGET_RATIO, "psnr_db_min": TARGET_PSNR_DB},
        "weights_note": "random weights: PSNR measures arithmetic deviation, not image quality",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--workdir", default="/tmp/bench_vae")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument(
        "--vae",
        default=None,
        help="a real Wan2.1_VAE.pth / wan_2.1_vae.safetensors instead of random weights",
    )
    ap.add_argument("--sizes", default="480p,720p", help="comma list of 480p,720p")
    ap.add_argument("--no-baseline", action="store_true", help="skip the untiled_c4 (upstream chunking) runs")
    ap.add_argument("--cudnn-benchmark", action="store_true")
    ap.add_argument(
        "--mode",
        choices=["clip", "chunk"],
        default="clip",
        help="clip: whole-clip decode/encode, untiled vs tiled; chunk: the chunked decode, fp32 vs the fast decoder",
    )
    ap.add_argument(
        "--rows", default=None, help="chunk mode: a comma list of the variants to run (fp32 always runs)"
    )
    ap.add_argument(
        "--cpu-compile",
        action="store_true",
        help="chunk mode on the CPU: run the compiled rows too (inductor takes minutes there)",
    )
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.set_grad_enabled(False)

    vae, path, load_s = get_vae(args, scale, device)
    overlap = V.DEFAULT_OVERLAP if args.scale == "full" else 2
    frames = scale["frames"]
    summary = {
        "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "weights": str(path) if args.vae else "random",
        "load_s": round(load_s, 2),
        "weights_gib": gib(sum(p.numel() * p.element_size() for p in vae.parameters())),
        "cudnn_benchmark": args.cudnn_benchmark,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,  # the fp32 decode's convs on a GPU (torch's default)
        "overlap": overlap,
        "est_bytes_per_latent_px": vae.decode_bytes_per_latent_pixel(2),
        "cases": {},
    }
    # What tile='auto' picks for 720p (90x160 latent) when this much VRAM is free for the decode
    # (the fp32 output video, 0.84 GiB at 81 frames, is subtracted as decode() does).
    h, w = (s // 8 for s in scale["sizes"]["720p"])
    out_bytes = 3 * frames * h * w * 64 * 4
    summary["auto_tile_720p_by_free_gib"] = {
        str(g): V.pick_tile(vae, h, w, int(g * GIB) - out_bytes, overlap) for g in (6, 8, 12, 16, 24)
    }
    vae.decode(torch.randn(16, 2, 4, 4, device=device))  # warm-up: kernels, cuDNN heuristics

    def record(name, dt, peak, reserved, **extra):
        row = {
            "time_s": round(dt, 2),
            "peak_alloc_gib": gib(peak),
            "peak_reserved_gib": gib(reserved),
            **extra,
        }
        summary["cases"][name] = row
        print(name, json.dumps(row), flush=True)

    if args.mode == "chunk":
        summary["chunk"] = bench_chunks(vae, scale, device, record, args)
        print(json.dumps(summary))
        return 0
    for size in args.sizes.split(","):
        bench_decode(vae, size, scale, overlap, device, record, not args.no_baseline)

    height, width = scale["sizes"]["480p"]
    video = encode_input(frames, height, width, device)
    latent, dt, peak, res = measure(device, lambda: vae.encode(video))
    record("encode_480p", dt, peak, res, latent_shape=list(latent.shape))

    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
