"""Benchmark: LingBot-World 2.0 chunks, upstream's own v2 code against ours, same weights, one card, one process.

The same-session baseline for the v2 chunk-speed targets. Upstream: LingBot-World 2.0's `WanI2VCausal`
chunk loop (`generate` -> `_generate_causal_fast`) with its `WanModelFast` (forward, self- and
cross-attention K/V caches) and its Wan2.1 VAE decode, imported from the source tree given by
--upstream-v2 (a folder holding v2's `wan/` package:
`git --git-dir=<mirror of robbyant/lingbot-world-v2> archive 2648877 -- generate.py wan | tar -x -C DIR`)
through the golden script's loader (its package __init__ files bypassed, missing imports stood in).
Ours: `wan.fast.FastSession` through the pack's chunk loop `session.fast_run.run_chunks`, each chunk
decoded as it is made by `WanVAE.chunk_decoder()` (as `lingbot.py fast` runs it).

Both run the --model kind's schedule (v2-1.3b: shift 5; v2-14b: shift 10; steps 0/250/500/750), window 18 /
sink 6 and chunks of 4 latent frames (13 video frames, then 16) at 464x832, on ONE set of random weights
built on the device: upstream's `WanModelFast` at the kind's full size (v2-1.3b: dim 1536, ffn 8960, 12
heads, 30 layers; v2-14b: the A14B config; camera only), filled by `wan.dit.init_random_` (upstream's
own init zeroes the head, which would make every flow zero), dense bf16 on CUDA (fp32 on the CPU), and
our `WanModel` holding the very same tensors (no copy). The random Wan2.1 VAE is shared the same way,
fp32 on both sides (upstream's VAE dtype). The text context and the image latent (upstream's VAE
encode is stood in: it is before the loop) are random; the camera is examples/00's poses through
upstream's own code. Ours is fed upstream's i2v condition and camera as upstream's forward received
them, and draws the same noise in the same order from the same seed (FastSession's RNG order is
upstream's), so the JSON's `max_rel_dev_chunk_latents` (relative L2 difference of each chunk's clean
latent, the largest over the chunks) shows that the same work was timed.

Timing (torch.cuda.synchronize around every timed region): per chunk, the DiT (4 steps + the commit pass;
upstream's split into steps and commit is given too) and the decode. Upstream decodes the whole clip once
after the last chunk (its code); its per-chunk decode is that time / chunks. Steady state = the mean over
the chunks past the rollout's start (`steady_from_chunk`: the window's fill and its first roll,
`FastConfig.roll_chunks`, as bench_play.py's steady figures; with no chunk past it, the chunks after the
first); FPS = 16 frames / (DiT + decode) per chunk. The chunks after the first (13 frames), growing ones
included, give the `after_first_*` figures: BENCHMARKS.md's sections before "Upstream's steady state past
its window's fill" called those steady (the growing chunks, with fewer keys, can run faster). One untimed
decode of 2 latent frames warms the VAE's kernels before upstream's run, whose decode is not spread over
chunks that could absorb a first call. Peak VRAM per side (both hold the shared weights and VAE). Attention:
upstream's flash_attn when it imports; otherwise its `flash_attention` (cross-attention) is replaced by the
golden script's SDPA stand-in and its `attention()` (self-attention) takes its own SDPA fallback; on the CPU
both are the golden script's fp32 stand-ins. The JSON says which ran. Ours: the active `wan.attention`
backend (SDPA).

    python benchmarks/bench_upstream_v2.py --scale full --model v2-1.3b --upstream-v2 DIR   # CUDA
    python benchmarks/bench_upstream_v2.py --scale tiny --upstream-v2 DIR                   # CPU, seconds

Prints one JSON line at the end.
"""

import argparse
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests" / "golden"))
import make_golden as golden  # noqa: E402
from bench_fast import peak, peak_reset  # noqa: E402
from bench_speed import rel_error, sync  # noqa: E402
from lingbot_world.loaders.formats import meta_model  # noqa: E402
from lingbot_world.loaders.synthetic import tiny_config  # noqa: E402
from lingbot_world.session import fast_run  # noqa: E402
from lingbot_world.wan import attention  # noqa: E402
from lingbot_world.wan import vae as V  # noqa: E402
from lingbot_world.wan.config import CHUNKED_KINDS  # noqa: E402
from lingbot_world.wan.dit import init_random_  # noqa: E402
from lingbot_world.wan.fast import FastConfig, FastSession  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "00"  # 961 poses: up to 60 chunks
SIZES = {"full": (464, 832), "tiny": (32, 48)}
CHUNKS = {"full": 12, "tiny": 5}  # full: 7 past the 1.3B's and the 14B's rollout start (5 chunks)
VAE_DIM = {"full": V.WAN21_VAE_CONFIG["dim"], "tiny": 4}
TEXT_TOKENS = 60
FRAMES_PER_CHUNK = 16  # new video frames per chunk after the first (13)
V2_FILES = ("wan/image2video.py", "wan/modules/model_fast.py", "wan/modules/vae2_1.py")
GIB = 1 << 30


