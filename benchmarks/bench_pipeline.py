"""Benchmark: a whole CLI run at full scale on one GPU under a VRAM cap: `generate`, or `fast` (chunked).

`--command generate` (default) builds a random checkpoint folder in the NF4 repack's layout under
--workdir (two A14B cam experts in the exact NF4 format, a random umT5-XXL in ComfyUI's safetensors
layout with a synthetic 256384-piece tokenizer, a random Wan2.1 VAE), then runs `lingbot.py generate`
in this process with `torch.cuda.set_per_process_memory_fraction` capping the device at --vram-cap-gib.

`--command fast --model v2-1.3b|v2-14b|fast` builds the kind's DiT at full size in the layout a user
has on disk (the v2 1.3B as released: flat config-less fp32 shards + index; the v2 14B and v1 Fast as
the NF4 folder `lingbot.py quantize` writes from their fp32 shards, with the kind it records) and the
same random umT5-XXL/tokenizer/VAE in a separate assets folder (--assets_dir), then runs `lingbot.py
fast` the same way: text encode, first-frame encode, the chunks with each chunk's VAE decode, the
MP4; by default 109 frames (28 latent frames: 7 chunks of 4 for v2) and the kind's window and sink.
The summary puts the planner's prediction for the run (`fast_run.fast_memory`, recorded from the
CLI's own call) beside the measured peaks, with every chunk's time and the frame rate it sustains.
--skip-fit-check runs it even where the planner would refuse it (its verdict is still recorded).
Each chunk's decode runs beside the next chunk's DiT where the CLI's plan fits both on the card (each chunk
timing says `overlap`), or on a second GPU with `--extra '--decode_device cuda:1'` (the cap applies to
cuda:0); --serial-decode decodes each chunk after its DiT instead (the baseline).

Both record per-phase wall time, peak anonymous RSS and peak VRAM (the CLI's own phase log), and the
card's peak used memory with every process on it (the text encoder's child included:
`card_peak_used_gib`). Checkpoints are written once under --workdir and reused.

    python benchmarks/bench_pipeline.py --scale full --workdir /tmp/bench_pipe     # GPU
    python benchmarks/bench_pipeline.py --scale tiny --workdir /tmp/bench_pipe     # CPU check
    python benchmarks/bench_pipeline.py --scale full --workdir /tmp/bpf --command fast --model v2-14b \
        --vram-cap-gib 24 --extra '--t5_cpu --kv_dtype fp8'
    python benchmarks/bench_pipeline.py --scale full --workdir /tmp/bpf --command fast --model v2-1.3b \
        --vram-cap-gib 70 --extra '--t5_cpu --vae_dtype fp16' [--serial-decode] [--extra ... --decode_device cuda:1]

Prints one JSON line at the end.
"""

import argparse
import contextlib
import functools
import inspect
import json
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_speed import set_vram_cap  # noqa: E402
from bench_t5 import SCALES as T5_SCALES  # noqa: E402
from bench_t5 import write_random_safetensors, write_synthetic_tokenizer  # noqa: E402

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world import cli  # noqa: E402
from lingbot_world.loaders import checkpoints, demo_assets, synthetic, video  # noqa: E402
from lingbot_world.loaders import fast_checkpoint as FC  # noqa: E402
from lingbot_world.loaders.formats import NF4_META  # noqa: E402
from lingbot_world.session import fast_run  # noqa: E402
from lingbot_world.wan.config import A14B, CHUNKED_KINDS  # noqa: E402
from lingbot_world.wan.vae import WAN21_VAE_CONFIG, WanVAE, init_random_  # noqa: E402

EXAMPLE = HERE.parent / "examples" / "00"
FAST_FRAMES = 109  # v2: 28 latent frames, 7 chunks of 4 (v1 Fast: 27 latent frames, 9 chunks of 3)
# where `lingbot.py quantize` puts the NF4 folder of a 14B chunked DiT (its fp32 shards are 56 GB)
NF4_DIRS = {"v2-14b": FC.V2_NF4_DIR, "fast": FC.FAST_NF4_DIR}


def gib(n: int | None, digits: int = 3) -> float | None:
    return None if n is None else round(n / (1 << 30), digits)


