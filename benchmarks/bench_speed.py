"""Benchmark: one sampling step of one NF4 expert under each speed option, against the kernel floor.

Writes a random expert in the NF4 repack's exact format under --workdir (full A14B cam size with
--scale full, reused when present; a tiny one with --scale tiny), loads it with the streaming loader,
and times one step through `wan.pipeline.denoise` (the real loop: CFG, attention backend, compiled
blocks) at 464x832x81 (31,668 tokens) for:
- eager: today's path (SDPA, no compile), two forwards per step (CFG);
- compile: regional torch.compile of the DiT blocks (first step timed separately: it compiles);
- sage / compile_sage: SageAttention, when `sageattention` is importable;
- cfg1: guide scale 1, one forward per step;
- floor: the same step's GEMMs at the real shapes as plain bf16 matmuls on dense weights, plus its
  self- and cross-attention with SDPA, on the same device (what kernels alone cost).

    python benchmarks/bench_speed.py --scale full --workdir /tmp/bench_speed     # CUDA
    python benchmarks/bench_speed.py --scale tiny                                # CPU, seconds

Prints one JSON line at the end.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders import stream, synthetic  # noqa: E402
from lingbot_world.wan import attention, i2v, pipeline  # noqa: E402
from lingbot_world.wan.config import A14B, CONTROL_CHANNELS, SampleConfig  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, SpeedStats, compiler_missing  # noqa: E402

# (height, width, frames, cond text tokens, uncond text tokens)
SHAPES = {"full": (464, 832, 81, 60, 120), "tiny": (32, 48, 5, 7, 5)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


class Step:
    """One denoising step (t = 999, the first of a 1-step schedule) through pipeline.denoise."""

    def __init__(self, model, cfg, device, shape):
        h, w, frames, n_ctx, n_null = shape
        lat_f, lat_h, lat_w = i2v.latent_frames(frames), h // 8, w // 8
        g = torch.Generator().manual_seed(0)
        self.noise = torch.randn(16, lat_f, lat_h, lat_w, generator=g).to(device)
        self.y = torch.randn(20, lat_f, lat_h, lat_w, generator=g).to(device)
        self.context = torch.randn(n_ctx, cfg.text_dim, generator=g).to(device)
        self.context_null = torch.randn(n_null, cfg.text_dim, generator=g).to(device)
        self.cam = torch.randn(1, CONTROL_CHANNELS["cam"], lat_f, lat_h, lat_w, generator=g).to(device)
        self.tokens = i2v.seq_len(lat_f, lat_h, lat_w)
        self.model, self.device = model, device

    def __call__(self, options: SpeedOptions, guide: float, stats: SpeedStats):
        settings = SampleConfig(sample_steps=1, guide_scale=(guide, guide))
        return pipeline.denoise(
            lambda which: self.model, self.noise, self.y, self.context, self.context_null, self.cam,
            settings, speed=options, stats=stats,
        )  # fmt: skip


def run_case(step: Step, options: SpeedOptions, guide: float, repeats: int) -> dict:
    device = step.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = SpeedStats()
    first = timed(lambda: step(options, guide, stats), device, 1)[0]  # warm-up; compiles if asked
    stats = SpeedStats()
    times = timed(lambda: step(options, guide, stats), device, repeats)
    result = {
        "step_s": round(min(times), 4),
        "steps_s": [round(t, 4) for t in times],
        "first_step_s": round(first, 4),
        "forwards": stats.total_forwards // repeats,
        "compiled": stats.compiled,
    }
    if device.type == "cuda":
        result["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / (1 << 30), 2)
    return result


def kernel_floor(cfg, tokens: int, device, repeats: int, forwards: int) -> dict:
    """The step's GEMMs (bf16 matmuls at the real shapes, dense weights) and attention (SDPA), timed
    one of each per block and scaled by blocks x forwards."""
    dt, dim, ffn, heads = torch.bfloat16, cfg.dim, cfg.ffn_dim, cfg.num_heads
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    x, ctx, hidden = rand(tokens, dim), rand(cfg.text_len, dim), rand(tokens, ffn)  # context padded
    w_sq, w_up, w_down = rand(dim, dim), rand(ffn, dim), rand(dim, ffn)
    # per block: self q/k/v/o, cross q/o, the camera injector's four layers (token length);
    # cross k/v (text_len rows); FFN up and down
    gemms = {
        "dim_x_dim_tokens": (lambda: F.linear(x, w_sq), 10),
        "dim_x_dim_text": (lambda: F.linear(ctx, w_sq), 2),
        "ffn_up": (lambda: F.linear(x, w_up), 1),
        "ffn_down": (lambda: F.linear(hidden, w_down), 1),
    }
    d = dim // heads
    q = rand(1, heads, tokens, d)
    kv_text = rand(1, heads, cfg.text_len, d)
    attn = {
        "self_attention": lambda: F.scaled_dot_product_attention(q, q, q),
        "cross_attention": lambda: F.scaled_dot_product_attention(q, kv_text, kv_text),
    }
    per_block, detail = {"gemm": 0.0, "attention": 0.0}, {}
    for name, (fn, count) in gemms.items():
        fn()
        t = min(timed(fn, device, repeats))
        detail[name] = {"ms": round(t * 1e3, 3), "per_block": count}
        per_block["gemm"] += t * count
    for name, fn in attn.items():
        fn()
        t = min(timed(fn, device, repeats))
        detail[name] = {"ms": round(t * 1e3, 3), "per_block": 1}
        per_block["attention"] += t
    scale = cfg.num_layers * forwards
    return {
        "gemm_s": round(per_block["gemm"] * scale, 4),
        "attention_s": round(per_block["attention"] * scale, 4),
        "step_s": round((per_block["gemm"] + per_block["attention"]) * scale, 4),
        "forwards": forwards,
        "kernels": detail,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per case (after one warm-up)")
    ap.add_argument("--skip", nargs="*", default=[], help="cases to leave out (eager is always run)")
    ap.add_argument("--cpu-compile", action="store_true", help="also compile on CPU (minutes to build)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs a CUDA GPU")
    device = torch.device("cuda" if cuda else "cpu")
    # tiny: every Linear input at least one NF4 block (64) wide, as bnb's CPU kernel needs
    cfg = A14B if args.scale == "full" else synthetic.tiny_config("cam", text_dim=64, text_len=64)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        folder = workdir / f"{args.scale}_expert_nf4"
        if not (folder / "config.json").is_file():
            t0 = time.perf_counter()
            synthetic.write_nf4_expert(folder, cfg, seed=0, mode="random")
            print(f"wrote {folder} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        t0 = time.perf_counter()
        model = stream.load_expert(folder, device)
        load_s = time.perf_counter() - t0

    step = Step(model, cfg, device, SHAPES[args.scale])
    sage_issue = None
    try:
        attention.resolve("sage")
    except RuntimeError as err:
        sage_issue = str(err)
    compile_issue = compiler_missing(device)
    if device.type == "cpu" and not args.cpu_compile:
        compile_issue = "CPU: inductor takes minutes to build; pass --cpu-compile"

    cases = {
        "eager": (SpeedOptions(), 5.0, None),
        "compile": (SpeedOptions(compile=True), 5.0, compile_issue),
        "sage": (SpeedOptions(attention="sage"), 5.0, sage_issue),
        "compile_sage": (SpeedOptions(attention="sage", compile=True), 5.0, sage_issue or compile_issue),
        "cfg1": (SpeedOptions(), 1.0, None),
    }
    summary = {
        "bench": "speed",
        "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "size": list(SHAPES[args.scale][:3]),
        "tokens": step.tokens,
        "load_s": round(load_s, 2),
    }
    for name, (options, guide, issue) in cases.items():
        if name != "eager" and name in args.skip:
            summary[name] = {"skipped": "--skip"}
        elif issue is not None:
            summary[name] = {"skipped": issue}
        else:
            summary[name] = run_case(step, options, guide, args.repeats)
            print(f"{name}: {summary[name]}", file=sys.stderr)
    floor = kernel_floor(cfg, step.tokens, device, max(args.repeats, 3), forwards=2)
    summary["floor"] = floor
    summary["eager_over_floor"] = round(summary["eager"]["step_s"] / floor["step_s"], 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