def load_upstream_v2(folder: Path, device) -> tuple:
    """(upstream's modules, which attention ran). The golden script's loader stands in its missing
    imports and its attention module (fp32 SDPA); on CUDA its real attention module is put back: flash_attn
    where it imports, else its own `attention()` (SDPA fallback) and the SDPA stand-in for flash_attention."""
    up = golden.load_upstream(folder, {**golden.V2_MODULES, "vae": "wan.modules.vae2_1"})
    if device.type != "cuda":
        return up, "SDPA stand-in (the golden script's fp32 flash_attention and attention; CPU)"
    spec = importlib.util.spec_from_file_location(
        "upstream_v2_attention", folder / "wan/modules/attention.py"
    )
    real = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(real)  # a flash_attn build that fails to load raises ImportError
    except ImportError as err:
        return (
            up,
            f"SDPA stand-in for flash_attention and attention(): upstream's attention module fails: {err}",
        )
    up.model_fast.attention = real.attention
    if real.FLASH_ATTN_3_AVAILABLE or real.FLASH_ATTN_2_AVAILABLE:
        up.model_fast.flash_attention = real.flash_attention
        return up, f"flash_attn {3 if real.FLASH_ATTN_3_AVAILABLE else 2} (upstream's own attention module)"
    return up, (
        "SDPA: flash_attn does not import here; self-attention through upstream's attention() SDPA fallback, "
        "cross-attention's flash_attention replaced by the golden script's SDPA stand-in"
    )


def build_models(up, cfg, kind, device, dtype):
    """(upstream WanModelFast, our WanModel) holding the same random tensors."""
    args = {k: v for k, v in vars(cfg).items() if k not in ("window_size", "control_type")}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = up.model_fast.WanModelFast(
                **args, local_attn_size=kind.local_attn_size, sink_size=kind.sink_size
            )
    finally:
        torch.set_default_dtype(previous)
    init_random_(model.eval().requires_grad_(False), seed=0)
    ours = meta_model(cfg)
    ours.load_state_dict(model.state_dict(), strict=True, assign=True)
    ours.compute_dtype = dtype
    return model, ours.eval().requires_grad_(False)


def build_vaes(up, scale: str, device):
    """(upstream Wan2_1_VAE, our WanVAE) sharing one random Wan2.1 VAE's tensors, fp32 (upstream's dtype)."""
    config = {**V.WAN21_VAE_CONFIG, "dim": VAE_DIM[scale]}
    ours = V.init_random_(V.WanVAE(**config), seed=1).to(device).eval().requires_grad_(False)
    with torch.device("meta"):
        net = up.vae.WanVAE_(
            **{k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}, dropout=0.0
        )
    net.load_state_dict(ours.state_dict(), strict=True, assign=True)
    vae = object.__new__(up.vae.Wan2_1_VAE)  # its __init__ loads a file: the same attributes, set here
    mean = torch.tensor(V.LATENT_MEAN, dtype=torch.float32, device=device)
    std = torch.tensor(V.LATENT_STD, dtype=torch.float32, device=device)
    vae.__dict__.update(dtype=torch.float32, device=device, mean=mean, std=std, scale=[mean, 1.0 / std])
    vae.model = net.eval().requires_grad_(False)
    return vae, ours


