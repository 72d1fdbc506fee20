"""Benchmark: upstream LingBot-World's own NF4 CFG step against ours, in one process on one card.

The baseline for whole 480p x 81 runs (70 steps, CFG 5): upstream's `WanModel` (from the source tree
given by --upstream, holding upstream's `wan/` package) with every nn.Linear a bitsandbytes NF4
`Linear4bit`, as the community NF4 repack's loader sets it up, loading the same random NF4 expert
bench_speed.py writes (`synthetic.write_nf4_expert(..., mode="random")`, reused under --workdir).
One CFG step as upstream's `WanI2V.generate` runs it at 464x832x81 (31,668 tokens): a cond and an
uncond forward under torch.no_grad and bf16 autocast on CUDA (upstream's param_dtype), camera
passed as `dit_cond_dict={"c2ws_plucker_emb": (cam,)}` in bf16, the guidance combine; the inputs
are bench_speed's `Step` tensors (noise, y, context 60 tokens, context_null 120 tokens, cam).
In the same process, first: our step (bench_speed's `Step` + `run_case`, eager, CFG 5) on the same
card; our expert is freed before upstream's is built. As a check that upstream's model holds the
stored weights, the JSON gives the relative L2 difference between upstream's CFG prediction and ours
(one extra CFG step of ours) for the same weights, inputs and timestep 999.

Upstream's model build: the repack's loader builds a dense fp32 model first (~74 GB of host RAM
for one A14B expert, minutes of random init; OOM-killed on a 128 GiB machine, see bench_load.py).
Here the same module tree is built on the meta device instead: every nn.Linear becomes a
`Linear4bit` shell (compute bf16, nf4, compress_statistics) on meta, each stored 4-bit weight becomes
`Params4bit(packed, quant_state=QuantState.from_dict(...), bnb_quantized=True)` as the repack's
loader does, and the other tensors (biases, norms, modulation, the Conv3d patch embedding; stored
bf16) are cast to fp32, as the repack's dense fp32 model holds them after `load_state_dict`, and
assigned. Nothing is initialised randomly; the RoPE table (a plain attribute upstream computes in
its constructor) comes from upstream's own constructor at the same head size.

Attention: upstream calls flash_attention; without a flash_attn package (and on the CPU) it is
replaced by the golden script's SDPA stand-in, as bench_fast.py does (the JSON says which ran).

    python benchmarks/bench_upstream_step.py --scale full --workdir /tmp/bench_speed \\
        --upstream DIR [--vram-cap-gib 24]                                         # CUDA
    python benchmarks/bench_upstream_step.py --scale tiny --upstream DIR           # CPU, seconds

--vram-cap-gib N limits this process to N GiB of the card; a step that does not fit is reported as
out of memory. Prints one JSON line at the end: both steps, their peak VRAM and step x 70.
"""

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_fast import load_upstream_module  # noqa: E402
from bench_speed import (  # noqa: E402
    SHAPES,
    Step,
    load_random_expert,
    rel_error,
    run_case,
    set_vram_cap,
    summary_head,
    sync,
    timed,
)
from lingbot_world.loaders.formats import detect_expert_format  # noqa: E402
from lingbot_world.wan.schedulers import cfg as cfg_combine  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions  # noqa: E402

GIB = 1 << 30
GUIDE = 5.0
RUN_STEPS = 70  # upstream's default sample_steps for i2v A14B


def vram(device) -> dict:
    if device.type != "cuda":
        return {}
    return {
        "peak_vram_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
        "peak_vram_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 2),
    }


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def oom(err: Exception) -> dict:
    return {"out_of_memory": str(err).split("\n")[0][:200]}


def upstream_kwargs(cfg) -> dict:
    """upstream WanModel's constructor arguments for our config."""
    return dict(
        model_type="i2v",
        control_type=cfg.control_type,
        patch_size=tuple(cfg.patch_size),
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
    )


