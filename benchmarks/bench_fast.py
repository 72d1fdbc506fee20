"""Benchmark: LingBot-World-Fast chunk latency (wan/fast.py) on a random NF4 cam expert, per cache setting.

Writes (or reuses) a random expert in the NF4 repack's format under --workdir (full A14B size with
--scale full, tiny with --scale tiny), loads it with the streaming loader, and generates a clip of
--chunks chunks (3 latent frames each) at 464x832 (1508 tokens per latent frame) through
`wan.fast.FastSession` for each setting: the unbounded cache (upstream's default), windows with a
3-frame sink (local 6, 9 and 21 latent frames; a window not shorter than the clip is skipped, it
equals the unbounded cache), and the unbounded cache stored in fp8 (kv_dtype float8_e4m3fn). Per
chunk: wall time of the 4 denoising steps and of the commit pass, timed separately; per setting:
peak VRAM, the caches' bytes, and the video frame rate it sustains (12 new video frames per chunk over
the mean chunk latency after the first chunk) against real time (16 fps).

--vram-cap-gib N limits this process to N GiB of the card (torch.cuda.set_per_process_memory_fraction);
a setting that does not fit is reported as out of memory. --upstream DIR adds a baseline: upstream's
own WanModelFast (DIR holds upstream LingBot-World's source tree with wan/modules/model_fast.py) in
bf16 with dense random weights built on the device (~37 GB of weights, so a big card only), running
the same chunks through its own forward and KV cache under bf16 autocast, timed the same way.

    python benchmarks/bench_fast.py --scale full --workdir /tmp/bench_speed [--upstream DIR]  # CUDA
    python benchmarks/bench_fast.py --scale tiny                                               # CPU

Prints one JSON line at the end.
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
import time
import types
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_speed import load_random_expert, set_vram_cap, sync  # noqa: E402
from lingbot_world.wan.config import CONTROL_CHANNELS  # noqa: E402
from lingbot_world.wan.fast import CHUNK_FRAMES, FastConfig, FastSession  # noqa: E402
from lingbot_world.wan.schedulers import sampling_sigmas  # noqa: E402

SIZES = {"full": (464, 832), "tiny": (32, 48)}
CHUNKS = {"full": 7, "tiny": 4}  # full: 21 latent frames, the 81-frame clip
GIB = 2**30
VIDEO_FPS = 16
FRAMES_PER_CHUNK = CHUNK_FRAMES * 4  # new video frames per chunk (the first gives 9)


def settings() -> dict:
    out = {"full": FastConfig()}
    for local in (6, 9, 21):
        out[f"local{local}_sink3"] = FastConfig(local_attn_size=local, sink_size=3)
    out["full_kv_fp8"] = FastConfig(kv_dtype=torch.float8_e4m3fn)
    return out


def inputs(cfg, lat, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(20, *lat, generator=g).to(device)
    ctx = torch.randn(min(60, cfg.text_len), cfg.text_dim, generator=g).to(device)
    cam = torch.randn(1, CONTROL_CHANNELS["cam"], *lat, generator=g).to(device)
    return y, ctx, cam


def summarize(chunk_s, steps_s, commit_s, peak, kv_bytes) -> dict:
    steady = chunk_s[1:] or chunk_s
    mean = sum(steady) / len(steady)
    fps = FRAMES_PER_CHUNK / mean
    return {
        "chunk_s": [round(v, 4) for v in chunk_s],
        "steps_s": [round(v, 4) for v in steps_s],
        "commit_s": [round(v, 4) for v in commit_s],
        "mean_chunk_s": round(mean, 4),
        "video_fps": round(fps, 2),
        "realtime_16fps": fps >= VIDEO_FPS,
        "peak_vram_gib": None if peak is None else round(peak / GIB, 2),
        "kv_cache_gib": round(kv_bytes / GIB, 3),
        "kv_cache_bytes": kv_bytes,
    }


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_ours(model, cfg, lat, device, fast: FastConfig, chunks: int) -> dict:
    y, ctx, cam = inputs(cfg, lat, device)
    peak_reset(device)
    session = FastSession(model, ctx, y, lat, fast, device)
    times, forward = [], session._forward

    def timed_forward(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        sync(device)
        times.append(time.perf_counter() - t0)
        return out

    session._forward = timed_forward
    chunk_s, steps_s, commit_s, kv = [], [], [], 0
    try:
        for k in range(chunks):
            times.clear()
            sync(device)
            t0 = time.perf_counter()
            session.next_chunk(cam[:, :, k * CHUNK_FRAMES : (k + 1) * CHUNK_FRAMES])
            sync(device)
            chunk_s.append(time.perf_counter() - t0)
            commit_s.append(times[-1])
            steps_s.append(chunk_s[-1] - times[-1])
            kv = max(kv, session.kv_cache_bytes())
        return summarize(chunk_s, steps_s, commit_s, peak(device), kv)
    finally:
        session.close()


def load_upstream_module(folder: Path, device, name: str):
    """Upstream's wan/modules/<name>.py as a module (its package __init__ files bypassed; diffusers
    replaced by the golden script's stand-ins when it is not installed; its flash_attention by an SDPA
    stand-in when no flash_attn package is importable, as its own attention() falls back to SDPA; on the
    CPU, where upstream has no autocast, both by the golden script's fp32 stand-ins)."""
    if not (folder / "wan" / "modules" / f"{name}.py").is_file():
        raise SystemExit(f"--upstream {folder}: expected upstream's source tree with wan/modules/{name}.py")
    sys.path.insert(0, str(HERE.parent / "tests" / "golden"))
    golden = importlib.import_module("make_golden")
    stubs = {} if importlib.util.find_spec("diffusers") else golden._diffusers()
    for pkg in ("wan", "wan.modules"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(folder.joinpath(*pkg.split(".")))]
        stubs[pkg] = mod
    sys.modules.update(stubs)
    attn = importlib.import_module("wan.modules.attention")
    module = importlib.import_module(f"wan.modules.{name}")
    if device.type == "cpu" or not (attn.FLASH_ATTN_2_AVAILABLE or attn.FLASH_ATTN_3_AVAILABLE):
        module.flash_attention = golden.flash_attention
    if device.type == "cpu" and hasattr(module, "attention"):
        module.attention = golden.attention
    return module


