"""Benchmark: fp8 linears (e4m3, row-wise scales, `wan.fp8`) against today's bf16 path, and SDPA's attention
backends, at the base-cam step and the v2 chunk shapes, each beside its kernel floor.

Random full-size models are built on the device (no files; weights by `wan.dit.init_random_`'s rules, bf16 as
a loaded expert holds them), then their blocks' Linears are quantized in place as the loader's
``quantize='fp8'`` does. Random weights say nothing about image quality: deviations are numerics only.

- ``base_cam``: one CFG step of the A14B expert at 464x832x81 (31,668 tokens) through `wan.pipeline.denoise`
  (as bench_speed): bf16 eager (the exact path), bf16 compiled, fp8 eager, fp8 compiled. Deviation of the
  step's latent and of one forward's flow prediction from the exact path (relative L2, max abs).
- ``v2``: the chunk loop (`wan.fast.FastSession.next_chunk`: 4 steps + the commit forward) of the v2 1.3B and
  14B at 464x832, chunk 4 latent frames, window 18 / sink 6 (the documented run), 8 chunks timed once the
  window is full (the last 3); bf16 eager (the exact path), bf16 compiled (`FastConfig.compile`: the blocks
  compile at the first chunk that evicts, chunk 4, and run compiled from then on), fp8 eager, fp8 compiled;
  each chunk's 4 steps and its commit pass timed apart by CUDA events (no sync inside the loop); deviation of
  the chunks' latents from the same precision's eager loop (compiled) and from bf16 (fp8).
- floors: the step's kernels alone back to back (GEMMs at the real shapes with their biases, SDPA attention),
  in bf16 (`bench_speed.kernel_floor`'s sequence) and with the GEMMs as fp8 scaled matmuls on pre-quantized
  operands; plus the sustained dense GEMM rate of each precision measured here x the step's GEMM FLOPs.
- ``attention``: SDPA's flash / cuDNN / efficient backends (and the automatic choice) at the base-cam self-
  and cross-attention and the v2 chunk shapes (q = 4 latent frames, k/v = the 18-frame window, which holds
  the chunk's own slots, as the loop runs; and 22 frames, window + chunk), time and
  deviation from an fp32 reference; flash-attn, flashinfer and sageattention only when importable (listed
  as absent otherwise); cuDNN's fp8 attention (`--attention fp8`, `wan.fp8_attention`) where it runs, with
  and without its quantization, and its deviation from the fp32 reference and from `fp8_attention.reference`
  (the kernel's arithmetic in plain torch); FlashAttention-3 (`--attention fa3` / `fa3_fp8`,
  `wan.fa3_attention`) where it runs, as the blocks call it and its kernel alone on prepared operands.
- ``*_fp8attn`` / ``*_fa3attn`` / ``*_fa3fp8attn`` paths (base-cam and chunk loops): the compiled path with
  `attention='fp8'` / `'fa3'` / `'fa3_fp8'` as well; their floor counts that backend's kernel in place of SDPA's.
- ``*_cams`` (chunk loops): the kept camera injections; ``*_fastacc``: the fp8 linears' fast accumulation
  (`wan.fp8.accumulation`), its floor's scaled matmuls accumulating fast too; ``*_unfused``: the blocks' Triton
  kernels off (`wan.fp8_gelu`'s GELU + quantization, `wan.qk_rope`'s q/k norm + RoPE, `wan.fp8_inputs`' norms +
  quantization), left to inductor (every
  other path on CUDA takes them where they apply), the same floor.
- ``--profile PATH ...`` (chunk loops): one more chunk after the timed ones under torch.profiler, its top 40
  device kernels by time (``kernels``: name, ms, calls): where the chunk's time goes beside its floor.

    python benchmarks/bench_fp8.py --scale full --paths bf16 fp8_compiled fp8_compiled_fp8attn   # paths to run
    python benchmarks/bench_fp8.py --scale full                 # CUDA (Ada/Hopper/Blackwell for fp8)
    python benchmarks/bench_fp8.py --scale full --skip v2-14b   # cases to leave out
    python benchmarks/bench_fp8.py --scale full --skip base_cam attention v2-14b   # the v2 1.3B chunk loop alone
    python benchmarks/bench_fp8.py --scale tiny                 # CPU smoke run, seconds

Prints one JSON line at the end.
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_speed import SHAPES, Step, kernel_floor, kernel_profile, rel_error, run_case, sync, timed  # noqa: E402
from lingbot_world.loaders import synthetic  # noqa: E402
from lingbot_world.wan import (  # noqa: E402
    attention,
    fa3_attention,
    fp8,
    fp8_attention,
    fp8_gelu,
    fp8_inputs,
    qk_rope,
    speed,
)
from lingbot_world.wan.config import A14B, CHUNKED_KINDS, CONTROL_CHANNELS  # noqa: E402
from lingbot_world.wan.dit import WanModel  # noqa: E402
from lingbot_world.wan.fast import FastConfig, FastSession  # noqa: E402
from lingbot_world.wan.pipeline import Hooks  # noqa: E402
from lingbot_world.wan.speed import SpeedOptions, compiler_missing  # noqa: E402

CHUNK_SHAPE = {"full": (464, 832), "tiny": (32, 48)}
TIMED_CHUNKS = 3
PLAY_WINDOW = (18, 6)  # v1 Fast documents an unbounded cache; it is timed as live play runs it
# the paths a case runs (`--paths`): precision of the Linears, compiled or not, fp8 attention or SDPA's
# (`_kv8`: the chunk loops' K/V cache in e4m3, handed to fp8 attention as stored; base-cam has no cache)
PATHS = (  # in this order: the bf16 paths before the first fp8 one quantizes the model's Linears in place
    "bf16",
    "bf16_compiled",
    "bf16_compiled_nograph",
    "bf16_compiled_fp8attn",
    "bf16_compiled_fa3attn",
    "bf16_compiled_fa3fp8attn",
    "bf16_compiled_fa3fp8attn_kv8",
    "fp8",
    "fp8_compiled",
    "fp8_compiled_fp8attn",
    "fp8_compiled_fa3fp8attn",
    "fp8_compiled_fp8attn_kv8",
    "fp8_compiled_fp8attn_kv8_nograph",
    "fp8_compiled_fa3fp8attn_kv8",
    "fp8_cams",
    "fp8_compiled_fa3fp8attn_kv8_cams",
    "fp8_fastacc",
    "fp8_compiled_fa3fp8attn_fastacc",
    "fp8_compiled_fa3fp8attn_kv8_cams_fastacc",
    "fp8_compiled_fa3fp8attn_fastacc_unfused",
    "fp8_compiled_fa3fp8attn_kv8_cams_fastacc_unfused",
)
# a path's attention backend, by the part of its name that says so (none: SDPA)
ATTENTION_TAGS = {"_fp8attn": "fp8", "_fa3attn": "fa3", "_fa3fp8attn": "fa3_fp8"}
CAMS = "_cams"  # the chunk loops' kept camera injections (`camera_cached`)
FASTACC = "_fastacc"  # the fp8 linears' fast accumulation (`wan.fp8.accumulation`)
# the blocks' Triton kernels off (`wan.fp8_gelu`, `wan.qk_rope`, `wan.fp8_inputs`; `row_kernels`): their A/B
UNFUSED = "_unfused"
CHUNK_ONLY = ("_kv8", "_nograph", CAMS)  # paths of the chunk loops alone (base-cam has no cache nor chunks)


def row_kernels(on: bool) -> None:
    """The blocks' Triton kernels on or off (read when a block is traced: a change recompiles)."""
    fp8_gelu.enabled = qk_rope.enabled = fp8_inputs.enabled = on


