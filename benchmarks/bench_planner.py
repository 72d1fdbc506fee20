"""Benchmark: the run planner's predictions against measured peaks, on a grid of configurations.

One random NF4 expert (full A14B cam size with --scale full, written under --workdir and reused; a tiny
one with --scale tiny) is loaded with the streaming loader, a random VAE of the full (or tiny) structure
sits on the device beside it as in a real run, and for each case of the grid ONE denoising step
(bench_speed's Step through `wan.pipeline.denoise`: CFG, camera) runs with `swap_blocks` of its blocks
streamed from pinned RAM, measuring torch.cuda.max_memory_allocated and the reserved peak. The planner's
prediction for the same request (`session.planner.Planner`, the expert's stored bytes, text encoder on the
CPU, untiled VAE) is printed beside it with the relative error (predicted - measured) / measured.
A few VAE cases measure the untiled first-frame encode and the decode the same way (the expert, which a
real run does not hold then, subtracted).

The grid runs cheapest first and each finished case is written to --out at once, so a run cut short
keeps what it measured. The last case, 720p x 161 frames fully swapped, says whether that clip's denoise
fits a 24 GiB card.

--lean adds the lean-activation cases (`wan.dit.WanAttentionBlock.forward_lean`, planned with
`session.planner.lean_activation_vram`): 480p x 81 all resident, 720p x 81 and 720p x 161 fully swapped,
and says whether the last two fit 12 GiB and 24 GiB cards. With --cases, any case of either grid:

    python benchmarks/bench_planner.py --scale full --lean --skip-vae --cases 480p_81 480p_81_lean \
        720p_81_swap_all 720p_81_swap_all_lean 720p_161_swap_all 720p_161_swap_all_lean

    python benchmarks/bench_planner.py --scale full --workdir /tmp/bench_speed     # CUDA, ~5 min
    python benchmarks/bench_planner.py --scale tiny                                # CPU, seconds

On the CPU nothing is measured (no VRAM): the cases run and the predictions are printed. Prints one
JSON line at the end.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from lingbot import load_pack  # noqa: E402

load_pack()
from bench_speed import Step, load_random_expert  # noqa: E402
from lingbot_world.loaders import monitor  # noqa: E402
from lingbot_world.loaders.formats import detect_expert_format  # noqa: E402
from lingbot_world.session import planner as memplan  # noqa: E402
from lingbot_world.wan import i2v  # noqa: E402
from lingbot_world.wan import vae as V  # noqa: E402
from lingbot_world.wan.block_swap import BlockSwapper  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, SpeedStats  # noqa: E402

GIB = 1 << 30
CARD_24 = 24 * GIB
CARD_12 = 12 * GIB
# name -> (pixel size (h, w) per scale, frames per scale)
SIZES = {"480p": {"full": (480, 832), "tiny": (32, 48)}, "720p": {"full": (720, 1280), "tiny": (48, 64)}}
FRAMES = {81: {"full": 81, "tiny": 5}, 161: {"full": 161, "tiny": 9}}
VAE_CONFIG = {"full": V.WAN21_VAE_CONFIG, "tiny": dict(V.WAN21_VAE_CONFIG, dim=4)}
# (case, phase, size, frames, swapped share of the blocks, guide scale, lean activations), cheapest first
GRID = (
    ("480p_81_guide1", "denoise", "480p", 81, 0.0, 1.0, False),
    ("480p_81", "denoise", "480p", 81, 0.0, 5.0, False),
    ("480p_81_swap_half", "denoise", "480p", 81, 0.5, 5.0, False),
    ("encode_480p_81", "vae_encode", "480p", 81, 0.0, 5.0, False),
    ("480p_161", "denoise", "480p", 161, 0.0, 5.0, False),
    ("encode_720p_81", "vae_encode", "720p", 81, 0.0, 5.0, False),
    ("decode_480p_81", "vae_decode", "480p", 81, 0.0, 5.0, False),
    ("720p_81", "denoise", "720p", 81, 0.0, 5.0, False),
    ("720p_81_swap_all", "denoise", "720p", 81, 1.0, 5.0, False),
    ("720p_161_swap_all", "denoise", "720p", 161, 1.0, 5.0, False),
)
LEAN_GRID = (  # with --lean
    ("480p_81_lean", "denoise", "480p", 81, 0.0, 5.0, True),
    ("720p_81_swap_all_lean", "denoise", "720p", 81, 1.0, 5.0, True),
    ("720p_161_swap_all_lean", "denoise", "720p", 161, 1.0, 5.0, True),
)


def gib(x):
    return None if x is None else round(x / GIB, 3)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_for(cfg, hw, frames, nbytes: int, swap: int, lean: bool = False):
    """The planner's MemoryPlan for this case: the expert's stored bytes for both experts, text on the
    CPU (the benchmark encodes none), untiled VAE (as the cases run it), no budget (nothing 'auto')."""
    size = i2v.latent_size(*hw, hw[0] * hw[1])
    request = memplan.MemoryRequest(
        {"high": nbytes, "low": nbytes},
        swap_blocks=swap,
        vae_tile=None,
        t5_device="cpu",
        lean_activations=lean,
    )
    return memplan.Planner(cfg, size, frames, request, hw, hw[0] * hw[1]).plan(None)


def measure(device, fn) -> dict:
    """Run fn once: seconds, and on CUDA the allocated bytes at the start, the allocated and reserved peaks."""
    monitor.free_memory()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    res = {"seconds": round(time.perf_counter() - t0, 3)}
    if cuda:
        res.update(
            start=start,
            peak=torch.cuda.max_memory_allocated(device),
            reserved=torch.cuda.max_memory_reserved(device),
        )
    res["finite"] = bool(torch.isfinite(out).all())
    return res


def run_case(case, model, cfg, vae, device, scale, nbytes, expert_resident) -> dict:
    name, phase, size_name, frames_key, share, guide, lean = case
    h, w = SIZES[size_name][scale]
    frames = FRAMES[frames_key][scale]
    size = i2v.latent_size(h, w, h * w)
    lat_h, lat_w, ph, pw = size
    swap = round(share * cfg.num_layers)
    plan = plan_for(cfg, (h, w), frames, nbytes, swap, lean)
    out = {"case": name, "phase": phase, "size": [ph, pw], "frames": frames, "tokens": plan.tokens}
    out.update(swap_blocks=swap, guide=guide, lean_activations=lean)
    predicted = plan.phase("denoise_high" if phase == "denoise" else phase).vram
    swapper = None
    try:
        if phase == "denoise":
            step = Step(model, cfg, device, (ph, pw, frames, min(60, cfg.text_len), min(120, cfg.text_len)))
            swapper = BlockSwapper(model, swap) if swap else None
            options = SpeedOptions(lean_activations=lean)
            res = measure(device, lambda: step(options, guide, SpeedStats()))
            held = 0  # everything a real run holds then is here: the expert, the VAE, the inputs
            del step
        elif phase == "vae_encode":
            g = torch.Generator().manual_seed(0)
            image = torch.rand(3, ph, pw, generator=g).mul_(2).sub_(1)

            def encode():
                return vae.encode(i2v.vae_input(image, frames, ph, pw).to(device), tile=None)

            res = measure(device, encode)
            held = expert_resident  # a real run loads the expert after the encode
        else:
            lat_f = i2v.latent_frames(frames)
            latent = torch.randn(16, lat_f, lat_h, lat_w, generator=torch.Generator().manual_seed(0)).to(
                device
            )
            res = measure(device, lambda: vae.decode(latent, tile=None))
            held = expert_resident  # a real run has released the experts before the decode
            del latent
    except torch.OutOfMemoryError as err:
        out.update(
            oom=str(err).splitlines()[0][:200], predicted_gib=gib(predicted), predicted_bytes=predicted
        )
        return out
    finally:
        if swapper is not None:
            swapper.unpin()  # back to pageable RAM, then onto the device for the next case
            model.to(device)
        monitor.free_memory()
    out.update(
        seconds=res["seconds"], finite=res["finite"], predicted_gib=gib(predicted), predicted_bytes=predicted
    )
    if "peak" in res:
        measured = res["peak"] - held
        reserved = res["reserved"] - held
        out.update(
            start_gib=gib(res["start"] - held),
            measured_gib=gib(measured),
            reserved_gib=gib(reserved),
            rel_error=round((predicted - measured) / measured, 4),
            rel_error_vs_reserved=round((predicted - reserved) / reserved, 4),
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="where the random expert is written")
    ap.add_argument("--out", type=Path, default=None, help="partial results, rewritten after each case")
    ap.add_argument(
        "--cases", nargs="*", default=None, help=f"a subset of {[c[0] for c in GRID + LEAN_GRID]}"
    )
    ap.add_argument("--skip-vae", action="store_true", help="leave out the VAE encode/decode cases")
    ap.add_argument(
        "--lean", action="store_true", help=f"add the lean-activation cases {[c[0] for c in LEAN_GRID]}"
    )
    args = ap.parse_args()
    lean_names = {c[0] for c in LEAN_GRID}
    grid = GRID + (LEAN_GRID if args.lean or lean_names & set(args.cases or ()) else ())
    known = {c[0] for c in GRID} | lean_names
    unknown = sorted(set(args.cases or ()) - known)
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {sorted(known)}")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        out_path = args.out or workdir / "bench_planner.json"
        device, cfg, model, load_s = load_random_expert(args.scale, workdir)
        nbytes = detect_expert_format(workdir / f"{args.scale}_expert_nf4").nbytes  # what the CLI plans with
        monitor.free_memory()
        cuda = device.type == "cuda"
        expert_resident = torch.cuda.memory_allocated(device) if cuda else 0
        vae = V.init_random_(V.WanVAE(**VAE_CONFIG[args.scale]), seed=0).to(device).eval()
        summary = {
            "bench": "planner",
            "scale": args.scale,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "load_s": round(load_s, 2),
            "expert_bytes": nbytes,
            "expert_resident_gib": gib(expert_resident) if cuda else None,
            "cases": [],
        }
        for case in grid:
            if (args.cases is not None and case[0] not in args.cases) or (
                args.skip_vae and case[1] != "denoise"
            ):
                continue
            res = run_case(case, model, cfg, vae, device, args.scale, nbytes, expert_resident)
            summary["cases"].append(res)
            print(f"{case[0]}: {res}", file=sys.stderr, flush=True)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(summary, indent=1))
        errors = [c["rel_error"] for c in summary["cases"] if "rel_error" in c]
        summary["measured_cases"] = len(errors)
        summary["within_10pct"] = sum(abs(e) <= 0.10 for e in errors)
        summary["max_abs_rel_error"] = max((abs(e) for e in errors), default=None)
        last = next((c for c in summary["cases"] if c["case"] == "720p_161_swap_all"), None)
        if last is not None:
            summary["720p_161_swap_all_on_24gib"] = {
                "predicted_fits": last["predicted_gib"] is not None
                and last["predicted_gib"] * GIB <= CARD_24,
                "measured_fits": None
                if "measured_gib" not in last
                else last["measured_gib"] * GIB <= CARD_24,
                "reserved_fits": None
                if "reserved_gib" not in last
                else last["reserved_gib"] * GIB <= CARD_24,
                "oom": "oom" in last,
            }
        for case_name, card in (("720p_81_swap_all_lean", CARD_12), ("720p_161_swap_all_lean", CARD_24)):
            c = next((c for c in summary["cases"] if c["case"] == case_name), None)
            if c is not None:
                summary[f"{case_name}_on_{card // GIB}gib"] = {
                    "predicted_fits": c["predicted_gib"] is not None and c["predicted_bytes"] <= card,
                    "measured_fits": None if "measured_gib" not in c else c["measured_gib"] * GIB <= card,
                    "reserved_fits": None if "reserved_gib" not in c else c["reserved_gib"] * GIB <= card,
                    "oom": "oom" in c,
                }
        out_path.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
