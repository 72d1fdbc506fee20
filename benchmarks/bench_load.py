"""Load one DiT expert: the streaming loader against upstream's way and the IO floor.

    python benchmarks/bench_load.py --scale tiny              # CPU, seconds
    python benchmarks/bench_load.py --scale full              # A14B cam expert, ~9.6 GB NF4, CUDA
    python benchmarks/bench_load.py --scale full --format fp32  # the Fast layout, 69 GiB fp32 -> NF4

Writes a random checkpoint under --workdir (the NF4 repack's exact format, generated tensor by
tensor in packed form; reused when present), then runs each measurement in a fresh child process:
- io_floor: read the file's bytes into a reused pinned buffer and copy them to the GPU (CPU: into
  one host buffer); the least any loader can take;
- ours: `loaders.stream.load_expert` to the device;
- baseline: upstream's `load_prequant` way (dense fp32 model, Linear4bit shells, `load_file`,
  Params4bit per layer, `load_state_dict`, `.to(device)`), killed once its anonymous RSS passes
  --baseline-cap-gb or it runs past --baseline-timeout; reports the stage it reached.
Each child samples its anonymous RSS every 2 ms (RssAnon: what the OOM killer weighs; pages of the
mmap'd file are reclaimable page cache and show only in VmRSS/VmHWM). Prints one JSON line last.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 1e9
GiB = 1 << 30


def pack():
    from lingbot import load_pack

    load_pack()
    import lingbot_world

    return lingbot_world


# ----------------------------------------------------------------------------- children


def _device(name):
    import torch

    if name == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")  # context up before the RSS baseline is taken
        torch.cuda.reset_peak_memory_stats()
    return torch.device(name)


def _memory_report(sampler, device) -> dict:
    import torch
    from lingbot_world.loaders.monitor import proc_status

    status = proc_status()
    out = {
        "rss_anon_start_gb": sampler.start_bytes / GB,
        "rss_anon_peak_growth_gb": sampler.growth / GB,
        "vm_hwm_gb": status["VmHWM"] / GB,
        "rss_file_end_gb": status.get("RssFile", 0) / GB,
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["vram_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        out["vram_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
    return out


def child_io_floor(src, device, staging=256 << 20) -> dict:
    import torch
    from lingbot_world.loaders.monitor import RssSampler

    total = sum(f.stat().st_size for f in src.files)
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        dst = torch.empty(total, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        bufs = [torch.empty(staging, dtype=torch.uint8, pin_memory=pin) for _ in range(2 if pin else 1)]
        events, cur, off = [None, None], 0, 0
        for file in src.files:
            with open(file, "rb", buffering=0) as f:
                while True:
                    if events[cur] is not None:
                        events[cur].synchronize()
                    n = f.readinto(memoryview(bufs[cur].numpy()))
                    if not n:
                        break
                    dst[off : off + n].copy_(bufs[cur][:n], non_blocking=pin)
                    off += n
                    if pin:
                        events[cur] = torch.cuda.Event()
                        events[cur].record()
                        cur = 1 - cur
        if pin:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    assert off == total
    return {
        "seconds": seconds,
        "gbps": total / seconds / GB,
        "bytes": total,
        **_memory_report(sampler, device),
    }


def child_ours(src, device, staging) -> dict:
    import bitsandbytes as bnb
    import torch
    from lingbot_world.loaders import stream
    from lingbot_world.loaders.formats import detect_expert_format
    from lingbot_world.loaders.monitor import RssSampler

    with RssSampler() as sampler:
        t0 = time.perf_counter()
        src = detect_expert_format(src.path, require_config=False)  # its config.json, when there, is read
        t_detect = time.perf_counter() - t0
        # an original bf16 expert is quantized while streaming, as a 24 GB user would load it
        model = stream.load_expert(
            src, device, quantize=None if src.quantized else True, staging_bytes=staging
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    result = {
        "seconds": seconds,
        "detect_seconds": t_detect,
        "gbps": src.nbytes / seconds / GB,
        "linear4bit": n4,
        "params_on_device": all(p.device.type == device.type for p in model.parameters()),
        "check_max_abs_diff": _check_layer(model, src, device),
        **_memory_report(sampler, device),
    }
    stream.release(model)
    return result


def _check_layer(model, src, device) -> float | None:
    """One 4-bit layer's output against bnb's dequantization of the stored bytes."""
    import bitsandbytes.functional as bnb_f
    import torch
    import torch.nn.functional as F
    from lingbot_world.wan.dit import linear
    from safetensors import safe_open

    name = "blocks.0.self_attn.q"
    layer = src.quant_layers.get(name)
    if layer is None or src.pt_state is not None:
        return None
    with safe_open(src.files[0], "pt", device=str(device)) as f:
        stored = {t: f.get_tensor(src.tensors[t].key) for t in layer.parts.values()}
    comps = {t.split(".weight.", 1)[1]: v for t, v in stored.items() if t != f"{name}.weight"}
    qs = bnb_f.QuantState.from_dict(comps, device=device)
    weight = bnb_f.dequantize_4bit(stored[f"{name}.weight"], qs)
    x = torch.randn(4, weight.shape[1], device=device)
    module = model.get_submodule(name)
    want = F.linear(x.bfloat16(), weight.bfloat16(), module.bias.bfloat16())
    return (linear(module, x, torch.bfloat16) - want).abs().max().item()


def child_baseline(src, device, progress) -> dict:
    """Upstream load_prequant.py's order of operations, written out here."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.functional import QuantState
    from lingbot_world.loaders.monitor import RssSampler
    from lingbot_world.wan.dit import WanModel
    from safetensors.torch import load_file
    from torch import nn

    t0 = time.perf_counter()

    def stage(name):
        with open(progress, "a") as f:
            f.write(json.dumps({"stage": name, "t": time.perf_counter() - t0}) + "\n")

    with RssSampler() as sampler:
        stage("build_dense_fp32_model")
        model = WanModel.from_config(src.dit_config)  # fp32, nn.Linear's own init
        stage("linear4bit_shells")
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        for name, m in linears:
            parent, _, child = name.rpartition(".")
            shell = bnb.nn.Linear4bit(
                m.in_features,
                m.out_features,
                m.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
            )
            setattr(model.get_submodule(parent), child, shell)
        del linears, m, shell
        stage("load_file")
        state = load_file(src.files[0]) if src.pt_state is None else dict(src.pt_state)
        stage("params4bit")
        for module, layer in src.quant_layers.items():
            comps = {t.split(".weight.", 1)[1]: state.pop(t) for p, t in layer.parts.items() if p != "weight"}
            qs = QuantState.from_dict(comps, device=device)
            target = model.get_submodule(module)
            target.weight = bnb.nn.Params4bit(
                state.pop(layer.parts["weight"]).to(device),
                requires_grad=False,
                quant_state=qs,
                bnb_quantized=True,
            )
            target.quant_state = qs
        stage("load_state_dict")
        model.load_state_dict(state, strict=False)
        stage("to_device")
        model.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stage("done")
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "gbps": src.nbytes / seconds / GB, **_memory_report(sampler, device)}