def path_options(name: str) -> dict:
    """A path's name -> its settings (fp8 Linears and their accumulation, compiled, attention backend)."""
    return {
        "fp8": name.startswith("fp8"),
        "fp8_accum": "fast" if FASTACC in name else "exact",
        "compile": "_compiled" in name,
        "attention": next((a for tag, a in ATTENTION_TAGS.items() if tag in name), "sdpa"),
    }


def camera_cached(name: str) -> bool:
    """`_cams` (chunk loops): each block's camera injection made once per chunk (`FastConfig.camera_cache`)."""
    return CAMS in name


def path_skip(name: str, args, device, compile_issue) -> str | None:
    """Why path `name` does not run here (None: it runs)."""
    if name not in args.paths:
        return "not in --paths"
    options = path_options(name)
    if options["compile"] and compile_issue:
        return compile_issue
    if options["attention"] != "sdpa":
        return attention.problem(options["attention"], device)
    return None


def tiny(cfg):
    """A CPU-sized stand-in for `cfg` (the smoke run)."""
    return synthetic.tiny_config("cam", text_dim=64, text_len=64)


@torch.no_grad()
def random_model(cfg, device, seed=0) -> WanModel:
    """A bf16 model with `init_random_`'s value rules, drawn on the device (minutes less than on the host)."""
    with torch.device("meta"):
        model = WanModel.from_config(cfg).to(torch.bfloat16)  # bf16 before any memory exists
    model = model.to_empty(device=device).eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, device=device)
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            r = 1 + 0.1 * r
        elif p.dim() >= 2 and "modulation" not in name:
            r = r / math.sqrt(p[0].numel())
        else:
            r = 0.1 * r
        p.copy_(r)
    return model


