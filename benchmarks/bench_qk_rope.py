"""Benchmark: self-attention's q (or k) RMSNorm + RoPE, `wan.qk_rope`'s one Triton kernel against the same math run
eagerly (`WanRMSNorm`, then `rope_apply` with the compiled runner's table) and as inductor compiles it (what the
compiled blocks ran before), at a chunk's real shapes: [tokens, width] bf16 of a v2 1.3B chunk (6,032 x 1,536, 12
heads) and a v2 14B chunk (6,032 x 5,120, 40 heads), head_dim 128.

Per shape: the kernel's and the compiled path's values against the eager path's (the share equal, the largest
absolute difference, the relative L2 distance), and each way's time per call (the median of `--repeats`,
`bench_fp8_gelu.kernel_ms`: CUDA events around one call, so at these sizes mostly the host's launch; the kernel's
time inside a chunk's CUDA graph is in `bench_fp8.py --profile`). Random inputs (randn x 3) and norm weights:
numerics only. Also the queries as FlashAttention-3's e4m3 codes from the same kernel (`codes`: `codes_case`).

    python benchmarks/bench_qk_rope.py --scale full                       # CUDA with Triton
    TRITON_INTERPRET=1 python benchmarks/bench_qk_rope.py --scale tiny    # CPU check, Triton's interpreter

Prints one JSON line at the end.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8_gelu import graph_us, kernel_ms  # noqa: E402  (it loads the pack)
from lingbot_world.wan import dit, fa3_attention, qk_rope  # noqa: E402

# name -> (latent frames, height, width in tokens), heads, head_dim
SHAPES = {
    "full": {"v2-1.3b chunk": ((4, 29, 52), 12, 128), "v2-14b chunk": ((4, 29, 52), 40, 128)},
    "tiny": {"two heads": ((2, 3, 5), 2, 24)},
}


def compared(a: torch.Tensor, ref: torch.Tensor) -> dict:
    a, ref = a.float(), ref.float()
    return {
        "equal": round(float((a == ref).float().mean()), 7),
        "max_abs": float((a - ref).abs().max()),
        "rel_l2": float((a - ref).norm() / ref.norm()),
    }


def case(grid, heads: int, d: int, device, repeats: int, compile_ok: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens, width = grid[0] * grid[1] * grid[2], heads * d
    norm = dit.WanRMSNorm(width, eps=1e-6).requires_grad_(False)
    norm.weight.data = 1 + 0.3 * torch.randn(width, generator=g)
    norm = norm.to(device)
    table = dit.rope_table(grid, dit.rope_freqs(d)).to(device)
    x = (torch.randn(tokens, width, generator=g) * 3).bfloat16().to(device)

    def eager():
        return dit.rope_apply(norm(x).view(tokens, heads, d), grid, table, torch.bfloat16).flatten(1)

    def fused():
        return qk_rope.norm_rope(norm, x, table, torch.bfloat16)

    out = {"tokens": tokens, "width": width, "usable": qk_rope.usable(x, table, d)}
    ref = eager()
    out["kernel_vs_eager"] = compared(fused(), ref)
    out["eager_ms"], out["kernel_ms"] = kernel_ms(eager, repeats), kernel_ms(fused, repeats)
    if compile_ok:
        compiled = torch.compile(
            lambda x: dit._rotate_pairs(norm(x).view(tokens, heads, d), table, torch.bfloat16)
        )
        out["compiled_vs_eager"] = compared(compiled(x).flatten(1), ref)
        out["compiled_ms"] = kernel_ms(lambda: compiled(x), repeats)
    out["codes"] = codes_case(norm, x, table, heads, ref.view(tokens, heads, d), compile_ok)
    return out


def codes_case(norm, x, table, heads: int, q: torch.Tensor, on_gpu: bool) -> dict:
    """The queries as FlashAttention-3's e4m3 codes in the kernel (`qk_rope.norm_rope_codes`, each head at its
    weight bound's scale) against the eager q quantized at those scales (torch's cast, to nearest: the share of codes
    equal), and q's distance from its codes decoded, against codes at each head's own amax (what `fa3_fp8` quantizes
    q to without the kernel). On a GPU, the kernel's time inside a CUDA graph (`bench_fp8_gelu.graph_us`, no host
    launch in it) against the bf16 kernel followed by the amax and the cast as a compiled block runs them."""
    codes, scale = qk_rope.norm_rope_codes(norm, x, table, heads)
    amax = fa3_attention.head_quantize(q)[1]

    def decoded_rel(scales):
        c = (q.float() / scales[0, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return float((c.float() * scales[0, :, None] - q.float()).norm() / q.float().norm())

    want = (q.float() / scale[0, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = {
        "equal": round(float((codes.view(q.shape).float() == want.float()).float().mean()), 7),
        "largest_code": float(codes.float().abs().max()),
        "bound_over_amax": [round(float(v), 2) for v in (scale / amax)[0]],
        "decoded_rel_l2": decoded_rel(scale),
        "amax_decoded_rel_l2": decoded_rel(amax),
    }
    if on_gpu:
        quantize = torch.compile(fa3_attention.head_quantize)
        tokens, d = q.shape[0], q.shape[2]

        def unfused():
            return quantize(qk_rope.norm_rope(norm, x, table, torch.bfloat16).view(tokens, heads, d))

        out["graph_us"] = {
            "bf16_kernel": graph_us(lambda: qk_rope.norm_rope(norm, x, table, torch.bfloat16)),
            "bf16_kernel_amax_cast_compiled": graph_us(unfused),
            "codes_kernel_with_scale": graph_us(lambda: qk_rope.norm_rope_codes(norm, x, table, heads)),
        }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--workdir", type=Path, default=None, help="unused (no files are written); for symmetry")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not qk_rope.triton_runs_on(torch.empty(0, device=device)):
        need = "Triton" if device.type == "cuda" else "Triton and TRITON_INTERPRET=1 (its interpreter)"
        raise SystemExit(f"bench_qk_rope needs {need} on {device.type}")
    summary = {"bench": "qk_rope", "scale": args.scale, "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        summary["card"] = torch.cuda.get_device_name(device)
    for name, (grid, heads, d) in SHAPES[args.scale].items():
        summary[name] = case(grid, heads, d, device, args.repeats, device.type == "cuda")
        print(f"{name}: {summary[name]}", file=sys.stderr)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
