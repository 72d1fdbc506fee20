"""Benchmark: one sampling step of one NF4 expert under each speed option, against the kernel floor.

Writes a random expert in the NF4 repack's exact format under --workdir (full A14B cam size with
--scale full, reused when present; a tiny one with --scale tiny), loads it with the streaming loader,
and times one step through `wan.pipeline.denoise` (the real loop: CFG, attention backend, compiled
blocks) at 464x832x81 (31,668 tokens) for:
- eager: today's path (SDPA, no compile), two forwards per step (CFG);
- compile: regional torch.compile of the DiT blocks (first step timed separately: it compiles);
- sage / compile_sage: SageAttention, when `sageattention` is importable;
- cfg1: guide scale 1, one forward per step;
- lora: eager with a random rank-64 LoRA attached to every Linear of the expert (side path);
- cache: a short multi-step run at a small size with EasyCache at several thresholds: forwards
  skipped, time, and the final latent's deviation from the uncached run (random weights: this says
  nothing about image quality);
- floor: the same step's GEMMs at the real shapes as plain bf16 matmuls on dense weights (with their
  biases), plus its self- and cross-attention with SDPA over distinct q/k/v, on the same device (what
  kernels alone cost): `sustained_step_s` runs the step's whole kernel sequence back to back (the
  power-limited clock a real step runs at), `step_s` sums each kernel timed alone in short bursts;
  floor_light: the earlier burst floor without biases and with q = k = v (no sustained figure).
--profile CASE ...: the cases' top device kernels by time over one more step.

    python benchmarks/bench_speed.py --scale full --workdir /tmp/bench_speed     # CUDA
    python benchmarks/bench_speed.py --scale tiny                                # CPU, seconds

Prints one JSON line at the end.
"""

import argparse
import functools
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
from lingbot_world.wan.lora import Lora, attach_lora, detach_all, lora_targets  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, SpeedStats, compiler_missing  # noqa: E402

# (height, width, frames, cond text tokens, uncond text tokens)
SHAPES = {"full": (464, 832, 81, 60, 120), "tiny": (32, 48, 5, 7, 5)}
CACHE_SHAPES = {"full": (240, 416, 17, 60, 120), "tiny": (32, 48, 5, 7, 5)}
CACHE_STEPS, CACHE_THRESHOLDS = 20, (0.0, 0.05, 0.1, 0.2)


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


def set_vram_cap(device, gib: float | None) -> float | None:
    """Limit this process to `gib` GiB of the current CUDA card (None: no limit); returns the cap."""
    if gib is None:
        return None
    if device.type != "cuda":
        raise SystemExit("--vram-cap-gib needs a CUDA GPU")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * (1 << 30) / total), index)
    return gib


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

    def __call__(self, options: SpeedOptions, guide: float, stats: SpeedStats, steps: int = 1):
        # boundary 0: every step on this one expert
        settings = SampleConfig(sample_steps=steps, guide_scale=(guide, guide), boundary=0.0)
        return pipeline.denoise(
            lambda which: self.model,
            self.noise,
            self.y,
            self.context,
            self.context_null,
            self.cam,
            settings,
            speed=options,
            stats=stats,
        )


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def run_case(step: Step, options: SpeedOptions, guide: float, repeats: int, reference=None) -> dict:
    device = step.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats, out = SpeedStats(), {}
    first = timed(lambda: out.update(latent=step(options, guide, stats)), device, 1)[0]  # warm-up; compiles
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
    if reference is not None:
        result["rel_error_vs_eager"] = rel_error(out["latent"], reference)
    result["latent"] = out["latent"]
    return result