def to_fp8_(model) -> int:
    """Quantize the blocks' Linears in place, as the loader's quantize='fp8' does; returns how many."""
    n = fp8.quantize_blocks_(model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return n


def deviation(x, ref) -> dict:
    return {"rel_l2": rel_error(x, ref), "max_abs": float((x.float() - ref.float()).abs().max())}


def gemm_flops(cfg, q_tokens: int, text_tokens: int, forwards: int) -> int:
    """FLOPs of a forward's block GEMMs: 10 dim x dim at q tokens (self q/k/v/o, camera 4, cross q/o), FFN up and
    down, cross k/v over `text_tokens` (0 where cached); times blocks and forwards."""
    d, f = cfg.dim, cfg.ffn_dim
    per_block = 2 * (q_tokens * (10 * d * d + 2 * d * f) + text_tokens * 2 * d * d)
    return per_block * cfg.num_layers * forwards


def gemm_rate(device, m: int, k: int, n: int, use_fp8: bool, seconds: float = 2.0) -> float:
    """Sustained TFLOP/s of one [m, k] x [k, n] GEMM run back to back for ~`seconds` (bf16, or fp8 row-wise)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device)
    b = torch.randn(n, k, generator=g, device=device)
    if use_fp8:
        (aq, sa), (bq, sb) = fp8.quantize_rows(a), fp8.quantize_rows(b)

        def fn():
            torch._scaled_mm(aq, bq.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)
    else:
        a, b = a.bfloat16(), b.bfloat16()

        def fn():
            a @ b.t()

    fn()
    sync(device)
    t = min(timed(fn, device, 3))
    reps = max(1, int(seconds / max(t, 1e-6)))

    def burst():
        for _ in range(reps):
            fn()

    burst()
    return 2 * m * k * n * reps / min(timed(burst, device, 2)) / 1e12


def floor_sequence(
    cfg,
    q_tokens,
    kv_tokens,
    text_tokens,
    device,
    forwards: int,
    use_fp8: bool,
    attn: str = "sdpa",
    camera_once: bool = False,
    fast_accum: bool = False,
    keys_only: int = 0,
) -> float:
    """Sustained seconds of the kernels alone, back to back: per block the GEMMs at the real shapes with their
    biases (fp8: scaled matmuls on operands quantized beforehand) and self- (q vs kv tokens) and cross-attention
    (SDPA bf16; `attn` 'fp8' / 'fa3' / 'fa3_fp8': that backend's kernel for the self-attention, fp8 operands
    quantized beforehand; cross-attention stays SDPA, as the backends keep short key sets on bf16 kernels);
    `text_tokens` 0: cross k/v cached (the chunk loop; FA3 then reads the self-attention's keys as a cache aligned
    right, through the entry the compiled loop runs, `fa3_attention.CachedRows`); `camera_once`: the camera's 4
    GEMMs per block once for all `forwards` (the kept camera injections); `fast_accum`: the scaled matmuls' fast
    accumulation; `keys_only`: that many of the blocks run their k and v projections alone (the compiled chunk loop's
    commit pass, whose last block makes only its keys: `WanModel.forward_tokens`' `keys_only`)."""
    dt, dim, ffn, heads = torch.bfloat16, cfg.dim, cfg.ffn_dim, cfg.num_heads
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    x, ctx, hidden = rand(q_tokens, dim), rand(max(text_tokens, 1), dim), rand(q_tokens, ffn)
    w_sq, w_up, w_down, b_dim, b_ffn = rand(dim, dim), rand(ffn, dim), rand(dim, ffn), rand(dim), rand(ffn)
    if use_fp8:
        quant = {id(t): fp8.quantize_rows(t) for t in (x, ctx, hidden, w_sq, w_up, w_down)}

        def gemm(a, w, b):
            (aq, sa), (wq, sw) = quant[id(a)], quant[id(w)]
            return torch._scaled_mm(
                aq,
                wq.t(),
                scale_a=sa[:, None],
                scale_b=sw[None, :],
                bias=b,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast_accum,
            )
    else:
        gemm = F.linear
    gemms = [(x, w_sq, b_dim, 6 if camera_once else 10), (x, w_up, b_ffn, 1), (hidden, w_down, b_dim, 1)]
    if text_tokens:
        gemms.append((ctx, w_sq, b_dim, 2))
    d = dim // heads
    q, k, v = rand(1, heads, q_tokens, d), rand(1, heads, kv_tokens, d), rand(1, heads, kv_tokens, d)
    kv_text = rand(1, heads, cfg.text_len, d)
    # cross-attention over the text's keys stays SDPA under fp8 attention too (MIN_KEYS)
    attend = cross = F.scaled_dot_product_attention
    if attn == "fp8":
        codes = {id(t): fp8_attention.quantize(t[0].transpose(0, 1)) for t in (q, k, v)}

        def attend(q, k, v):
            (q8, qs), (k8, ks), (v8, vs) = codes[id(q)], codes[id(k)], codes[id(v)]
            torch.ops.lingbot.fp8_attention(q8, k8, v8, qs, ks, vs, vs)
    elif attn in ("fa3", "fa3_fp8"):
        attend = functools.partial(_fa3_kernel, fa3_operands(attn, q, k, v, cache=not text_tokens))

    def sequence():
        for _ in range(cfg.num_layers * camera_once * 4 + keys_only * 2):
            gemm(x, w_sq, b_dim)
        for _ in range(cfg.num_layers * forwards - keys_only):
            for a, w, b, count in gemms:
                for _ in range(count):
                    gemm(a, w, b)
            attend(q, k, v)
            cross(q, kv_text, kv_text)

    sequence()
    return min(timed(sequence, device, 2))


def floors(
    cfg, q_tokens, kv_tokens, text_tokens, device, forwards, rates, paths: tuple = (), chunk: bool = False
) -> dict:
    """Each precision's and attention kernel's sustained floor (`floor_sequence`), and for the `paths` with the
    kept camera injections, fast accumulation or (`chunk` loops, compiled) the commit pass's keys-only last block
    theirs: the camera's GEMMs once, the fp8 GEMMs accumulating fast, that block's k and v alone (`floor_key`)."""
    out = {}
    runs = [("bf16", False, "sdpa"), ("fp8", True, "sdpa")]
    for tag, attn in ATTENTION_TAGS.items():
        if attention.problem(attn, device) is None:
            runs += [(f"bf16{tag}", False, attn), (f"fp8{tag}", True, attn)]
    runs = [(f"{name}_sustained_s", use_fp8, attn, False, False, 0) for name, use_fp8, attn in runs]
    for path in paths:
        options = path_options(path)
        keys_only = int(chunk and keys_only_commit(path))
        spec = (options["fp8"], options["attention"], camera_cached(path), options["fp8_accum"] == "fast")
        if spec[2] or spec[3] or keys_only:
            runs.append((floor_key(path, chunk), *spec, keys_only))
    for key, use_fp8, attn, once, fast, keys_only in dict.fromkeys(runs):
        seq = floor_sequence(
            cfg, q_tokens, kv_tokens, text_tokens, device, forwards, use_fp8, attn, once, fast, keys_only
        )
        out[key] = round(seq, 5)
    # the GEMM FLOPs at each precision's sustained rate, plus the attention of the bf16 floor's kernels
    flops = gemm_flops(cfg, q_tokens, text_tokens, forwards)
    attn = kernel_floor(cfg, q_tokens, device, 3, forwards) if kv_tokens == q_tokens else None
    for name in ("bf16", "fp8"):
        gemm_s = flops / (rates[name] * 1e12)
        out[f"{name}_gemm_at_rate_s"] = round(gemm_s, 5)
        if attn is not None:
            out[f"{name}_rate_floor_s"] = round(gemm_s + attn["attention_s"], 5)
    out["gemm_tflop"] = round(flops / 1e12, 3)
    return out


def base_cam(args, device, rates) -> dict:
    cfg = A14B if args.scale == "full" else tiny(A14B)
    model = random_model(cfg, device)
    step = Step(model, cfg, device, SHAPES[args.scale])
    t999 = torch.tensor([999.0], device=device)

    def flow():
        with torch.no_grad():
            return model(step.noise, t999, step.context, y=step.y, cam=step.cam)

    compile_issue = compiler_missing(device)
    if device.type == "cpu" and not args.cpu_compile:
        compile_issue = "CPU: inductor takes minutes to build; pass --cpu-compile"
    out = {"tokens": step.tokens, "size": list(SHAPES[args.scale][:3])}
    exact = run_case(step, SpeedOptions(), 5.0, args.repeats)
    reference, flow_ref = exact.pop("latent"), flow()
    out["bf16_eager"] = exact
    for path in (p for p in PATHS[1:] if not any(tag in p for tag in CHUNK_ONLY)):
        name = "fp8_eager" if path == "fp8" else path
        skip = path_skip(path, args, device, compile_issue)
        if skip:
            out[name] = {"skipped": skip}
            continue
        options = SpeedOptions(**path_options(path))
        row_kernels(UNFUSED not in path)
        if options.fp8 and not fp8.is_fp8(model.blocks[0].self_attn.q):
            out["fp8_layers"] = to_fp8_(model)
        res = run_case(step, options, 5.0, args.repeats, reference)
        res["latent_deviation"] = deviation(res.pop("latent"), reference)
        if not options.compile:
            with fp8.accumulation(options.fp8_accum):
                res["flow_deviation"] = deviation(flow(), flow_ref)
        out[name] = res
        print(f"base_cam {name}: {res}", file=sys.stderr)
    row_kernels(True)
    timed = [name for name in PATHS if "step_s" in out.get(name, {})]
    out["floor"] = floors(cfg, step.tokens, step.tokens, cfg.text_len, device, 2, rates, timed)
    base = out.get("bf16_compiled", {}).get("step_s")
    timed_paths = [name for name, res in out.items() if isinstance(res, dict) and "step_s" in res]
    for name in timed_paths:
        if name != "bf16_eager":
            out[f"{name}_over_bf16_compiled"] = round(out[name]["step_s"] / base, 3) if base else None
    for case in (name for name in timed_paths if "_compiled" in name):
        floor = out["floor"].get(floor_key(case))
        if floor:
            out[f"{case}_over_sustained_floor"] = round(out[case]["step_s"] / floor, 3)
    return out


def keys_only_commit(path: str) -> bool:
    """Whether a chunk loop's path runs its commit pass's last block for its keys alone (compiled loops do)."""
    return "compiled" in path


def floor_key(path: str, chunk: bool = False) -> str:
    """The `floors` entry a path is measured against (its Linears' precision; its attention kernel; in a `chunk`
    loop, the commit pass's keys-only last block)."""
    prec = "fp8" if path.startswith("fp8") else "bf16"
    tag = next((tag for tag in ATTENTION_TAGS if tag in path), "")
    cams = CAMS if camera_cached(path) else ""
    keys = "_commitkeys" if chunk and keys_only_commit(path) else ""
    return f"{prec}{tag}{cams}{FASTACC if FASTACC in path else ''}{keys}_sustained_s"


class ChunkTimer(Hooks):
    """Marks at each forward's start (`Hooks.check`) and at the chunk's end (`progress`): CUDA events on a GPU
    (nothing waits inside the loop), host times on the CPU. `split()` after the chunk's sync: the seconds of its
    4 denoising steps and of its commit pass (the last forward)."""

    def __init__(self, device):
        super().__init__(progress=lambda *_: self._mark())
        self.cuda, self.marks = device.type == "cuda", []

    def _mark(self):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def check(self):
        super().check()
        self._mark()

    def split(self) -> tuple[float, float]:
        first, commit, end = self.marks[0], self.marks[-2], self.marks[-1]
        self.marks = []
        if self.cuda:
            return first.elapsed_time(commit) / 1e3, commit.elapsed_time(end) / 1e3
        return commit - first, end - commit


def v2_case(kind_name, args, device, rates) -> dict:
    kind = CHUNKED_KINDS[kind_name]
    cfg = kind.dit if args.scale == "full" else tiny(kind.dit)
    h, w = CHUNK_SHAPE[args.scale]
    lat_h, lat_w, chunk = h // 8, w // 8, kind.chunk_frames
    config = FastConfig.for_kind(kind, seed=0)
    if config.local_attn_size == -1:
        window, sink = PLAY_WINDOW
        config = dataclasses.replace(config, local_attn_size=window, sink_size=sink)
    # the first chunk that evicts compiles (over upstream's layout); the one after it records the commit pass's graph
    compile_chunk = config.roll_chunks - 1
    warm = config.roll_chunks + 1
    timed_end = warm + TIMED_CHUNKS
    # `--profile`: one more steady chunk, run under the profiler after the timed ones
    chunks = timed_end + any(name in args.paths for name in args.profile)
    lat_shape = (chunk * chunks, lat_h, lat_w)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(20, *lat_shape, generator=g).to(device)
    context = torch.randn(60, cfg.text_dim, generator=g).to(device)
    cams = [
        torch.randn(1, CONTROL_CHANNELS["cam"], chunk, lat_h, lat_w, generator=g).to(device)
        for _ in range(chunks)
    ]
    model = random_model(cfg, device, seed=1)
    frame_tokens = (lat_h // 2) * (lat_w // 2)
    out = {"chunk_frames": chunk, "window": config.local_attn_size, "sink": config.sink_size}
    out["q_tokens"], out["kv_tokens_when_full"] = chunk * frame_tokens, config.local_attn_size * frame_tokens
    compile_issue = compiler_missing(device)
    if device.type == "cpu" and not args.cpu_compile:
        compile_issue = "CPU: inductor takes minutes to build; pass --cpu-compile"
    latents = {}
    mean = lambda values: round(sum(values) / len(values), 4)  # noqa: E731
    for name in PATHS:
        skip = path_skip(name, args, device, compile_issue)
        if skip:
            out[name] = {"skipped": skip}
            continue
        options = path_options(name)
        row_kernels(UNFUSED not in name)
        compiled = options["compile"]
        kv = torch.float8_e4m3fn if "_kv8" in name else config.kv_dtype
        if options["fp8"] and not fp8.is_fp8(model.blocks[0].self_attn.q):
            out["fp8_layers"] = to_fp8_(model)
        timer = ChunkTimer(device)
        run_config = dataclasses.replace(
            config,
            compile=compiled,
            attention=options["attention"],
            kv_dtype=kv,
            camera_cache=camera_cached(name),
            fp8_accum=options["fp8_accum"],
        )
        session = FastSession(model, context, y, lat_shape, run_config, device, timer)
        # `_nograph`: compiled blocks without the chunk loop's CUDA graph (`FastSession._graphed`)
        session._graphs = session._graphs and not name.endswith("_nograph")
        out[name] = {"cuda_graph": session._graphs}
        times, steps, commits, xs = [], [], [], []
        for c in range(timed_end):
            sync(device)
            t0 = time.perf_counter()
            xs.append(session.next_chunk(cams[c]))
            sync(device)
            times.append(time.perf_counter() - t0)
            step_s, commit_s = timer.split()
            steps.append(step_s)
            commits.append(commit_s)
        if name in args.profile:
            out[name]["kernels"] = kernel_profile(
                functools.partial(session.next_chunk, cams[timed_end]), device, 40
            )
        session.close()
        latents[name] = xs
        out[name] |= {
            "chunk_s": mean(times[warm:]),
            "steps_s": mean(steps[warm:]),
            "commit_s": mean(commits[warm:]),
            "chunks_s": [round(t, 4) for t in times],
            "commits_s": [round(t, 4) for t in commits],
            "forwards_per_chunk": len(config.timestep_index) + 1,
        }
        out[name]["commit_share"] = round(out[name]["commit_s"] / out[name]["chunk_s"], 3)
        # this precision's exact loop (the kept camera injections' eager loop equals it)
        eager = "fp8" if options["fp8"] else "bf16"
        if compiled:
            out[name]["compiled"] = not speed._shared_runners[speed.run_chunk_block].failed
            out[name]["compile_chunk_s"] = out[name]["chunks_s"][compile_chunk]
        if name != eager and eager in latents:
            out[name]["last_chunk_deviation_from_eager"] = deviation(xs[-1], latents[eager][-1])
            out[f"{name}_over_{eager}"] = round(out[name]["chunk_s"] / out[eager]["chunk_s"], 3)
        if name != "bf16" and "bf16" in latents:
            out[name]["last_chunk_deviation_from_bf16"] = deviation(xs[-1], latents["bf16"][-1])
            out[f"{name}_over_bf16"] = round(out[name]["chunk_s"] / out["bf16"]["chunk_s"], 3)
        if device.type == "cuda":
            out[name]["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / (1 << 30), 2)
        print(f"{kind_name} {name}: {out[name]}", file=sys.stderr)
    row_kernels(True)
    if "fp8" in latents and "bf16" in latents:
        out["fp8"]["first_chunk_deviation"] = deviation(latents["fp8"][0], latents["bf16"][0])
    # the floor of one chunk: its forwards' kernels with the window full (cross k/v cached after the first)
    forwards = len(config.timestep_index) + 1
    kv = min(out["kv_tokens_when_full"], out["q_tokens"] * timed_end) or out["q_tokens"]
    timed = [name for name in PATHS if "chunk_s" in out[name]]
    out["floor"] = floors(cfg, out["q_tokens"], kv, 0, device, forwards, rates, timed, chunk=True)
    for name in PATHS:
        floor = out["floor"].get(floor_key(name, chunk=True))
        if "chunk_s" in out[name] and floor:
            out[f"{name}_over_sustained_floor"] = round(out[name]["chunk_s"] / floor, 3)
    del model
    torch._dynamo.reset()  # the compiled graphs' references to this model go with them
    return out


def attention_cases(args, device) -> dict:
    """SDPA backends (and the optional packages) at the base-cam and v2 chunk attention shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    full = args.scale == "full"
    frame = (58 // 2) * (104 // 2) if full else 4 * 6
    shapes = {  # name: (heads, q tokens, kv tokens)
        "base_cam_self": (
            40 if full else 4,
            21 * frame if full else 3 * frame,
            21 * frame if full else 3 * frame,
        ),
        "base_cam_cross": (40 if full else 4, 21 * frame if full else 3 * frame, 512 if full else 64),
        # the chunk loop's cache holds the window, the chunk's own slots included: k/v = 18 frames when full
        "v2_14b_chunk": (40 if full else 4, 4 * frame, 18 * frame),
        "v2_1_3b_chunk": (12 if full else 4, 4 * frame, 18 * frame),
        # the issue's wording (window + chunk: 22 frames), for comparison
        "v2_14b_chunk_kv22": (40 if full else 4, 4 * frame, 22 * frame),
    }
    backends = {
        "sdpa_auto": None,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    extra = {}
    for pkg in ("flash_attn", "flash_attn_interface", "flashinfer", "sageattention"):
        extra[pkg] = "importable" if importlib.util.find_spec(pkg) is not None else "absent"
    out = {"packages": extra}
    fp8_attn = attention.problem("fp8", device) is None
    if not fp8_attn:
        out["fp8_cudnn"] = attention.problem("fp8", device)
    fa3 = [name for name in ("fa3", "fa3_fp8") if attention.problem(name, device) is None]
    for name in {"fa3", "fa3_fp8"} - set(fa3):
        out[name] = attention.problem(name, device)
    d = 128 if full else 16
    for shape, (heads, lq, lk) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(1, heads, n, d, generator=g, device=device, dtype=torch.bfloat16)
            for n in (lq, lk, lk)
        )
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        except RuntimeError as err:
            ref, out_ref = None, str(err).splitlines()[0][:200]
        res = {"heads": heads, "q_tokens": lq, "kv_tokens": lk}
        if ref is None:
            res["reference_error"] = out_ref
        runs = {name: functools.partial(_with_backend, backend) for name, backend in backends.items()}
        optional = {"flash_attn": _flash_attn, "sageattention": _sage, "flashinfer": _flashinfer}
        runs.update({name: fn for name, fn in optional.items() if extra[name] == "importable"})
        if fp8_attn:
            # cuDNN's kernel at every key count (the registry's 'fp8' keeps short key sets on SDPA)
            runs["fp8_cudnn"] = functools.partial(_as_blocks_call, fp8_attention.attention)
            codes = [fp8_attention.quantize(t[0].transpose(0, 1)) for t in (q, k, v)]
            runs["fp8_cudnn_kernel"] = functools.partial(_fp8_kernel, codes)
        for name in fa3:  # as the blocks call them (eager, quantization included), and the kernel alone
            runs[name] = functools.partial(_as_blocks_call, attention.resolve(name))
            runs[f"{name}_kernel"] = functools.partial(_fa3_kernel, fa3_operands(name, q, k, v))
        for name, kernel in runs.items():
            fn = functools.partial(kernel, q, k, v)
            try:
                o = fn()
                t = min(timed(fn, device, max(args.repeats, 3)))
            except Exception as err:  # noqa: BLE001 - a backend that cannot take this shape/card: say why
                res[name] = {"unavailable": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"}
                continue
            res[name] = {"ms": round(t * 1e3, 3)}
            # cuDNN's kernel alone writes e4m3 codes (no deviation to take); FA3's writes bf16 attention
            if ref is not None and (not name.endswith("_kernel") or name.startswith("fa3")):
                res[name].update(deviation(o, ref))
        if fp8_attn:  # the kernel against its arithmetic in plain torch, on the first heads
            few = min(heads, 2)
            part = [(c[:, :few].contiguous(), s) for c, s in codes]
            operands = (*(c for c, _ in part), *(s for _, s in part), part[2][1])  # the output at v's scale
            kernel = torch.ops.lingbot.fp8_attention(*operands)
            emulated = fp8_attention.reference(*operands)
            res["fp8_cudnn"]["vs_reference"] = deviation(kernel.float(), emulated.float())
            del codes, part
        timed_ok = {n: r["ms"] for n, r in res.items() if isinstance(r, dict) and "ms" in r}
        if timed_ok:
            res["fastest"] = min(timed_ok, key=timed_ok.get)
        out[shape] = res
        print(f"attention {shape}: {res}", file=sys.stderr)
        del q, k, v, ref
    return out


def _with_backend(backend, q, k, v):
    """SDPA restricted to `backend` (None: PyTorch's own choice)."""
    from torch.nn.attention import sdpa_kernel

    if backend is None:
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v)


def _as_blocks_call(backend, q, k, v):
    """A `wan.attention` backend as the blocks call it ([L, heads, d] in and out; quantization included, eager),
    on SDPA's [1, heads, L, d] tensors."""
    out = backend(*(t[0].transpose(0, 1) for t in (q, k, v)), torch.bfloat16)
    return out.transpose(0, 1)[None]


def fa3_operands(name, q, k, v, cache: bool = False) -> dict:
    """FA3's arguments for [1, heads, L, d] q, k, v: [L, heads, d] contiguous, as the blocks hand them over;
    'fa3_fp8': e4m3 codes with a scale per head (`fa3_attention.head_quantize`), quantized beforehand. `cache`: k
    and v as a full K/V cache aligned right (`fa3_attention.CachedRows` from row 0), as the compiled chunk loop
    hands its window over."""
    tensors = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    if cache:
        start = torch.zeros(1, dtype=torch.int32, device=q.device)
        tensors[1:] = [fa3_attention.CachedRows(t, start) for t in tensors[1:]]
    if name == "fa3":
        return {"tensors": tensors, "descales": {}}
    quantized = [fa3_attention.head_quantize(t) for t in tensors]
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), (s for _, s in quantized), strict=True))
    return {"tensors": [c for c, _ in quantized], "descales": descales}


def _fa3_kernel(operands, *_):
    """FA3's kernel alone on prepared operands (`fa3_operands`), its output in SDPA's layout."""
    return fa3_attention.flash(*operands["tensors"], **operands["descales"]).transpose(0, 1)[None]


def _fp8_kernel(codes, *_):
    """cuDNN's fp8 attention alone, on operands quantized beforehand."""
    return torch.ops.lingbot.fp8_attention(*(c for c, _ in codes), *(s for _, s in codes), codes[2][1])


def _flash_attn(q, k, v):
    from flash_attn import flash_attn_func

    return flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _sage(q, k, v):
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def _flashinfer(q, k, v):
    import flashinfer

    o = flashinfer.single_prefill_with_kv_cache(*(t[0].transpose(0, 1) for t in (q, k, v)))
    return o.transpose(0, 1)[None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, default=None, help="unused (no files are written); for symmetry")
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed steps per base-cam case (after one warm-up)"
    )
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["base_cam", "v2-1.3b", "v2-14b", "fast", "attention"],
        help="cases to leave out",
    )
    ap.add_argument("--cpu-compile", action="store_true", help="also compile on CPU (minutes to build)")
    ap.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=PATHS,
        help="chunk-loop paths to run one more steady chunk of under torch.profiler: its top kernels by time",
    )
    ap.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=PATHS,
        help="paths of the base-cam and chunk-loop cases (bf16 eager always runs: the reference)",
    )
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs a CUDA GPU")
    device = torch.device("cuda" if cuda else "cpu")
    summary = {
        "bench": "fp8",
        "scale": args.scale,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "torch": torch.__version__,
        "fp8_problem": fp8.fp8_problem(device),
        "fp8_attention_problem": attention.problem("fp8", device),
        "fa3_problem": attention.problem("fa3", device),
        "fa3_fp8_problem": attention.problem("fa3_fp8", device),
        "note": "random weights: deviations are numerics only, not image quality",
    }
    if cuda and summary["fp8_problem"] is not None:
        raise SystemExit(f"fp8 cannot run here: {summary['fp8_problem']}")
    big = (16384, 5120, 13824) if args.scale == "full" else (256, 64, 128)
    rates = {"bf16": gemm_rate(device, *big, use_fp8=False), "fp8": gemm_rate(device, *big, use_fp8=True)}
    summary["sustained_gemm_tflops"] = {k: round(v, 1) for k, v in rates.items()}
    summary["sustained_gemm_shape"] = list(big)
    t0 = time.perf_counter()
    if "base_cam" not in args.skip:
        summary["base_cam"] = base_cam(args, device, rates)
        torch._dynamo.reset()  # the compiled graphs' references to that model go with them
    for kind in ("v2-1.3b", "v2-14b", "fast"):
        if cuda:
            torch.cuda.empty_cache()
        if kind not in args.skip:
            summary[kind] = v2_case(kind, args, device, rates)
    if "attention" not in args.skip:
        summary["attention"] = attention_cases(args, device)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
