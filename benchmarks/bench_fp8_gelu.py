"""Benchmark: the fp8 FFN's hidden activation, GELU_tanh + per-row amax + e4m3 codes (`wan.fp8_gelu`'s one Triton
kernel), against the same math unfused (`wan.fp8.quantize_rows(gelu(h))`) eager and as inductor compiles it (what
the compiled blocks ran before), at the FFN hidden's real shapes: [tokens, ffn_dim] bf16 of a v2 1.3B chunk
(6,032 x 8,960), a v2 14B chunk (6,032 x 13,824) and the base-cam step (31,668 x 13,824).

Per shape and way: the kernel time (CUDA events, the median of `--repeats` back-to-back calls); the byte floor
(one read of h, one write of the codes and scales, at the bandwidth a device-to-device copy of h reaches here);
and the kernel's warps per row swept. Equality with the unfused eager path on the GPU:
the share of codes equal, the largest distance in e4m3 steps, the scales' largest relative difference.
Random activations (randn x 2, bf16): numerics only.

    python benchmarks/bench_fp8_gelu.py --scale full                        # CUDA with Triton
    python benchmarks/bench_fp8_gelu.py --scale full --shapes 6032x8960     # one shape
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_gelu.py --scale tiny     # CPU check, Triton's interpreter

Prints one JSON line at the end.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from lingbot import load_pack  # noqa: E402

load_pack()
from bench_speed import timed  # noqa: E402
from lingbot_world.wan import fp8, fp8_gelu  # noqa: E402

SHAPES = {
    "full": {"v2-1.3b chunk": (6032, 8960), "v2-14b chunk": (6032, 13824), "base-cam step": (31668, 13824)},
    "tiny": {"three blocks": (24, 300), "two blocks": (16, 80)},
}
WARPS = (4, 8, 16, 32)  # swept around `wan.fp8_gelu.warps`' choice


def unfused(h):
    return fp8.quantize_rows(F.gelu(h, approximate="tanh"))


def kernel_ms(fn, repeats: int) -> float:
    """The median milliseconds of `fn`: CUDA events around each call on a GPU, host time (`bench_speed.timed`) in
    the tiny CPU check."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        return round(statistics.median(timed(fn, torch.device("cpu"), repeats)) * 1e3, 4)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def graph_us(fn) -> float:
    """`fn`'s microseconds as one call inside a CUDA graph (`triton.testing.do_bench_cudagraph`: replays of a recorded
    batch of calls, the L2 cache as the previous call left it), so no host launch time: the kernels' own time, as
    inside a chunk's recorded forwards. CUDA only."""
    import triton.testing

    return round(triton.testing.do_bench_cudagraph(fn) * 1e3, 2)


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two e4m3 tensors in representable steps (codes ordered by magnitude)."""
    a, b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    signed = [torch.where(t >> 7 == 1, -(t & 0x7F), t & 0x7F) for t in (a, b)]
    return int((signed[0] - signed[1]).abs().max())


def launched(h, warps: int):
    codes = torch.empty(h.shape, dtype=fp8.FP8, device=h.device)
    scale = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    return lambda: fp8_gelu.launch(h, codes, scale, warps)


def case(rows: int, cols: int, repeats: int, device: torch.device) -> dict:
    g = torch.Generator(device).manual_seed(0)
    h = (torch.randn(rows, cols, generator=g, device=device) * 2).bfloat16()
    copy = torch.empty_like(h)
    copy_ms = kernel_ms(lambda: copy.copy_(h), repeats)
    bandwidth = 2 * h.nbytes / (copy_ms / 1e3)
    # what the compiled blocks ran before the kernel (the tiny CPU check leaves it eager)
    compiled = torch.compile(unfused, dynamic=False) if device.type == "cuda" else unfused
    out = {
        "shape": [rows, cols],
        "compiled": device.type == "cuda",
        "eager_unfused_ms": kernel_ms(lambda: unfused(h), repeats),
        "compiled_unfused_ms": kernel_ms(lambda: compiled(h), repeats),
        "fused_ms": kernel_ms(lambda: fp8_gelu.gelu_quantize_rows(h), repeats),
        "fused_warps": fp8_gelu.warps(cols),
        "byte_floor_ms": round((h.nbytes + h.numel() + 4 * rows) / bandwidth * 1e3, 4),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
    }
    # four significant digits: a ratio far below 1 (the interpreter against eager) keeps its precision too
    out["fused_over_compiled"] = float(f"{out['fused_ms'] / out['compiled_unfused_ms']:.4g}")
    out["fused_over_floor"] = float(f"{out['fused_ms'] / out['byte_floor_ms']:.4g}")
    out["warps_ms"] = {w: kernel_ms(launched(h, w), repeats) for w in WARPS}
    codes, scale = fp8_gelu.gelu_quantize_rows(h)
    for name, (ref_codes, ref_scale) in (("eager", unfused(h)), ("compiled", compiled(h))):
        out[f"vs_{name}"] = {
            "codes_equal": round(
                float((codes.view(torch.uint8) == ref_codes.view(torch.uint8)).float().mean()), 6
            ),
            "max_steps": e4m3_steps(codes, ref_codes),
            "scale_max_rel": float(((scale - ref_scale).abs() / ref_scale).max()),
        }
    return out


def kernel_parser(doc: str) -> argparse.ArgumentParser:
    """The options every Triton kernel benchmark takes (--scale, --workdir, --repeats)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="unused (no files are written); for symmetry")
    ap.add_argument("--repeats", type=int, default=None, help="calls timed per way (default 50; tiny 3)")
    return ap


def kernel_setup(args, bench: str, usable) -> tuple[torch.device, int, dict] | None:
    """(device, repeats, the result's header) of a kernel benchmark at `args.scale`: CUDA at full scale, the CPU
    through Triton's interpreter at tiny; None after one message when `usable(tensor)` says it cannot run there."""
    device = torch.device("cuda" if args.scale == "full" else "cpu")
    if args.scale == "full" and not torch.cuda.is_available():
        print(f"{bench}: --scale full needs a CUDA GPU", file=sys.stderr)
        return None
    if not usable(torch.empty(1, 16, device=device)):
        need = "Triton" if device.type == "cuda" else "Triton and TRITON_INTERPRET=1 (its interpreter)"
        print(f"{bench}: the kernel needs {need} here", file=sys.stderr)
        return None
    repeats = args.repeats or (50 if args.scale == "full" else 3)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton's interpreter)"
    header = {
        "bench": bench.removeprefix("bench_"),
        "scale": args.scale,
        "device": name,
        "torch": torch.__version__,
    }
    return device, repeats, header


def main() -> int:
    ap = kernel_parser(__doc__)
    ap.add_argument("--shapes", nargs="*", default=None, help="ROWSxCOLS (default: the scale's shapes)")
    args = ap.parse_args()
    setup = kernel_setup(args, "bench_fp8_gelu", fp8_gelu.usable)
    if setup is None:
        return 2
    device, repeats, result = setup
    shapes = SHAPES[args.scale]
    if args.shapes:
        try:
            shapes = {s: tuple(int(n) for n in s.split("x")) for s in args.shapes}
        except ValueError:
            print(
                f"--shapes: expected ROWSxCOLS such as 6032x8960, got {' '.join(args.shapes)}",
                file=sys.stderr,
            )
            return 2
    for name, (rows, cols) in shapes.items():
        result[name] = case(rows, cols, repeats, device)
        print(f"{name}: {result[name]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