def kernel_profile(run, device, top: int = 25) -> list[dict]:
    """`run()` once under torch.profiler: the `top` device kernels by total time (name, ms, calls), and a
    last row with the rest. Shows where a case's time goes next to the floor's GEMMs and attention."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        run()
        sync(device)
    attr = "device_time_total" if activity == ProfilerActivity.CUDA else "self_cpu_time_total"
    rows = sorted(
        ((e.key, getattr(e, attr) / 1e3, e.count) for e in prof.key_averages() if getattr(e, attr) > 0),
        key=lambda r: -r[1],
    )
    out = [{"kernel": k[:120], "ms": round(ms, 2), "calls": n} for k, ms, n in rows[:top]]
    rest = rows[top:]
    out.append({"kernel": f"({len(rest)} others)", "ms": round(sum(r[1] for r in rest), 2), "calls": 0})
    return out


def random_lora(model, rank: int, seed: int = 0) -> Lora:
    """Rank-`rank` low-rank patches on every Linear of the model (what a full LoRA touches)."""
    g = torch.Generator().manual_seed(seed)
    patches = {}
    for name, t in lora_targets(model).items():
        if t.kind == "linear":
            out_f, in_f = t.weight
            down = torch.randn(rank, in_f, generator=g, dtype=torch.bfloat16) * in_f**-0.5
            up = torch.randn(out_f, rank, generator=g, dtype=torch.bfloat16) * 0.01
            patches[name] = (down, up, float(rank))
    return Lora(patches, 1.0, f"random rank-{rank}")


def lora_case(step: Step, repeats: int, rank: int, eager: dict) -> dict:
    device = step.device
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    attach_lora(step.model, random_lora(step.model, rank))
    attach_s = time.perf_counter() - t0
    added = (torch.cuda.memory_allocated(device) - before) / (1 << 30) if device.type == "cuda" else None
    try:
        result = run_case(step, SpeedOptions(), 5.0, repeats)
    finally:
        detach_all(step.model)
    result.update(
        rank=rank,
        attach_s=round(attach_s, 3),
        vram_added_gib=None if added is None else round(added, 3),
        overhead=round(result["step_s"] / eager["step_s"] - 1, 4),
    )
    return result


def cache_cases(model, cfg, device, scale: str) -> dict:
    """A CACHE_STEPS-step run (guide 5) per threshold on a small latent: skipped forwards, time, and
    the deviation of the final latent from the uncached run."""
    step = Step(model, cfg, device, CACHE_SHAPES[scale])
    out, exact = {"size": list(CACHE_SHAPES[scale][:3]), "steps": CACHE_STEPS}, None
    for threshold in (None, *CACHE_THRESHOLDS):
        options = (
            SpeedOptions()
            if threshold is None
            else SpeedOptions(
                cache="easycache", cache_threshold=threshold, cache_keep_first=3, cache_keep_last=1
            )
        )
        stats, res = SpeedStats(), {}
        t = timed(
            lambda o=options, s=stats, r=res: r.update(latent=step(o, 5.0, s, steps=CACHE_STEPS)), device, 1
        )[0]
        if threshold is None:
            exact = res["latent"]
            out["exact"] = {"wall_s": round(t, 3), "forwards": stats.total_forwards}
            continue
        out[f"threshold_{threshold}"] = {
            "wall_s": round(t, 3),
            "forwards": stats.total_forwards,
            "skipped_forwards": stats.total_skipped,
            "rel_error_vs_exact": rel_error(res["latent"], exact),
            "bit_identical": torch.equal(res["latent"], exact),
        }
    return out


def kernel_floor(cfg, tokens: int, device, repeats: int, forwards: int, exact: bool = True) -> dict:
    """The step's GEMMs (bf16 matmuls at the real shapes, dense weights) and attention (SDPA), timed
    one of each per block and scaled by blocks x forwards. `exact`: as the model runs them, every GEMM
    with its layer's bias and attention over distinct q, k and v; False: the earlier, lighter floor (no
    bias; q = k = v, which keeps half the attention's operands in L2)."""
    dt, dim, ffn, heads = torch.bfloat16, cfg.dim, cfg.ffn_dim, cfg.num_heads
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    x, ctx, hidden = rand(tokens, dim), rand(cfg.text_len, dim), rand(tokens, ffn)  # context padded
    w_sq, w_up, w_down = rand(dim, dim), rand(ffn, dim), rand(dim, ffn)
    b_dim, b_ffn = (rand(dim), rand(ffn)) if exact else (None, None)
    # per block: self q/k/v/o, cross q/o, the camera injector's four layers (token length);
    # cross k/v (text_len rows); FFN up and down
    gemms = {
        "dim_x_dim_tokens": (lambda: F.linear(x, w_sq, b_dim), 10),
        "dim_x_dim_text": (lambda: F.linear(ctx, w_sq, b_dim), 2),
        "ffn_up": (lambda: F.linear(x, w_up, b_ffn), 1),
        "ffn_down": (lambda: F.linear(hidden, w_down, b_dim), 1),
    }
    d = dim // heads
    q = rand(1, heads, tokens, d)
    k, v = (rand(1, heads, tokens, d), rand(1, heads, tokens, d)) if exact else (q, q)
    kv_text = rand(1, heads, cfg.text_len, d)
    attn = {
        "self_attention": lambda: F.scaled_dot_product_attention(q, k, v),
        "cross_attention": lambda: F.scaled_dot_product_attention(q, kv_text, kv_text),
    }

    # the step's kernel sequence back to back, as the model runs it: a multi-second step holds the card at its
    # power limit (an H200 drops from 1980 to ~1700 MHz at 700 W), where the short bursts timed one kernel at
    # a time below partly run at the boost clock
    def sequence():
        for _ in range(cfg.num_layers * forwards):
            for fn, count in gemms.values():
                for _ in range(count):
                    fn()
            for fn in attn.values():
                fn()

    sustained = None
    if exact:
        sequence()  # reach the sustained state first
        sustained = min(timed(sequence, device, 2))
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
        "sustained_step_s": None if sustained is None else round(sustained, 6),
        "forwards": forwards,
        "exact": exact,
        "kernels": detail,
    }