def run_parallel(jobs: list) -> None:
    """Run `jobs` ((function, *args) each) at once in spawned processes: gigabytes of random data to write."""
    if not jobs:
        return
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(jobs), mp_context=spawn, initializer=load_pack) as pool:
        for job in [pool.submit(*job) for job in jobs]:
            job.result()


def t5_job(root: Path) -> tuple:
    """The random umT5-XXL in ComfyUI's bf16 safetensors layout (11.4 GB): a job for `run_parallel`."""
    return (write_random_safetensors, root / "umt5_xxl_bf16.safetensors", T5_SCALES["full"])


def finish_assets(root: Path) -> None:
    """The synthetic 256384-piece tokenizer and the random Wan2.1 VAE beside the umT5-XXL file."""
    write_synthetic_tokenizer(root / "tokenizer", T5_SCALES["full"]["vocab"])
    torch.save(init_random_(WanVAE(**WAN21_VAE_CONFIG)).state_dict(), root / "Wan2.1_VAE.pth")


def build_full_checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if (root / "COMPLETE").is_file():
        return root
    t0 = time.perf_counter()
    nf4 = functools.partial(synthetic.write_nf4_expert, mode="random")
    experts = [
        (nf4, root / f"{role}_noise_model_bnb_nf4", A14B, seed) for seed, role in enumerate(("high", "low"))
    ]
    run_parallel([*experts, t5_job(root)])  # ~30 GB to write
    finish_assets(root)
    (root / "COMPLETE").write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
    return root


def build_fast_checkpoint(workdir: Path, kind: str, scale: str) -> tuple[Path, Path]:
    """(--ckpt_dir, --assets_dir) of a random `kind` checkpoint, built once under `workdir`.

    The DiT is kept as a user keeps it: the v2 1.3B as released (flat config-less fp32 shards +
    model.safetensors.index.json); the v2 14B and v1 Fast as the NF4 folder `lingbot.py quantize` writes
    in their folder (random packed codes in the repack's format, the kind recorded as quantize records a v2
    DiT's). full: the released architecture, with the random umT5-XXL, tokenizer and VAE in workdir/assets
    (written in parallel with the DiT); tiny: a small DiT (num_heads = dim / 128, as the 1.3B's headers give it)
    with the demo checkpoint's tiny assets."""
    root, done = workdir / f"{scale}-{kind}", workdir / f"{scale}-{kind}.complete"
    if scale == "full":
        cfg, assets = CHUNKED_KINDS[kind].dit, workdir / "assets"
    else:
        cfg = synthetic.tiny_config(dim=256, num_heads=2, ffn_dim=256, text_len=512)
        assets = demo_assets.ensure_demo_checkpoint(workdir)
    jobs, t0 = [], time.perf_counter()
    new_assets = not (assets / "COMPLETE").is_file()
    if new_assets:
        assets.mkdir(parents=True, exist_ok=True)
        jobs.append(t5_job(assets))
    if not done.is_file():
        if kind == "v2-1.3b":
            jobs.append((synthetic.write_v2_1_3b, root, cfg))
        else:
            jobs.append(
                (functools.partial(synthetic.write_nf4_expert, mode="random"), root / NF4_DIRS[kind], cfg)
            )
    if scale == "full":
        run_parallel(jobs)
    else:
        for fn, *job_args in jobs:
            fn(*job_args)
    if new_assets:
        finish_assets(assets)
        (assets / "COMPLETE").write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
    if not done.is_file():
        if kind != "fast" and kind in NF4_DIRS:  # v1 Fast's files name no kind; quantize records none
            meta = root / NF4_DIRS[kind] / NF4_META
            meta.write_text(json.dumps({FC.KIND_KEY: kind, **json.loads(meta.read_text())}, indent=2))
        done.write_text(f"built in {time.perf_counter() - t0:.1f} s\n")
    return root, assets


def write_random_lora(path: Path, config, rank: int) -> Path:
    """A random rank-`rank` LoRA on every Linear of the experts, kohya-style keys (ComfyUI names)."""
    from lingbot_world.loaders.formats import meta_model
    from lingbot_world.wan.lora import lora_targets
    from safetensors.torch import save_file

    if path.is_file():
        return path
    g = torch.Generator().manual_seed(rank)
    tensors = {}
    for name, t in lora_targets(meta_model(config)).items():
        if t.kind == "linear":
            out_f, in_f = t.weight
            key = f"diffusion_model.{name}"
            tensors[f"{key}.lora_down.weight"] = torch.randn(rank, in_f, generator=g).bfloat16() * in_f**-0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(out_f, rank, generator=g).bfloat16() * 0.01
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return path