def load_upstream_fast(folder: Path, device):
    return load_upstream_module(folder, device, "model_fast")


@torch.no_grad()
def run_upstream(folder: Path, cfg, lat, device, chunks: int) -> dict:
    """Upstream's WanModelFast forward with its caches, the chunk loop of WanI2VFast.generate (4 steps,
    x0 and re-noise, the commit pass), unbounded cache."""
    model_fast = load_upstream_fast(folder, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # no CPU autocast upstream
    previous = torch.get_default_dtype()
    t0 = time.perf_counter()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_fast.WanModelFast(
                model_type="i2v",
                control_type="cam",
                patch_size=cfg.patch_size,
                text_len=cfg.text_len,
                in_dim=cfg.in_dim,
                dim=cfg.dim,
                ffn_dim=cfg.ffn_dim,
                freq_dim=cfg.freq_dim,
                text_dim=cfg.text_dim,
                out_dim=cfg.out_dim,
                num_heads=cfg.num_heads,
                num_layers=cfg.num_layers,
                qk_norm=cfg.qk_norm,
                cross_attn_norm=cfg.cross_attn_norm,
                eps=cfg.eps,
            ).eval()
    finally:
        torch.set_default_dtype(previous)
    build_s = time.perf_counter() - t0
    y, ctx, cam = inputs(cfg, lat, device)
    lat_f, lat_h, lat_w = lat
    frame_seqlen = lat_h * lat_w // 4
    kv_size = frame_seqlen * lat_f
    head_dim = cfg.dim // cfg.num_heads
    peak_reset(device)

    def zeros(*shape):
        return torch.zeros(shape, dtype=dtype, device=device)

    self_kv = [
        {
            "k": zeros(1, kv_size, cfg.num_heads, head_dim),
            "v": zeros(1, kv_size, cfg.num_heads, head_dim),
            "global_end_index": torch.tensor([0], device=device),
            "local_end_index": torch.tensor([0], device=device),
        }
        for _ in range(cfg.num_layers)
    ]
    cross_kv = [
        {
            "k": zeros(1, cfg.text_len, cfg.num_heads, head_dim),
            "v": zeros(1, cfg.text_len, cfg.num_heads, head_dim),
            "is_init": torch.tensor(0, dtype=torch.int32, device=device),
        }
        for _ in range(cfg.num_layers)
    ]
    kv_bytes = sum(t.numel() * t.element_size() for d in self_kv + cross_kv for t in (d["k"], d["v"]))
    g = torch.Generator(device=device).manual_seed(42)
    noise = torch.randn(16, *lat, generator=g, device=device)
    fast = FastConfig()
    table_t, table_s = sampling_sigmas(1000, fast.shift)
    ts = table_t[list(fast.timestep_index)].to(device)  # 999, 978, 947, 825
    sigmas = table_s[list(fast.timestep_index)].double().to(device)
    autocast = torch.amp.autocast("cuda", dtype=dtype) if device.type == "cuda" else contextlib.nullcontext()
    chunk_s, steps_s, commit_s = [], [], []
    first = True
    with autocast:
        for k in range(chunks):
            sl = slice(k * CHUNK_FRAMES, (k + 1) * CHUNK_FRAMES)
            kwargs = dict(
                context=[ctx],
                seq_len=CHUNK_FRAMES * frame_seqlen,
                y=[y[:, sl].to(dtype)],
                dit_cond_dict={"c2ws_plucker_emb": (cam[:, :, sl].to(dtype),)},
                kv_cache=self_kv,
                crossattn_cache=cross_kv,
                current_start=k * CHUNK_FRAMES * frame_seqlen,
                max_attention_size=kv_size,
                frame_seqlen=frame_seqlen,
            )
            latent = noise[:, sl]
            sync(device)
            t0 = time.perf_counter()
            for j in range(len(ts)):
                flow = model(x=[latent], t=ts[j : j + 1], cross_attn_first_call=first, **kwargs)[0]
                first = False
                x0 = (latent.double() - sigmas[j] * flow.double()).float()
                if j < len(ts) - 1:
                    eps = torch.randn(x0.shape, generator=g, device=device)
                    s = sigmas[j + 1].float()
                    latent = (1 - s) * x0 + s * eps
            sync(device)
            t1 = time.perf_counter()
            model(x=[x0], t=ts[:1] * 0.0, cross_attn_first_call=False, **kwargs)
            sync(device)
            t2 = time.perf_counter()
            chunk_s.append(t2 - t0)
            steps_s.append(t1 - t0)
            commit_s.append(t2 - t1)
    out = summarize(chunk_s, steps_s, commit_s, peak(device), kv_bytes)
    out["build_s"] = round(build_s, 2)
    out["weights"] = f"dense {str(dtype).removeprefix('torch.')}, random"
    del model, self_kv, cross_kv
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per clip (full: 7 = 81 frames; tiny: 4)")
    ap.add_argument("--vram-cap-gib", type=float, default=None, help="limit this process to N GiB of the GPU")
    ap.add_argument("--upstream", type=Path, default=None, help="upstream source tree: add its baseline")
    ap.add_argument("--skip", nargs="*", default=[], help="settings to leave out")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*autocast.*")  # upstream's CUDA autocast blocks on CPU
    chunks = args.chunks or CHUNKS[args.scale]
    if chunks < 1:
        raise SystemExit(f"--chunks must be >= 1, got {chunks}")

    device, cfg, model, load_s = load_random_expert(args.scale, args.workdir)
    cap = set_vram_cap(device, args.vram_cap_gib)
    h, w = SIZES[args.scale]
    lat = (chunks * CHUNK_FRAMES, h // 8, w // 8)
    summary = {
        "bench": "fast",
        "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": [h, w],
        "latent": list(lat),
        "video_frames": (lat[0] - 1) * 4 + 1,
        "tokens_per_chunk": CHUNK_FRAMES * (lat[1] // 2) * (lat[2] // 2),
        "chunks": chunks,
        "load_s": round(load_s, 2),
        "vram_cap_gib": cap,
        "target_fps": VIDEO_FPS,
    }
    # warm-up: one chunk (kernel selection, allocator), not timed
    run_ours(model, cfg, (CHUNK_FRAMES, *lat[1:]), device, FastConfig(), 1)
    results = {}
    for name, fast in settings().items():
        if name in args.skip:
            results[name] = {"skipped": "--skip"}
        elif fast.local_attn_size >= lat[0]:
            results[name] = {"skipped": f"window {fast.local_attn_size} >= clip ({lat[0]} latent frames)"}
        else:
            try:
                results[name] = run_ours(model, cfg, lat, device, fast, chunks)
            except torch.OutOfMemoryError as err:
                results[name] = {"out_of_memory": str(err).split("\n")[0][:200]}
            peak_reset(device)
        print(f"{name}: {results[name]}", file=sys.stderr)
    summary["settings"] = results
    if args.upstream is None:
        summary["upstream"] = {"skipped": "no --upstream"}
    else:
        del model
        peak_reset(device)
        try:
            summary["upstream"] = run_upstream(args.upstream.resolve(), cfg, lat, device, chunks)
        except torch.OutOfMemoryError as err:
            summary["upstream"] = {"out_of_memory": str(err).split("\n")[0][:200]}
        print(f"upstream: {summary['upstream']}", file=sys.stderr)
        if "mean_chunk_s" in summary["upstream"] and "mean_chunk_s" in results["full"]:
            summary["full_over_upstream"] = round(
                results["full"]["mean_chunk_s"] / summary["upstream"]["mean_chunk_s"], 3
            )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
