"""Benchmark: fp8 linears' inputs made in one pass (`wan.fp8_inputs`): a block's residual update + LayerNorm +
modulation + e4m3 row codes (`norm_codes`, the block's three norms: `dit.block_input`) and the row quantization before
the o-projections (`quantize_rows`), against the same math unfused (`dit.block_input` with the kernels off, then
`wan.fp8.quantize_rows`) eager and as inductor compiles it (what the compiled blocks ran before), at a chunk's real
shapes: [tokens, dim] of a v2 1.3B chunk (6,032 x 1,536) and a v2 14B chunk (6,032 x 5,120).

Per shape and case: the kernel time (CUDA events, the median of `--repeats` back-to-back calls, the L2 cache not
flushed between them: at these sizes mostly the host's launch, an op's dispatch included), on a GPU also inside a CUDA
graph (`bench_fp8_gelu.graph_us`: the kernels alone, as in a chunk's recorded forwards), and its agreement with the unfused eager path on the GPU: the updated residual's largest
difference, the share of codes equal, the largest distance in e4m3 steps, the scales' largest relative difference.
Random inputs: numerics only.

    python benchmarks/bench_fp8_inputs.py --scale full                     # CUDA with Triton
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_inputs.py --scale tiny  # CPU check, Triton's interpreter

Prints one JSON line at the end.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# it loads the pack
from bench_fp8_gelu import e4m3_steps, graph_us, kernel_ms, kernel_parser, kernel_setup  # noqa: E402
from lingbot_world.wan import dit, fp8, fp8_inputs  # noqa: E402

SHAPES = {"full": {"v2-1.3b chunk": (6032, 1536), "v2-14b chunk": (6032, 5120)}, "tiny": {"tiny": (7, 300)}}
# the block's norms (`WanAttentionBlock.forward`): what updates x first, the camera's injection, the norm's kind
CASES = {
    "norm1": "the FFN update of the block before (gated), LayerNorm, modulation",
    "norm1_first": "block 0's bf16 input: LayerNorm (rounded to bf16), modulation",
    "norm3": "the attention's gated update, the camera's injection, affine LayerNorm",
    "norm2": "the cross-attention's update (a plain sum), LayerNorm, modulation",
}


def inputs(case: str, rows: int, cols: int, device) -> tuple:
    """(x, norm, update, camera, modulation) of one case, random."""
    g = torch.Generator(device).manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    bf16 = torch.bfloat16
    x = randn(rows, cols, scale=3)
    norm = dit.WanLayerNorm(cols).to(device)
    modulation = (randn(cols, scale=0.1), randn(cols, scale=0.1))
    if case == "norm1":
        return x, norm, (randn(rows, cols, dtype=bf16), randn(cols, scale=0.1)), None, modulation
    if case == "norm1_first":
        return x.to(bf16), norm, None, None, modulation
    if case == "norm3":
        affine = dit.WanLayerNorm(cols, elementwise_affine=True).to(device).requires_grad_(False)
        affine.weight.copy_(1 + randn(cols, scale=0.1))
        affine.bias.copy_(randn(cols, scale=0.1))
        camera = (randn(rows, cols, scale=0.1, dtype=bf16), randn(rows, cols, scale=0.1, dtype=bf16))
        return x, affine, (randn(rows, cols, dtype=bf16), randn(cols, scale=0.1)), camera, None
    return x, norm, (randn(rows, cols, dtype=bf16), None), None, modulation


def agreement(got: tuple, want: tuple) -> dict:
    """(x or None, codes, scales) against the unfused path's."""
    codes, scale = got[-2:]
    out = {} if got[0] is None else {"x_max_abs": float((got[0].float() - want[0].float()).abs().max())}
    return out | {
        "codes_equal": round(
            float((codes.view(torch.uint8) == want[-2].view(torch.uint8)).float().mean()), 6
        ),
        "max_steps": e4m3_steps(codes, want[-2]),
        "scale_max_rel": float(((scale - want[-1]).abs() / want[-1]).max()),
    }


def timed_case(fused, unfused, args, repeats: int, device) -> dict:
    """The kernel against the unfused path eager and compiled (eager again in the tiny CPU check)."""
    fp8_inputs.enabled = False
    want = unfused(*args)
    torch._dynamo.reset()  # each case compiles afresh: the cases would pass dynamo's recompile limit
    compiled = torch.compile(unfused, dynamic=False) if device.type == "cuda" else unfused
    out = {
        "eager_unfused_ms": kernel_ms(lambda: unfused(*args), repeats),
        "compiled_unfused_ms": kernel_ms(lambda: compiled(*args), repeats),
    }
    # inside a CUDA graph: no host launch time (the ops' dispatch weighs on kernel_ms)
    if device.type == "cuda":
        out["compiled_unfused_graph_us"] = graph_us(lambda: compiled(*args))
    fp8_inputs.enabled = True
    out["kernel_ms"] = kernel_ms(lambda: fused(*args), repeats)
    out["kernel_over_compiled"] = float(f"{out['kernel_ms'] / out['compiled_unfused_ms']:.4g}")
    if device.type == "cuda":
        out["kernel_graph_us"] = graph_us(lambda: fused(*args))
        out["graph_kernel_over_compiled"] = float(
            f"{out['kernel_graph_us'] / out['compiled_unfused_graph_us']:.4g}"
        )
    out["vs_eager"] = agreement(fused(*args), want)
    return out


def norm_unfused(x, norm, update, camera, modulation):
    x, h = dit.block_input(x, norm, (), update, None if camera is None else lambda: camera, modulation)
    return (x, *fp8.quantize_rows(h.float()))


def shape_case(rows: int, cols: int, repeats: int, device) -> dict:
    out = {"shape": [rows, cols], "compiled": device.type == "cuda"}
    for case in CASES:
        out[case] = timed_case(
            fp8_inputs.norm_codes, norm_unfused, inputs(case, rows, cols, device), repeats, device
        )

    def rows_fused(t):
        return (None, *fp8_inputs.quantize_rows(t))

    def rows_unfused(t):
        return (None, *fp8.quantize_rows(t))

    t = (
        torch.randn(rows, cols, generator=torch.Generator(device).manual_seed(1), device=device) * 3
    ).bfloat16()
    out["rows"] = timed_case(rows_fused, rows_unfused, (t,), repeats, device)
    return out


def main() -> int:
    args = kernel_parser(__doc__).parse_args()
    setup = kernel_setup(args, "bench_fp8_inputs", fp8_inputs.usable)
    if setup is None:
        return 2
    device, repeats, result = setup
    result["cases"] = CASES
    with torch.no_grad():
        for label, (rows, cols) in SHAPES[args.scale].items():
            result[label] = shape_case(rows, cols, repeats, device)
            print(f"{label}: {result[label]}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