def run_child(args) -> None:
    pack()
    from lingbot_world.loaders.formats import detect_expert_format

    src = detect_expert_format(args.ckpt, require_config=args.format != "fp32")
    device = _device(args.device)
    if args.child == "io_floor":
        out = child_io_floor(src, device)
    elif args.child == "ours":
        out = child_ours(src, device, args.staging_mb << 20 if args.staging_mb is not None else None)
    else:
        out = child_baseline(src, device, args.progress)
    Path(args.result).write_text(json.dumps(out))


# ----------------------------------------------------------------------------- parent


def spawn(args, mode, ckpt, workdir, cap_bytes=None, timeout=None, staging_mb=None) -> dict:
    """Run one measurement in a fresh process; kill it past cap_bytes of anonymous RSS or timeout."""
    from lingbot_world.loaders.monitor import proc_status

    result, progress = workdir / f"{mode}.json", workdir / f"{mode}.progress"
    for p in (result, progress):
        p.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--ckpt",
        str(ckpt),
        "--device",
        args.device,
        "--result",
        str(result),
        "--progress",
        str(progress),
        "--format",
        args.format,
    ]
    staging_mb = args.staging_mb if staging_mb is None else staging_mb
    if staging_mb is not None:
        cmd += ["--staging-mb", str(staging_mb)]
    t0, peak, killed = time.perf_counter(), 0, None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    while proc.poll() is None:
        try:
            peak = max(peak, proc_status(proc.pid).get("RssAnon", 0))
        except (FileNotFoundError, ProcessLookupError):
            pass
        if cap_bytes and peak > cap_bytes:
            killed = f"anonymous RSS passed the {cap_bytes / GiB:.1f} GiB cap"
        elif timeout and time.perf_counter() - t0 > timeout:
            killed = f"still running after {timeout:.0f} s"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.02)
    stderr = proc.stderr.read()
    out = json.loads(result.read_text()) if result.exists() else {}
    out["process_rss_anon_peak_gb"] = peak / GB  # seen from outside, every 20 ms, includes imports
    out["wall_with_startup_s"] = time.perf_counter() - t0
    if progress.exists():
        stages = [json.loads(x) for x in progress.read_text().splitlines()]
        out["stages"] = {s["stage"]: round(s["t"], 2) for s in stages}
        out["reached"] = stages[-1]["stage"]
    if killed:
        out["killed"] = killed
    elif proc.returncode:
        out["failed"] = f"exit code {proc.returncode}: {stderr.strip()[-1500:]}"
    return out


def make_config(args):
    lw = pack()
    from lingbot_world.loaders.synthetic import tiny_config

    cfg = tiny_config() if args.scale == "tiny" else lw.wan.config.A14B
    if args.layers:
        cfg = replace(cfg, num_layers=args.layers)
    return cfg