class CardPeak:
    """The card's peak used memory over a `with` block, every process on it counted (the text encoder's
    child too): total minus free, sampled on a thread."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self):
        free, total = torch.cuda.mem_get_info()
        self.peak = max(self.peak, total - free)

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Tee:
    """A text stream that also keeps what passes through it (the CLI's or argparse's `error:` line for the
    summary)."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def error(self) -> str | None:
        lines = [line for line in "".join(self.parts).splitlines() if "error:" in line]
        return lines[-1] if lines else None


class FastProbe:
    """What `lingbot.py fast` planned and did, recorded around the fast_run functions it calls: the run's
    memory prediction (the CLI's own `fast_memory` call; where the memory check refuses the run first, that
    check's first call: the run's own settings, before it tries others), the fit check's verdict (the CLI checks on CUDA only; `skip` lets the run go on where the
    planner would refuse it, to measure it anyway) and every chunk's `ChunkTiming`. `serial`: each chunk
    decoded after its DiT, never beside the next one's (the baseline of the decode worker)."""

    def __init__(self, skip: bool = False, serial: bool = False):
        self.skip, self.settings, self.need, self.fit, self.timings = skip, None, None, None, []
        self.serial, self.files, self.from_cli = serial, None, False

    @contextlib.contextmanager
    def patched(self):
        memory, fit, run_chunks = fast_run.fast_memory, fast_run.fast_fit_issue, fast_run.run_chunks
        check = fast_run.check_devices

        def fast_memory(*args, **kwargs):
            need = memory(*args, **kwargs)
            settings = inspect.signature(memory).bind(*args, **kwargs).arguments
            # the CLI's own figure for the run (its files, the overlap as decided) once it comes; until then the
            # memory check's first (the planner's view of the model, for the run's settings)
            if self.need is None or (isinstance(settings["files"], FC.FastFiles) and not self.from_cli):
                self.settings, self.need = settings, need
                self.from_cli = isinstance(settings["files"], FC.FastFiles)
            return need

        def fast_fit_issue(*args, **kwargs):
            issue = fit(*args, **kwargs)
            free = inspect.signature(fit).bind(*args, **kwargs).arguments["free_vram"]
            self.fit = {
                "free_vram_gib": gib(free),
                "issue": issue,
                "skipped": self.skip and issue is not None,
            }
            return None if self.skip else issue

        def check_devices(files, *args, **kwargs):
            self.files = files  # the CLI's FastFiles (the memory check's calls see a ChunkedModel)
            return check(files, *args, **kwargs, **({"overlap": False} if self.serial else {}))

        def chunks(session, cameras, decoder, on_chunk, *decode_on):
            def record(latent, frames, timing):
                self.timings.append(timing)
                on_chunk(latent, frames, timing)

            return run_chunks(session, cameras, decoder, record, *decode_on)

        with (
            mock.patch.object(fast_run, "fast_memory", fast_memory),
            mock.patch.object(fast_run, "fast_fit_issue", fast_fit_issue),
            mock.patch.object(fast_run, "run_chunks", chunks),
            mock.patch.object(fast_run, "check_devices", check_devices),
        ):
            yield self

    def summary(self, phases: list | None) -> dict:
        """The run's settings, the planner's prediction beside the measured peaks (allocated VRAM: what it
        predicts; host RAM: anonymous RSS), and the chunks' times and frame rates."""
        if self.settings is None:  # refused before the plan: bad input
            return {"predicted": None}
        files, config, need = self.files or self.settings["files"], self.settings["config"], self.need
        lat_f, lat_h, lat_w = self.settings["lat_shape"]
        by_phase = {p["phase"]: p for p in phases or []}

        def most(key):
            values = [p[key] for p in by_phase.values() if p.get(key) is not None]
            return max(values) if values else None

        measured = {
            "peak_vram_gib": most("peak_vram_gib"),
            "peak_reserved_gib": most("peak_reserved_gib"),  # what the cap limits
            "chunks_vram_gib": by_phase.get("chunks", {}).get("peak_vram_gib"),
            "encode_vram_gib": by_phase.get("vae_encode", {}).get("peak_vram_gib"),
            "peak_rss_anon_gib": most("peak_rss_anon_gib"),
        }
        parts = ("model", "caches", "work", "condition", "encode", "loop", "peak", "ram")
        predicted = {f"{k}_gib": gib(getattr(need, k)) for k in parts}

        def ratio(m, p):
            return None if m is None or not p else round(m / p, 3)

        steady = self.timings[1:] or self.timings  # the first chunk makes 13 frames, later ones 16
        seconds = sum(t.seconds for t in steady)  # overlapped (--decode_device): the slower of the two
        fps = sum(t.frames for t in steady) / seconds if seconds else None
        chunks_s = by_phase.get("chunks", {}).get("seconds")
        return {
            "model": files.kind.name,
            "dit": {"folder": str(files.model), "quantized": files.quantized, "bytes": files.source.nbytes},
            "latent": [lat_f, lat_h, lat_w],
            "video": f"{lat_w * 8}x{lat_h * 8}",
            "frames": (lat_f - 1) * 4 + 1,
            "chunk_frames": config.chunk_frames,
            "chunks_planned": lat_f // config.chunk_frames,
            "chunks": len(self.timings),
            "window": config.local_attn_size,
            "sink": config.sink_size,
            "shift": config.shift,
            "kv_dtype": next(k for k, v in fast_run.KV_DTYPES.items() if v == config.kv_dtype),
            "quantize": bool(self.settings["quantize"]),
            "swap_blocks": self.settings["swap"],
            "vae_tile": self.settings.get("tile"),
            "vae_dtype": self.settings.get("vae_dtype", "fp32"),  # the chunk decoder's (--vae_dtype)
            "predicted": predicted,
            "measured": measured,
            "measured_over_predicted": {
                "peak": ratio(measured["peak_vram_gib"], predicted["peak_gib"]),
                "chunks": ratio(measured["chunks_vram_gib"], predicted["loop_gib"]),
                "encode": ratio(measured["encode_vram_gib"], predicted["encode_gib"]),
                "ram": ratio(measured["peak_rss_anon_gib"], predicted["ram_gib"]),
            },
            "fit_check": self.fit,
            "chunk_timings": [
                {
                    "denoise_s": round(t.denoise_s, 4),
                    "decode_s": round(t.decode_s, 4),
                    "frames": t.frames,
                    "fps": round(t.fps, 2),
                    "kv_cache_gib": gib(t.kv_cache_bytes),
                    "overlap": t.overlap,  # decoded beside the next chunk's denoise
                }
                for t in self.timings
            ],
            # after the first chunk: the pace a viewer sees once playback starts, against the video's rate
            "steady_chunk_s": round(seconds / len(steady), 4) if steady else None,
            "steady_fps": None if fps is None else round(fps, 2),
            "playback_fps": fast_run.REAL_TIME_FPS,
            "realtime": None if fps is None else fps >= fast_run.REAL_TIME_FPS,
            # every frame over the whole chunk loop (first chunk, frame conversion and MP4 encode included)
            "loop_fps": round(sum(t.frames for t in self.timings) / chunks_s, 2) if chunks_s else None,
        }


