"""Benchmark: the native ComfyUI graph against the pack's own sampler, same card, same request.

Native: each random NF4 expert loaded as a core MODEL (LingBot-World Model (native)'s code: the pack's loader into
host RAM, then `nodes.native_model.build_model`), ModelSamplingSD3, two core KSamplerAdvanced (euler/simple, the
high expert for the first `--split` steps) with ComfyUI's own model management loading, offloading and
partially loading the experts. Pack: `wan.pipeline.denoise` (what LingBot-World Sampler runs) with the experts
streamed by the pack's ExpertSwitcher, Euler, the boundary placed at the same step. Both get the same random
text, first-frame latent, mask and camera tensor (no text encoder or VAE: the DiT's work only), 464x832x81 at
full scale. Reported per side: peak VRAM (torch's allocator), ComfyUI's loaded/offloaded bytes per expert,
anonymous-RSS growth of the expert loads and of the run, and step times (median of the steps after each
expert's first).

Needs ComfyUI importable: `--comfyui DIR` (or COMFYUI_DIR) names a checkout (an untracked copy carried to the
device works), run with an interpreter that has ComfyUI's requirements plus the pack's (bitsandbytes):

    python benchmarks/bench_native.py --comfyui /path/to/ComfyUI --scale full --workdir /tmp/bench_native \
        --vram-cap-gib 24      # CUDA: two random full-size NF4 experts (~2 x 10 GB) are written once
    python benchmarks/bench_native.py --comfyui /path/to/ComfyUI --scale tiny    # CPU, seconds

The cap is enforced on torch (per-process memory fraction) and told to ComfyUI (its reserved VRAM), so its
model management plans for the capped card. Prints one JSON line at the end.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comfyui", type=Path, default=os.environ.get("COMFYUI_DIR"), help="a ComfyUI checkout")
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="where the random experts are written (reused)"
    )
    ap.add_argument("--steps", type=int, default=6, help="sampling steps of each run")
    ap.add_argument("--split", type=int, default=3, help="steps of the high-noise expert")
    ap.add_argument("--vram-cap-gib", type=float, default=None, help="CUDA: cap the process at this many GiB")
    args = ap.parse_args()
    if args.comfyui is None or not (args.comfyui / "comfy" / "model_management.py").is_file():
        raise SystemExit("--comfyui (or COMFYUI_DIR) must name a ComfyUI checkout")
    if not 0 < args.split < args.steps:
        raise SystemExit(f"--split must be between 1 and --steps - 1, got {args.split}")
    return args


def main() -> int:
    args = parse()
    import torch

    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs a CUDA GPU")
    sys.path.insert(0, str(args.comfyui))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = not cuda
    if args.vram_cap_gib is not None:
        if not cuda:
            raise SystemExit("--vram-cap-gib needs a CUDA GPU")
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        comfy_args.reserve_vram = max(
            0.0, (total - args.vram_cap_gib * GIB) / GIB
        )  # ComfyUI plans for the cap
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_cap_gib * GIB / total))
    import comfy.model_management as mm
    from comfy_extras.nodes_model_advanced import ModelSamplingSD3

    from nodes import KSamplerAdvanced

    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from bench_speed import SHAPES

    from lingbot import load_pack

    load_pack()
    from lingbot_world.loaders import monitor, synthetic
    from lingbot_world.loaders.experts import ExpertSwitcher
    from lingbot_world.loaders.formats import detect_expert_format
    from lingbot_world.loaders.stream import load_expert
    from lingbot_world.nodes.native_model import build_model
    from lingbot_world.wan import i2v, pipeline
    from lingbot_world.wan.config import A14B, CONTROL_CHANNELS, SampleConfig
    from lingbot_world.wan.schedulers import FlowEulerScheduler
    from lingbot_world.wan.vae import normalize_latent

    device = mm.get_torch_device()
    cfg = A14B if args.scale == "full" else synthetic.tiny_config("cam", text_dim=64, text_len=64)
    workdir = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / "bench_native"
    paths = {}
    for seed, name in enumerate(("high", "low")):
        folder = workdir / f"{args.scale}_{name}_nf4"
        if not (folder / "config.json").is_file():
            t0 = time.perf_counter()
            synthetic.write_nf4_expert(folder, cfg, seed=seed, mode="random")
            print(f"wrote {folder} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        paths[name] = folder

    h, w, frames, n_ctx, n_null = SHAPES[args.scale]
    lat_f, lat_h, lat_w = i2v.latent_frames(frames), h // 8, w // 8
    g = torch.Generator().manual_seed(0)
    context = torch.randn(n_ctx, cfg.text_dim, generator=g)
    context_null = torch.randn(n_null, cfg.text_dim, generator=g)
    raw = torch.randn(1, 16, lat_f, lat_h, lat_w, generator=g)  # a first-frame latent in ComfyUI's convention
    cam = torch.randn(1, CONTROL_CHANNELS["cam"], lat_f, lat_h, lat_w, generator=g).to(torch.bfloat16)
    mask = torch.ones(1, 1, lat_f, lat_h, lat_w)
    mask[:, :, :1] = 0.0
    extra = {"concat_latent_image": raw, "concat_mask": mask, "lingbot_camera": cam}
    positive = [[context[None], {"pooled_output": None, **extra}]]
    negative = [[context_null[None], {"pooled_output": None, **extra}]]
    latent = {"samples": torch.zeros(1, 16, lat_f, lat_h, lat_w)}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def peak_reset():
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def peak() -> float | None:
        return round(torch.cuda.max_memory_allocated(device) / GIB, 3) if cuda else None

    def step_stats(stamps: dict) -> dict:
        """{phase: [times of each step's end]} and the phase starts -> medians and firsts."""
        out = {}
        for phase, (start, ends) in stamps.items():
            times = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
            out[phase] = {
                "first_step_s": round(times[0], 4),
                "step_s": round(statistics.median(times[1:] or times), 4),
                "steps": len(times),
            }
        return out

    # --- native: the experts as core MODELs, two KSamplerAdvanced
    monitor.free_memory()
    with monitor.RssSampler() as load_rss:
        t0 = time.perf_counter()
        models = {}
        for name, path in paths.items():
            src = detect_expert_format(path)
            models[name] = build_model(src.dit_config, load_expert(src, "cpu"), torch.bfloat16)
        native_load_s = time.perf_counter() - t0
    loaded = {}
    stamps = {}

    def after_step(name):
        """A post-CFG function: called once per sampling step, after both branches; stamps the step's end."""

        def run(a):
            if name not in loaded:  # ComfyUI has loaded the expert for this sampler: what it put where
                m = models[name]
                loaded[name] = {
                    "model_gib": round(m.model_size() / GIB, 3),
                    "loaded_gib": round(m.loaded_size() / GIB, 3),
                    "lowvram": bool(getattr(m.model, "model_lowvram", False)),
                }
            sync()
            stamps[name][1].append(time.perf_counter())
            return a["denoised"]

        return run

    patched = {}
    for name, m in models.items():
        m.set_model_sampler_post_cfg_function(after_step(name))
        patched[name] = ModelSamplingSD3().patch(m, 10.0)[0]
    peak_reset()
    ks = KSamplerAdvanced()

    def expert(name, add_noise, start_latent, start, end, leftover):
        """KSamplerAdvanced's steps start..end of the 2-expert run on expert `name`, timed from here."""
        stamps[name] = (time.perf_counter(), [])
        sample = (patched[name], add_noise, 0, args.steps, 5.0, "euler", "simple", positive, negative)
        return ks.sample(*sample, start_latent, start, end, leftover)[0]

    with monitor.RssSampler() as run_rss:
        t0 = time.perf_counter()
        mid = expert("high", "enable", latent, 0, args.split, "enable")
        expert("low", "disable", mid, args.split, 10000, "disable")
        sync()
        native_run_s = time.perf_counter() - t0
    native = {
        "load_s": round(native_load_s, 2),
        "load_rss_growth_gib": round((load_rss.peak - load_rss.start_bytes) / GIB, 3),
        "run_s": round(native_run_s, 2),
        "run_rss_peak_gib": round(run_rss.peak / GIB, 3),
        "peak_vram_gib": peak(),
        "comfy_loading": loaded,
        "phases": step_stats(stamps),
    }
    sigmas = patched["high"].get_model_object("model_sampling")
    import comfy.samplers

    sigmas = comfy.samplers.calculate_sigmas(sigmas, "simple", args.steps).float().cpu()
    models.clear()
    patched.clear()
    del mid, m
    mm.unload_all_models()
    mm.soft_empty_cache()
    monitor.free_memory()

    # --- the pack: pipeline.denoise, experts streamed one at a time by the ExpertSwitcher
    def scheduler(solver, steps, shift, dev):  # the pack's Euler on the same sigmas
        s = FlowEulerScheduler(steps, shift, dev)
        s.sigmas, s.timesteps = sigmas, (sigmas[:-1] * 1000).to(dev)
        return s

    pipeline.make_scheduler = scheduler
    boundary = float(sigmas[args.split - 1] + sigmas[args.split]) / 2
    settings = SampleConfig(
        sample_steps=args.steps, boundary=boundary, guide_scale=(5.0, 5.0), solver="euler"
    )
    y = torch.cat([i2v.first_frame_mask(frames, lat_h, lat_w), normalize_latent(raw[0])]).to(device)
    switcher = ExpertSwitcher(paths, device)
    pack_stamps = {}

    def progress(i, n, x):
        sync()
        which = "high" if i <= args.split else "low"
        pack_stamps[which][1].append(time.perf_counter())

    def experts(name):
        model = switcher(name)
        sync()
        pack_stamps[name] = (time.perf_counter(), [])
        return model

    peak_reset()
    with monitor.RssSampler() as pack_rss:
        t0 = time.perf_counter()
        noise = i2v.make_noise(0, lat_f, lat_h, lat_w, device)
        pipeline.denoise(
            experts,
            noise,
            y,
            context.to(device),
            context_null.to(device),
            cam.to(device),
            settings,
            pipeline.Hooks(progress=progress),
        )
        sync()
        pack_run_s = time.perf_counter() - t0
    switcher.close()
    ours = {
        "run_s": round(pack_run_s, 2),
        "run_rss_growth_gib": round((pack_rss.peak - pack_rss.start_bytes) / GIB, 3),
        "run_rss_peak_gib": round(pack_rss.peak / GIB, 3),
        "peak_vram_gib": peak(),
        "phases": step_stats(pack_stamps),
        "note": "run_s includes streaming each expert from disk; the native load_s is separate",
    }
    summary = {
        "bench": "native",
        "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "size": [h, w, frames],
        "tokens": i2v.seq_len(lat_f, lat_h, lat_w),
        "steps": args.steps,
        "split": args.split,
        "vram_cap_gib": args.vram_cap_gib,
        "native": native,
        "pack": ours,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