def timed_call(fn, device, out: list):
    def run(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        sync(device)
        out.append(time.perf_counter() - t0)
        return result

    return run


@torch.no_grad()
def run_upstream(
    up, model, vae, ctx, image_latent, kind, size, chunks, dtype, device, seed, steady_from
) -> tuple[dict, dict]:
    """Upstream's WanI2VCausal.generate on examples/00, its forwards timed per chunk and its inputs kept."""
    per_chunk = len(kind.timestep_index) + 1  # the steps and the commit pass
    forward, calls, marks = model.forward, [], []

    def recording_forward(x, t, context, seq_len, y=None, dit_cond_dict=None, **kw):
        i = len(calls) % per_chunk
        if i == 0:
            marks.append([])
        if i in (0, per_chunk - 1):  # the chunk's start; the end of its steps = the commit's start
            sync(device)
            marks[-1].append(time.perf_counter())
        out = forward(x, t, context, seq_len, y=y, dit_cond_dict=dit_cond_dict, **kw)
        if i == per_chunk - 1:
            sync(device)
            marks[-1].append(time.perf_counter())
        calls.append({"y": y[0], "cam": dit_cond_dict["c2ws_plucker_emb"][0], "x": x[0]})
        return out

    model.forward = recording_forward
    decode_s = []
    vae.decode = timed_call(vae.decode, device, decode_s)
    vae.encode = lambda videos: [image_latent[:, : (videos[0].shape[1] - 1) // 4 + 1]]  # before the loop
    pipe = object.__new__(up.i2v.WanI2VCausal)  # its __init__ loads files: the attributes the loop reads
    pipe.__dict__.update(
        infer_mode="causal_fast",
        device=device,
        rank=0,
        t5_cpu=True,
        num_train_timesteps=1000,
        param_dtype=dtype,
        pipe_dtype=dtype,
        local_attn_size=kind.local_attn_size,
        sink_size=kind.sink_size,
        vae_stride=(4, 8, 8),
        patch_size=(1, 2, 2),
        sp_size=1,
        model=model,
        vae=vae,
        _t5_cache={},
        _cross_attn_initialized=False,
        text_encoder=lambda texts, device: [ctx],
        scheduler=up.unipc.FlowUniPCMultistepScheduler(
            num_train_timesteps=1000, shift=1, use_dynamic_shifting=False
        ),
    )
    h, w = size
    peak_reset(device)
    try:
        video = pipe.generate(
            "-",
            np.zeros((h, w, 3), dtype=np.uint8),
            action_path=str(EXAMPLE),
            chunk_size=kind.chunk_frames,
            max_area=h * w,
            frame_num=(chunks * kind.chunk_frames - 1) * 4 + 1,
            timesteps_index=list(kind.timestep_index),
            shift=kind.shift,
            seed=seed,
            offload_model=False,
            max_sequence_length=model.config.text_len,
        )
    finally:
        model.forward = forward
    vram = peak(device)
    if len(calls) != per_chunk * chunks or list(video.shape[2:]) != [h, w]:
        raise RuntimeError(
            f"upstream ran {len(calls)} forwards, video {list(video.shape)}: not the run asked for"
        )
    firsts, commits = calls[::per_chunk], calls[per_chunk - 1 :: per_chunk]
    inputs = {
        "y": torch.cat([c["y"] for c in firsts], dim=1),
        "cam": torch.cat([c["cam"] for c in firsts], dim=2),
        "latents": [c["x"] for c in commits],
    }
    dit = [m[2] - m[0] for m in marks]
    result = side(dit, [decode_s[0] / chunks] * chunks, vram, steady_from)
    result.update(
        steps_s=[round(m[1] - m[0], 4) for m in marks],
        commit_s=[round(m[2] - m[1], 4) for m in marks],
        decode_clip_s=round(decode_s[0], 4),
        video_frames=video.shape[1],
        decode="the whole clip once after the last chunk (upstream's code); per chunk = that time / chunks",
    )
    return result, inputs


@torch.no_grad()
def run_ours(model, vae, ctx, inputs, kind, lat, device, seed, steady_from) -> tuple[dict, list]:
    """Our chunk loop (FastSession + run_chunks, each chunk decoded as it comes) on upstream's inputs."""
    config = fast_run.fast_config(None, seed, None, None, "bf16", kind)
    latents, timings = [], []

    def on_chunk(latent, video, timing):
        latents.append(latent)
        timings.append(timing)

    peak_reset(device)
    session = FastSession(model, ctx, inputs["y"], lat, config, device)
    try:
        with vae.chunk_decoder() as decoder:
            sync(device)
            cameras = fast_run.whole_path_cameras(inputs["cam"], kind.chunk_frames)
            fast_run.run_chunks(session, cameras, decoder, on_chunk)
    finally:
        session.close()
    result = side([t.denoise_s for t in timings], [t.decode_s for t in timings], peak(device), steady_from)
    result.update(
        video_frames=sum(t.frames for t in timings), decode="each chunk as it is made (WanVAE.chunk_decoder)"
    )
    return result, latents


def side(dit: list, decode: list, vram, steady_from: int) -> dict:
    """One side's figures: per chunk, steady from chunk `steady_from`, and after the first chunk."""

    def mean(values, start):
        return sum(values[start:]) / len(values[start:])

    steady_dit, steady_decode = mean(dit, steady_from), mean(decode, steady_from)
    chunk = steady_dit + steady_decode
    after_first = mean(dit, 1) + mean(decode, 1)
    return {
        "dit_s": [round(v, 4) for v in dit],
        "decode_s": [round(v, 4) for v in decode],
        "steady_dit_s": round(steady_dit, 4),
        "steady_decode_s": round(steady_decode, 4),
        "steady_chunk_s": round(chunk, 4),
        "fps": round(FRAMES_PER_CHUNK / chunk, 3),
        "after_first_chunk_s": round(after_first, 4),
        "after_first_fps": round(FRAMES_PER_CHUNK / after_first, 3),
        "peak_vram_gib": None if vram is None else round(vram / GIB, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--model", choices=["v2-1.3b", "v2-14b"], default="v2-1.3b")
    ap.add_argument(
        "--upstream-v2", type=Path, required=True, help="folder holding upstream v2's wan/ package"
    )
    ap.add_argument("--chunks", type=int, default=None, help="chunks per clip (full: 12, tiny: 5; 2 to 60)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--workdir", type=Path, default=None, help="unused: nothing is written (common bench flag)"
    )
    args = ap.parse_args()
    folder = args.upstream_v2.resolve()
    missing = [f for f in V2_FILES if not (folder / f).is_file()]
    if missing:
        ap.error(
            f"--upstream-v2 {args.upstream_v2}: expected upstream LingBot-World 2.0's source tree (git archive "
            f"2648877 -- generate.py wan), missing {', '.join(missing)}"
        )
    chunks = args.chunks or CHUNKS[args.scale]
    if not 2 <= chunks <= 60:  # one chunk after the first at least; examples/00's 961 poses
        ap.error(f"--chunks: expected 2 to 60, got {chunks}")
    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        ap.error("--scale full needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # upstream has no CPU autocast
    warnings.filterwarnings("ignore", message=".*autocast.*")  # upstream's CUDA autocast on the CPU
    torch.set_grad_enabled(False)

    kind = CHUNKED_KINDS[args.model]
    start = FastConfig.for_kind(kind).roll_chunks
    steady_from = start if chunks > start else 1
    cfg = kind.dit if args.scale == "full" else tiny_config("cam")
    h, w = SIZES[args.scale]
    lat = (chunks * kind.chunk_frames, h // 8, w // 8)
    up, up_attention = load_upstream_v2(folder, device)
    t0 = time.perf_counter()
    model, ours = build_models(up, cfg, kind, device, dtype)
    up_vae, our_vae = build_vaes(up, args.scale, device)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(min(TEXT_TOKENS, cfg.text_len), cfg.text_dim, generator=g).to(device)
    image_latent = torch.randn(16, *lat, generator=g).to(device)
    print(f"built in {build_s:.1f} s; upstream's chunks ...", file=sys.stderr, flush=True)
    # untimed: the decoder's first kernels and workspaces (the VAE's tensors are shared with ours)
    up_vae.decode([image_latent[:, :2]])

    upstream, inputs = run_upstream(
        up, model, up_vae, ctx, image_latent, kind, (h, w), chunks, dtype, device, args.seed, steady_from
    )
    print(f"upstream: {upstream}", file=sys.stderr, flush=True)
    mine, latents = run_ours(ours, our_vae, ctx, inputs, kind, lat, device, args.seed, steady_from)
    print(f"ours: {mine}", file=sys.stderr, flush=True)
    deviations = [rel_error(a, b) for a, b in zip(latents, inputs["latents"], strict=True)]
    speedup = upstream["steady_chunk_s"] / mine["steady_chunk_s"]
    summary = {
        "bench": "upstream_v2",
        "scale": args.scale,
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "size": [h, w],
        "latent": list(lat),
        "chunks": chunks,
        "steady_from_chunk": steady_from,
        "chunk_frames": kind.chunk_frames,
        "window_sink": [kind.local_attn_size, kind.sink_size],
        "shift": kind.shift,
        "weights": f"random, dense {str(dtype).removeprefix('torch.')}, one set shared by both sides",
        "build_s": round(build_s, 2),
        "upstream_attention": up_attention,
        "ours_attention": attention.active().__name__,
        "upstream": upstream,
        "ours": mine,
        "fps_ours_over_upstream": round(speedup, 3),
        "dit_ours_over_upstream": round(upstream["steady_dit_s"] / mine["steady_dit_s"], 3),
        "after_first_ours_over_upstream": round(
            upstream["after_first_chunk_s"] / mine["after_first_chunk_s"], 3
        ),
        "target_3x": speedup >= 3.0,
        "max_rel_dev_chunk_latents": max(deviations),
        "rel_dev_per_chunk": deviations,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