def load_random_expert(scale: str, workdir: Path | None):
    """(device, config, the loaded expert, load seconds): a random NF4 expert written under `workdir`
    (reused when there; a temporary folder without one), full A14B size or tiny."""
    cuda = torch.cuda.is_available()
    if scale == "full" and not cuda:
        raise SystemExit("--scale full needs a CUDA GPU")
    device = torch.device("cuda" if cuda else "cpu")
    # tiny: every Linear input at least one NF4 block (64) wide, as bnb's CPU kernel needs
    cfg = A14B if scale == "full" else synthetic.tiny_config("cam", text_dim=64, text_len=64)
    with tempfile.TemporaryDirectory() as tmp:
        folder = (workdir or Path(tmp)) / f"{scale}_expert_nf4"
        if not (folder / "config.json").is_file():
            t0 = time.perf_counter()
            synthetic.write_nf4_expert(folder, cfg, seed=0, mode="random")
            print(f"wrote {folder} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        t0 = time.perf_counter()
        model = stream.load_expert(folder, device)
    return device, cfg, model, time.perf_counter() - t0


def summary_head(bench: str, scale: str, step: Step, load_s: float) -> dict:
    """The first fields of a step benchmark's JSON summary: what ran, where, at which size."""
    cuda = step.device.type == "cuda"
    return {
        "bench": bench,
        "scale": scale,
        "device": torch.cuda.get_device_name(step.device) if cuda else "cpu",
        "torch": torch.__version__,
        "size": list(SHAPES[scale][:3]),
        "tokens": step.tokens,
        "load_s": round(load_s, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per case (after one warm-up)")
    ap.add_argument("--skip", nargs="*", default=[], help="cases to leave out (eager is always run)")
    ap.add_argument("--cpu-compile", action="store_true", help="also compile on CPU (minutes to build)")
    ap.add_argument("--lora-rank", type=int, default=64, help="rank of the random LoRA of the lora case")
    ap.add_argument(
        "--profile", nargs="*", default=[], help="cases to profile once more: their top kernels by time"
    )
    args = ap.parse_args()

    device, cfg, model, load_s = load_random_expert(args.scale, args.workdir)
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
    summary = summary_head("speed", args.scale, step, load_s)
    reference = None
    for name, (options, guide, issue) in cases.items():
        if name != "eager" and name in args.skip:
            summary[name] = {"skipped": "--skip"}
        elif issue is not None:
            summary[name] = {"skipped": issue}
        else:
            summary[name] = run_case(step, options, guide, args.repeats, reference if guide == 5.0 else None)
            if name == "eager":
                reference = summary[name]["latent"]
            del summary[name]["latent"]
            if name in args.profile:
                summary[name]["kernels"] = kernel_profile(
                    functools.partial(step, options, guide, SpeedStats()), device
                )
            print(f"{name}: {summary[name]}", file=sys.stderr)
    if "lora" not in args.skip:
        summary["lora"] = lora_case(step, args.repeats, args.lora_rank, summary["eager"])
        del summary["lora"]["latent"]
        print(f"lora: {summary['lora']}", file=sys.stderr)
    if "cfg1" in summary and "step_s" in summary["cfg1"]:
        summary["cfg1_over_cfg"] = round(summary["cfg1"]["step_s"] / summary["eager"]["step_s"], 3)
    tokens = step.tokens
    del step, reference
    if "cache" not in args.skip:
        summary["cache"] = cache_cases(model, cfg, device, args.scale)
        print(f"cache: {summary['cache']}", file=sys.stderr)
    floor = kernel_floor(cfg, tokens, device, max(args.repeats, 3), forwards=2)
    summary["floor"] = floor
    light = kernel_floor(cfg, tokens, device, max(args.repeats, 3), forwards=2, exact=False)
    summary["floor_light"] = light
    summary["eager_over_floor"] = round(summary["eager"]["step_s"] / floor["step_s"], 2)
    best = min(
        (v["step_s"], k)
        for k, v in summary.items()
        if k in ("eager", "compile", "sage", "compile_sage") and "step_s" in v
    )
    summary["best_default_quality"] = {
        "case": best[1],
        "over_sustained_floor": round(best[0] / floor["sustained_step_s"], 3),
        "over_floor": round(best[0] / floor["step_s"], 3),
        "over_floor_light": round(best[0] / light["step_s"], 3),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