class DiscardWriter:
    """`video.Mp4Writer` where PyAV is absent (the GPU box): frames counted, nothing encoded or written."""

    def __init__(self, path, fps: float = 16, overwrite: bool = False, crf: int = 18):
        self.path, self.frames = Path(path), 0

    def add(self, frames) -> None:
        self.frames += len(frames)

    def close(self) -> Path:
        print(f"PyAV absent: MP4 not written ({self.frames} frames)")
        return self.path

    def abort(self) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--command", choices=["generate", "fast"], default="generate")
    ap.add_argument(
        "--model", choices=list(CHUNKED_KINDS), default="v2-1.3b", help="fast: the chunked model kind"
    )
    ap.add_argument("--steps", type=int, default=4, help="4 steps at shift 10: 2 high-noise + 2 low-noise")
    ap.add_argument("--frame_num", type=int, help=f"default: generate 81, fast {FAST_FRAMES}")
    ap.add_argument("--size", default="480*832")
    ap.add_argument("--vram-cap-gib", type=float, default=24.0)
    ap.add_argument("--guide_scale", default="5", help="the CLI's --guide_scale (1 = one forward a step)")
    ap.add_argument(
        "--lora-rank", type=int, default=0, help="apply a random LoRA of this rank to both experts"
    )
    ap.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="fast: run even where the planner would refuse the run (its verdict is still recorded)",
    )
    ap.add_argument(
        "--serial-decode",
        action="store_true",
        help="fast: decode each chunk after its DiT, never beside the next one's (the decode worker's baseline)",
    )
    ap.add_argument(
        "--extra", default="", help="more CLI arguments, e.g. '--cache easycache', '--kv_dtype fp8'"
    )
    args = ap.parse_args()
    fast = args.command == "fast"
    if fast and args.lora_rank:
        raise SystemExit("--lora-rank: generate only")

    # what `lingbot.py generate` sets before CUDA's first allocation; the cap below would come first here
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cuda = torch.cuda.is_available()
    if args.scale == "full" and not cuda:
        raise SystemExit("--scale full needs a CUDA GPU")
    if args.scale == "full":
        size, frames = args.size, args.frame_num or (FAST_FRAMES if fast else 81)
    else:
        size, frames = "64*112", args.frame_num or (FAST_FRAMES if fast else 9)
    device = "cuda" if cuda else "cpu"
    mp4 = "written"
    try:
        import av  # noqa: F401
    except ImportError:  # a bare GPU box: measure everything but the MP4 encode
        mp4 = "not written: PyAV absent"
        video.write_mp4 = lambda *a, **k: print("PyAV absent: MP4 not written")
        video.Mp4Writer = DiscardWriter
    report, out = args.workdir / "phases.json", args.workdir / "out.mp4"
    report.unlink(missing_ok=True)  # a failed run writes none: never report an earlier run's
    extra = args.extra.split()
    if fast:
        ckpt, assets = build_fast_checkpoint(args.workdir, args.model, args.scale)
        paths = {"ckpt_dir": str(ckpt), "assets_dir": str(assets)}
        head = ["fast", "--ckpt_dir", str(ckpt), "--model", args.model, "--assets_dir", str(assets)]
    else:
        if args.scale == "full":
            ckpt = build_full_checkpoint(args.workdir / "ckpt")
        else:
            ckpt = demo_assets.ensure_demo_checkpoint(args.workdir)
        paths = {"ckpt_dir": str(ckpt)}
        head = ["generate", "--ckpt_dir", str(ckpt), "--sampling_steps", str(args.steps)]
        extra = ["--guide_scale", *args.guide_scale.split(), *extra]
        if args.lora_rank:
            config = checkpoints.resolve_checkpoint_dir(ckpt).config
            lora = write_random_lora(
                args.workdir / f"lora_r{args.lora_rank}.safetensors", config, args.lora_rank
            )
            extra += ["--lora", str(lora)]
    argv = [
        *head,
        "--image",
        str(EXAMPLE / "image.jpg"),
        "--prompt",
        (EXAMPLE / "prompt.txt").read_text().strip(),
        "--action_path",
        str(EXAMPLE),
        "--size",
        size,
        "--frame_num",
        str(frames),
        "--device",
        device,
        "--output",
        str(out),
        "--overwrite",
        "--report",
        str(report),
        *extra,
    ]
    if cuda:
        set_vram_cap(torch.device("cuda"), args.vram_cap_gib)
    probe = FastProbe(args.skip_fit_check, args.serial_decode) if fast else None
    stderr = Tee(sys.stderr)
    t0 = time.perf_counter()
    with (
        CardPeak() if cuda else contextlib.nullcontext() as card,
        contextlib.redirect_stderr(stderr),
        probe.patched() if fast else contextlib.nullcontext(),
    ):
        try:
            rc = cli.main(argv)
        except SystemExit as err:  # argparse refused an --extra argument
            rc = err.code
    wall = time.perf_counter() - t0
    phases = json.loads(report.read_text()) if report.is_file() else None
    summary = {
        "bench": "pipeline",
        "command": args.command,
        "scale": args.scale,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "vram_cap_gib": args.vram_cap_gib if cuda else None,
        "size": size,
        "frame_num": frames,
        **({} if fast else {"steps": args.steps}),
        **paths,
        "extra": extra,
        "rc": rc,
        "error": stderr.error(),
        "wall_s": round(wall, 2),
        "card_peak_used_gib": gib(card.peak, 2) if cuda else None,
        "mp4": mp4 if rc == 0 else None,
        "phases": phases,
        **(probe.summary(phases) if fast else {}),
    }
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