def write_checkpoint(args, cfg, workdir: Path) -> tuple[Path, dict]:
    import torch
    from lingbot_world.loaders import synthetic as S

    tag = f"{args.scale}_{args.format}_{cfg.num_layers}l"
    ckpt = workdir / tag
    stamp = ckpt / "bench_stamp.json"
    wanted = {"config": asdict(cfg), "format": args.format, "seed": args.seed}
    if (
        stamp.exists()
        and json.loads(stamp.read_text()) == json.loads(json.dumps(wanted))
        and not args.rewrite
    ):
        return ckpt, {"reused": True}
    from lingbot_world.loaders.monitor import RssSampler

    full = args.scale == "full"
    with RssSampler() as sampler:
        t0 = time.perf_counter()
        if args.format == "nf4":
            S.write_nf4_expert(ckpt, cfg, args.seed, mode="random" if args.scale == "full" else "quantize")
        elif args.format == "bf16":
            S.write_diffusers_expert(
                ckpt, cfg, args.seed, dtype=torch.bfloat16, shards=1 if args.scale == "tiny" else 4
            )
        else:  # LingBot-World-Fast as released: 16 fp32 shards + index, no config.json
            S.write_diffusers_expert(ckpt, cfg, args.seed, dtype=torch.float32, shards=16 if full else 3)
            if full:  # (a tiny config's head count cannot be inferred from its shapes: keep it there)
                (ckpt / "config.json").unlink()
        seconds = time.perf_counter() - t0
    stamp.write_text(json.dumps(wanted))
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    return ckpt, {
        "reused": False,
        "seconds": seconds,
        "gb": size / GB,
        "gbps": size / seconds / GB,
        "rss_anon_growth_gb": sampler.growth / GB,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    p.add_argument(
        "--layers", type=int, default=None, help="override num_layers (scale between tiny and full)"
    )
    p.add_argument(
        "--format",
        choices=["nf4", "bf16", "fp32"],
        default="nf4",
        help="nf4: the repack's model.safetensors; bf16: an upstream expert, quantized while loading; "
        "fp32: LingBot-World-Fast's layout (16 fp32 shards, no config.json), quantized while loading",
    )
    p.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "lingbot_bench_load"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--staging-mb", type=int, default=None, help="loader staging buffer (MiB); 0 = none")
    p.add_argument(
        "--baseline-cap-gb",
        type=float,
        default=None,
        help="anonymous RSS at which the baseline is killed (default: min(48, half of RAM) GiB)",
    )
    p.add_argument("--baseline-timeout", type=float, default=240.0)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--rewrite", action="store_true", help="write the checkpoint even if one is there")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=["io_floor", "ours", "baseline"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_child(args)
        return 0

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    args.workdir.mkdir(parents=True, exist_ok=True)
    cfg = make_config(args)
    ckpt, written = write_checkpoint(args, cfg, args.workdir)
    from lingbot_world.loaders.formats import detect_expert_format
    from lingbot_world.loaders.synthetic import model_specs

    src = detect_expert_format(ckpt, require_config=args.format != "fp32")
    summary = {
        "scale": args.scale,
        "format": args.format,
        "device": args.device,
        "params": sum(math.prod(s) for s in model_specs(cfg)[0].values()),
        "checkpoint": {
            "path": str(ckpt),
            "bytes": src.nbytes,
            "tensors": len(src.tensors),
            "linear4bit_stored": len(src.quant_layers),
            **written,
        },
    }
    runs = {"io_floor": [], "ours": []}
    if args.device == "cuda" and args.staging_mb is None:
        runs["ours_unstaged"] = []  # the same loader copying straight from the file's pages
    for _ in range(args.repeats):
        for key in runs:
            mode, staging = ("ours", 0) if key == "ours_unstaged" else (key, None)
            runs[key].append(spawn(args, mode, ckpt, args.workdir, staging_mb=staging))
    for mode, results in runs.items():
        if not results:
            continue
        ok = [r for r in results if "seconds" in r]
        best = min(ok, key=lambda r: r["seconds"]) if ok else results[-1]
        summary[mode] = {**best, "all_seconds": [round(r.get("seconds", float("nan")), 3) for r in results]}
    if not args.skip_baseline and args.format == "nf4":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cap = args.baseline_cap_gb * GiB if args.baseline_cap_gb else min(48 * GiB, ram // 2)
        summary["baseline"] = {
            "cap_gb": cap / GB,
            **spawn(args, "baseline", ckpt, args.workdir, cap, args.baseline_timeout),
        }
    ours, floor = summary.get("ours", {}), summary.get("io_floor", {})
    if "seconds" in ours and "seconds" in floor:
        summary["ours_vs_io_floor"] = ours["seconds"] / floor["seconds"]
        summary["targets"] = {
            "rss_growth_gb": ours["rss_anon_peak_growth_gb"],
            "rss_growth_le_1.5GB": ours["rss_anon_peak_growth_gb"] <= 1.5,
            "time_le_1.5x_io_floor": summary["ours_vs_io_floor"] <= 1.5,
        }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