def build_upstream_nf4(up, cfg, folder: Path, device) -> tuple[torch.nn.Module, dict]:
    """Upstream's WanModel with Linear4bit NF4 layers holding the stored expert (see the module doc)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState
    from safetensors.torch import load_file

    stages, t0 = {}, time.perf_counter()

    def stage(name):
        stages[name] = round(time.perf_counter() - t0, 2)

    src = detect_expert_format(folder)
    if src.pt_state is not None or len(src.files) != 1:
        raise SystemExit(f"{folder}: expected the NF4 repack's single model.safetensors")
    with torch.device("meta"):
        model = up.WanModel(**upstream_kwargs(cfg)).eval()
        for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]:
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
    head_dim = cfg.dim // cfg.num_heads
    rope_donor = up.WanModel(
        **{
            **upstream_kwargs(cfg),
            "dim": head_dim,
            "num_heads": 1,
            "num_layers": 0,
            "ffn_dim": head_dim,
            "text_dim": head_dim,
            "freq_dim": 2,
            "in_dim": 1,
            "out_dim": 1,
        }
    )
    model.freqs = rope_donor.freqs  # upstream's table for this head size, on the CPU as upstream builds it
    del rope_donor
    stage("meta_build")
    state = load_file(src.files[0], device=str(device))
    stage("load_file")
    quantized = 0
    for module, layer in src.quant_layers.items():
        comps = {t.split(".weight.", 1)[1]: state.pop(t) for p, t in layer.parts.items() if p != "weight"}
        qs = QuantState.from_dict(comps, device=device)
        target = model.get_submodule(module)
        if not isinstance(target, bnb.nn.Linear4bit):
            raise SystemExit(
                f"{folder}: 4-bit tensors for {module}, which is no Linear in upstream's WanModel"
            )
        target.weight = bnb.nn.Params4bit(
            state.pop(layer.parts["weight"]), requires_grad=False, quant_state=qs, bnb_quantized=True
        )
        target.quant_state = qs
        quantized += 1
    stage("params4bit")
    rest = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    del state
    result = model.load_state_dict(rest, strict=False, assign=True)
    if result.unexpected_keys:
        raise SystemExit(
            f"{folder}: tensors upstream's WanModel has no place for: {result.unexpected_keys[:5]}"
        )
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise SystemExit(f"{folder}: upstream's WanModel tensors the expert did not fill: {left[:5]}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stage("assign_rest")
    n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    return model, {"stages_s": stages, "linear4bit": n4, "from_stored_4bit": quantized}


@torch.no_grad()
def run_upstream(folder: Path, expert: Path, cfg, device, inputs: dict, repeats: int, ours_pred=None) -> dict:
    """Upstream's CFG step: timings, peak VRAM, and how far its CFG prediction is from ours (same
    weights, inputs and timestep; relative L2)."""
    up = load_upstream_module(folder, device, "model")
    stand_in = up.flash_attention.__module__ == "make_golden"
    out = {
        "attention": "SDPA stand-in (no flash_attn importable)" if stand_in else "flash_attn",
        "autocast": "cuda bfloat16"
        if device.type == "cuda"
        else "none (CPU: upstream's CUDA autocast is off)",
    }
    if device.type == "cpu":
        out["attention"] = "SDPA stand-in (fp32, CPU)"
    t0 = time.perf_counter()
    model, built = build_upstream_nf4(up, cfg, expert, device)
    out.update(build_s=round(time.perf_counter() - t0, 2), build=built)
    out["build"]["how"] = (
        "meta device; Linear4bit shells; Params4bit from stored NF4; other tensors fp32, assigned"
    )
    reset_peak(device)
    if device.type == "cuda":
        out["weights_vram_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cam = (inputs["cam"].to(param_dtype),)  # upstream: c2ws_plucker_emb.to(param_dtype).chunk(1, dim=0)
    common = {"seq_len": inputs["tokens"], "y": [inputs["y"]], "dit_cond_dict": {"c2ws_plucker_emb": cam}}
    arg_c = {"context": [inputs["context"].to(param_dtype)], **common}
    arg_null = {"context": [inputs["context_null"].to(param_dtype)], **common}
    timestep = torch.tensor([999.0], device=device)
    autocast = (
        torch.amp.autocast("cuda", dtype=param_dtype) if device.type == "cuda" else contextlib.nullcontext()
    )
    forwards = [0]

    def step():
        with autocast:
            cond = model([inputs["noise"]], t=timestep, **arg_c)[0]
            uncond = model([inputs["noise"]], t=timestep, **arg_null)[0]
            forwards[0] += 2
            return uncond + GUIDE * (cond - uncond)

    pred = {}
    try:
        first = timed(lambda: pred.update(v=step()), device, 1)[0]
        forwards[0] = 0
        times = timed(step, device, repeats)
    except torch.OutOfMemoryError as err:
        out.update(oom(err), **vram(device))
        return out
    out.update(
        step_s=round(min(times), 4),
        steps_s=[round(t, 4) for t in times],
        first_step_s=round(first, 4),
        forwards=forwards[0] // repeats,
        **vram(device),
    )
    if ours_pred is not None:
        out["cfg_pred_rel_diff_vs_ours"] = rel_error(pred["v"], ours_pred)
    return out


def run_ours(step: Step, device, repeats: int) -> tuple[dict, torch.Tensor | None]:
    """(our step's timings, our CFG prediction at t = 999 for the same inputs, or None after an OOM)."""
    try:
        out = run_case(step, SpeedOptions(), GUIDE, repeats)
        del out["latent"]
        out.pop("peak_vram_gib", None)
        out.update(vram(device))
        t = torch.tensor([999.0], device=device)
        with torch.no_grad():
            cond, uncond = (
                step.model(step.noise, t, ctx, step.tokens, y=step.y, cam=step.cam)
                for ctx in (step.context, step.context_null)
            )
            return out, cfg_combine(cond, uncond, GUIDE)
    except torch.OutOfMemoryError as err:
        return {**oom(err), **vram(device)}, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--upstream", type=Path, default=None, help="upstream source tree (holds wan/)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps each (after one warm-up)")
    ap.add_argument("--vram-cap-gib", type=float, default=None, help="limit this process to N GiB of the GPU")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.upstream is not None and not (args.upstream / "wan" / "modules" / "model.py").is_file():
        raise SystemExit(
            f"--upstream {args.upstream}: expected upstream's source tree with wan/modules/model.py"
        )
    warnings.filterwarnings("ignore", message=".*autocast.*")  # upstream's CUDA autocast blocks on CPU

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        device, cfg, model, load_s = load_random_expert(args.scale, workdir)
        expert = workdir / f"{args.scale}_expert_nf4"  # where load_random_expert wrote it
        cap = set_vram_cap(device, args.vram_cap_gib)
        step = Step(model, cfg, device, SHAPES[args.scale])
        summary = summary_head("upstream_step", args.scale, step, load_s)
        summary.update(vram_cap_gib=cap, guide_scale=GUIDE, run_steps=RUN_STEPS)
        reset_peak(device)
        summary["ours"], ours_pred = run_ours(step, device, args.repeats)
        print(f"ours: {summary['ours']}", file=sys.stderr)
        inputs = {k: getattr(step, k) for k in ("noise", "y", "context", "context_null", "cam", "tokens")}
        del step, model
        reset_peak(device)
        if args.upstream is None:
            summary["upstream"] = {"skipped": "no --upstream"}
        else:
            summary["upstream"] = run_upstream(
                args.upstream.resolve(), expert, cfg, device, inputs, args.repeats, ours_pred
            )
            print(f"upstream: {summary['upstream']}", file=sys.stderr)
    for side in ("ours", "upstream"):
        if "step_s" in summary[side]:
            summary[side][f"est_{RUN_STEPS}_steps_s"] = round(summary[side]["step_s"] * RUN_STEPS, 1)
    if "step_s" in summary["ours"] and "step_s" in summary["upstream"]:
        summary["ours_over_upstream"] = round(summary["ours"]["step_s"] / summary["upstream"]["step_s"], 3)
    sync(device)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
