"""Benchmark: live play (session.play + the standalone server) driven by a scripted client, no display.

Builds (once, under --workdir) a random checkpoint of --model at full size as `bench_pipeline --command fast`
does (v2 1.3B as released, v2 14B / v1 Fast as NF4 folders, a random umT5-XXL, tokenizer and Wan2.1 VAE),
serves a `PlaySession` with `session.play_server.PlayServer` on 127.0.0.1 and connects a scripted WebSocket
client that plays --chunks chunks: it walks forward, turns right, strafes, looks with the mouse and runs,
changing keys every --key-period seconds on average (each gap 1 +- --key-jitter times it, seeded, so a key's
time within its chunk is spread as a player's is; the script repeats until the last chunk), and receives every
JPEG frame. Reported (one JSON line at the end):
- fps_played: new frames / wall time after the first chunk (the session's figure; `client_fps` is the same
  counted by the client from frame arrival),
- s_per_chunk (after the first chunk) and each chunk's seconds (with the decode overlapping the next chunk,
  `--decode_device` or `--overlap`: the slower of the DiT and the decode), decode_s_per_chunk (the decode's),
- key_to_pixel p50/p95 (session: from the key event's arrival at the server to the hand-out of the first
  frame of the latent frame it landed in; `read_to_frame` p50/p95: per chunk, from its input's read to the
  hand-out of the first frame a key can land in, so that in hold mode key->pixel is the key's wait for the next
  read plus this; `client_key_to_frame` p50/p95: from sending the key to receiving
  the first frame whose pose moved the way the key asks, which includes the chunk the key waited for and,
  paced, the pacer's wait; a walk still in flight from the key before can answer a strafe there, so this client
  figure can read low when keys come faster than a chunk),
- steady state past a rollout's start (`rollout_start_chunks`: the chunks before its attention window is full
  and the first that rolls it, which run apart from the steady compiled graph; a rollout lasts 256 chunks):
  `steady_client_fps` (frames / wall time at the client from there on) and `steady_s_per_chunk`,
- peak VRAM (and the decode device's, `decode_peak_vram_gib`).
The server paces the frames (session.pacer; `--no_pace` sends each as it is made), so the figures as shown
are reported too: `shown_fps` (frames / wall time at the pace they were sent, after the warm-up),
`shown_key_to_pixel` p50/p95 (from the key's arrival to the show time of that first frame), the gaps between
shown frames (`shown_gap_*`; `client_gap_*` the same at the client, from the third chunk on: the pacer learns
the rate from the second) and the wait the pacer added (`pace_delay_*`). The figures above (`fps_played`,
`key_to_pixel_*`) stay the hand-out ones.

    python benchmarks/bench_play.py --scale full --workdir /tmp/bench_play --model v2-1.3b   # 464x832, 18/6
    python benchmarks/bench_play.py --scale full --workdir /tmp/bench_play --model v2-14b
    python benchmarks/bench_play.py --scale full --workdir /tmp/bench_play --model fast
    python benchmarks/bench_play.py --scale tiny --workdir /tmp/bench_play_tiny               # CPU check
    python benchmarks/bench_play.py ... --no_pace                              # frames as they are made
    python benchmarks/bench_play.py ... --decode_device cuda:1        # the decode on a second GPU, overlapped
    python benchmarks/bench_play.py ... --overlap off                 # one GPU, the decode after the DiT
    python benchmarks/bench_play.py ... --camera_cache off            # each forward makes its camera injection

Sequence parallel (one host, N GPUs; rank 0 builds the checkpoint while the others wait, then serves, drives
the scripted client and prints the JSON, with each rank's peak VRAM; the others follow its chunks):

    torchrun --nproc_per_node 4 benchmarks/bench_play.py --scale full --workdir /tmp/bench_play --model v2-14b \
        --ulysses_size 4 --t5_cpu --vae_dtype fp16
    torchrun --nproc_per_node 2 benchmarks/bench_play.py --scale tiny --workdir /tmp/bench_play_tiny \
        --ulysses_size 2                                                        # CPU check (gloo)
"""

import argparse
import asyncio
import itertools
import json
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from bench_pipeline import build_fast_checkpoint  # noqa: E402

from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir  # noqa: E402
from lingbot_world.session import distributed, play, play_server  # noqa: E402
from lingbot_world.wan import attention  # noqa: E402
from lingbot_world.wan.parallel import heads_issue  # noqa: E402

# (seconds into the script, message): walk, turn, strafe, mouse look, run
SCRIPT = [
    {"type": "key", "key": "KeyW", "down": True},
    {"type": "key", "key": "ArrowRight", "down": True},
    {"type": "key", "key": "ArrowRight", "down": False},
    {"type": "key", "key": "KeyW", "down": False},
    {"type": "key", "key": "KeyD", "down": True},
    {"type": "key", "key": "KeyD", "down": False},
    {"type": "look", "dx": 80, "dy": 0},
    {"type": "key", "key": "ShiftLeft", "down": True},
    {"type": "key", "key": "KeyW", "down": True},
    {"type": "key", "key": "KeyW", "down": False},
    {"type": "key", "key": "ShiftLeft", "down": False},
]


def moved(before: np.ndarray, after: np.ndarray, msg: dict) -> bool:
    """Whether the pose change from `before` to `after` (c2w [3, 4]) is what `msg` asks for."""
    if msg["type"] == "look" or msg["key"] == "ArrowRight":
        yaw = lambda p: np.arctan2(p[0, 2], p[2, 2])  # noqa: E731
        return abs(yaw(after) - yaw(before)) > 1e-4
    if msg["key"] in ("KeyW", "KeyD"):
        return float(np.linalg.norm(after[:, 3] - before[:, 3])) > 1e-4
    return False


def key_gaps(period: float, jitter: float, seed: int = 0):
    """Seconds between the script's keys, endless: each `period` x (1 +- up to `jitter`), seeded. Spread gaps put a
    key anywhere in the chunk it lands in, as a player's keys would be; `jitter` 0 gives the period exactly."""
    rng = random.Random(seed)
    while True:
        yield period * rng.uniform(1 - jitter, 1 + jitter)


async def client(url: str, chunks_frames: int, key_period: float, jitter: float = 0.5) -> dict:
    import aiohttp

    arrivals, pose_log, sent, latencies = [], [], [], []
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url + "ws", max_msg_size=1 << 26)
        hello = json.loads((await ws.receive(timeout=3600)).data)
        script = itertools.cycle(SCRIPT)  # it ends with every key up, so it repeats as it starts
        gaps = key_gaps(key_period, jitter)
        next_key = None
        while len(arrivals) < chunks_frames:
            msg = await ws.receive(timeout=3600)
            if msg.type == aiohttp.WSMsgType.TEXT:
                data = json.loads(msg.data)
                if data["type"] == "error":
                    raise RuntimeError(data["message"])
                continue
            if msg.type != aiohttp.WSMsgType.BINARY:
                raise RuntimeError(f"the socket ended after {len(arrivals)} frames")
            now = time.perf_counter()
            index, rollout, latent, pose, _ = play_server.parse_frame_message(msg.data)
            arrivals.append(now)
            pose_log.append(pose)
            for item in sent:  # the first frame that moved as the key asked, after the key was sent
                if item["frame"] is None and len(pose_log) > 1 and moved(pose_log[-2], pose, item["msg"]):
                    if index > item["after_index"]:
                        item["frame"] = index
                        latencies.append(now - item["t"])
            if next_key is None:
                next_key = now + next(gaps)
            if now >= next_key:
                key = next(script)
                await ws.send_str(json.dumps(key))
                if key["type"] == "look" or key.get("down"):
                    sent.append({"msg": key, "t": time.perf_counter(), "after_index": index, "frame": None})
                next_key = now + next(gaps)
        await ws.close()
    return {"role": hello["role"], "arrivals": arrivals, "latencies": latencies}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--workdir", type=Path, required=True, help="where the random checkpoint is written once")
    ap.add_argument("--model", choices=["v2-1.3b", "v2-14b", "fast"], default="v2-1.3b")
    ap.add_argument(
        "--ulysses_size", type=int, default=1, help="sequence parallel over N GPUs (under torchrun, N ranks)"
    )
    ap.add_argument("--chunks", type=int, default=None, help="chunks to play (full: 24; tiny: 4)")
    ap.add_argument("--size", default=None, help="H*W pixel area (full: 480*832 -> 464x832; tiny: 64*112)")
    ap.add_argument("--local_attn_size", type=int, default=18)
    ap.add_argument("--sink_size", type=int, default=6)
    ap.add_argument("--mode", choices=["history", "hold"], default="history")
    ap.add_argument("--key-period", type=float, default=None, help="mean seconds between script keys")
    ap.add_argument(
        "--key-jitter",
        type=float,
        default=0.5,
        help="each gap between keys is the period times 1 +- up to this (seeded); 0: the period exactly",
    )
    ap.add_argument("--kv_dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--vae_dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="the play decoder")
    ap.add_argument("--t5_cpu", action="store_true", help="encode the prompt on the CPU")
    ap.add_argument("--no_pace", action="store_true", help="send each frame as it is made (no pacer)")
    ap.add_argument(
        "--fp8",
        nargs="?",
        const="exact",
        choices=["exact", "fast"],
        help="the DiT blocks' Linears in fp8 (quantized while loading); 'fast': their fast accumulation",
    )
    ap.add_argument("--compile", action="store_true", help="compile the DiT's chunk forward")
    ap.add_argument(
        "--attention",
        choices=attention.BUILT_IN,
        default="sdpa",
        help="the DiT's attention (fp8: cuDNN's; fa3 / fa3_fp8: FlashAttention-3's)",
    )
    ap.add_argument("--decode_device", help="the VAE's device, e.g. cuda:1 (default: the DiT's)")
    ap.add_argument(
        "--camera_cache",
        choices=["auto", "on", "off"],
        default="auto",
        help="each block's camera injection kept for a chunk's forwards (auto: where the memory plan fits it)",
    )
    ap.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="the decode beside the next chunk's DiT on one device (auto: where the memory plan fits both)",
    )
    args = ap.parse_args()
    full = args.scale == "full"
    if full and not torch.cuda.is_available():
        raise SystemExit("--scale full needs a CUDA GPU")
    if not 0 <= args.key_jitter < 1:
        raise SystemExit(f"--key-jitter: expected 0 <= J < 1, got {args.key_jitter}")
    if args.key_period is not None and args.key_period <= 0:
        raise SystemExit(f"--key-period: expected seconds > 0, got {args.key_period}")
    try:
        ranks = distributed.requested_size(args.ulysses_size, "none")
    except ValueError as err:
        raise SystemExit(str(err)) from None
    with distributed.process_group(ranks, "cuda" if full else "cpu") as device:
        return bench(args, torch.device(device), ranks)


def peak_vram_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def bench(args, device: torch.device, ranks: int) -> int:
    full, lead = args.scale == "full", distributed.rank() == 0
    chunks = args.chunks or (24 if full else 4)
    h, w = (480, 832) if full else (64, 112)
    if args.size:
        h, w = (int(v) for v in args.size.split("*"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    if ranks > 1 and not lead:
        dist.barrier()  # rank 0 builds the checkpoint first
    ckpt, assets = build_fast_checkpoint(args.workdir, args.model, args.scale)
    if ranks > 1 and lead:
        dist.barrier()
    files = resolve_fast_dir(ckpt, args.model, assets)
    if issue := heads_issue(ranks, files.config.num_heads):
        raise SystemExit(f"--{issue}")
    session = play.PlaySession(
        files,
        device,
        local_attn_size=args.local_attn_size,
        sink_size=args.sink_size,
        kv_dtype=args.kv_dtype,
        vae_dtype=args.vae_dtype,
        area=h * w,
        mode=args.mode,
        t5_mode="subprocess" if full else "inprocess",
        t5_device="cpu" if args.t5_cpu else None,
        condition_frames=play.CONDITION_FRAMES if full else 4,
        compile=args.compile,
        attention=args.attention,
        quantize="fp8" if args.fp8 else None,
        fp8_accum=args.fp8 or "exact",
        decode_device=args.decode_device,
        overlap={"on": True, "off": False}.get(args.overlap),
        camera_cache={"on": True, "off": False}.get(args.camera_cache, "auto"),
        ranks=ranks,
    )
    if device.type == "cuda":
        torch.cuda.init()  # before reading a card's counters
        torch.cuda.reset_peak_memory_stats(device)
    peaks = [None] * ranks
    if not lead:  # the DiT's share of every chunk, until rank 0's session ends
        session.follow()
        dist.all_gather_object(peaks, peak_vram_gib(device))
        return 0
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, h, w, generator=g) * 2 - 1
    server = play_server.PlayServer(
        session, image, "a sunny street with old houses", "127.0.0.1", 0, pace=not args.no_pace
    )
    result = {}

    def serve():
        try:
            result["stats"] = server.serve()
        except BaseException as err:
            result["error"] = err

    for d in {device, session.decode_device}:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
    t0 = time.perf_counter()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    play_server.wait_port(server)
    chunk = files.kind.chunk_frames
    frames = (chunk - 1) * 4 + 1 + (chunks - 1) * chunk * 4
    key_period = args.key_period or (1.0 if full else 0.5)
    seen = asyncio.run(client(server.url, frames, key_period, args.key_jitter))
    thread.join(600)
    peaks[0] = peak_vram_gib(device)
    if ranks > 1:
        dist.all_gather_object(peaks, peaks[0])
    if "error" in result:
        raise result["error"]
    stats = result["stats"]
    arrivals = seen["arrivals"]
    first_chunk = (chunk - 1) * 4 + 1
    steady = arrivals[first_chunk - 1 :]
    client_fps = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else None
    gaps = np.diff(arrivals[first_chunk + chunk * 4 :])  # from the third chunk on
    # a rollout's start: the chunks before its window is full and the first that rolls it (their key sets grow,
    # so they run apart from the steady graph); a rollout is 256 chunks, so play is mostly past them
    start = session.config.roll_chunks
    later = arrivals[first_chunk + (start - 1) * chunk * 4 - 1 :]
    steady_fps = (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 else None
    steady_chunks = session.chunk_seconds[start:]
    lat = seen["latencies"]
    summary = {
        "bench": "play",
        "scale": args.scale,
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": list(session.size[2:]),
        "window": [session.config.local_attn_size, session.config.sink_size],
        "kv_dtype": args.kv_dtype,
        "vae_dtype": args.vae_dtype,
        "mode": args.mode,
        "compile": args.compile,
        "fp8": args.fp8,
        "attention": args.attention,
        "decode_device": str(session.decode_device),
        "overlap": session.overlap,
        "camera_cache": session.config.camera_cache,
        "chunks": stats["chunks"],
        "frames_received": len(arrivals),
        "fps_played": stats["fps_played"],
        "client_fps": client_fps,
        "s_per_chunk": stats["s_per_chunk"],
        "rollout_start_chunks": start,
        "steady_client_fps": steady_fps,
        "steady_s_per_chunk": float(np.mean(steady_chunks)) if steady_chunks else None,
        "chunk_s": [round(v, 4) for v in session.chunk_seconds],
        "decode_s_per_chunk": stats["decode_s_per_chunk"],
        "decode_s": [round(v, 4) for v in session.decode_seconds],
        "key_to_pixel_p50_s": stats["key_to_pixel_p50_s"],
        "key_to_pixel_p95_s": stats["key_to_pixel_p95_s"],
        "key_events_measured": stats["key_events_measured"],
        "key_period_s": key_period,
        "key_jitter": args.key_jitter,
        "read_to_frame_p50_s": stats["read_to_frame_p50_s"],
        "read_to_frame_p95_s": stats["read_to_frame_p95_s"],
        "client_key_to_frame_p50_s": play.percentile(lat, 50),
        "client_key_to_frame_p95_s": play.percentile(lat, 95),
        "client_keys_seen": len(lat),
        "paced": stats["paced"],
        "pace_interval_s": stats["pace_interval_s"],
        "shown_fps": stats["shown_fps"],
        "shown_key_to_pixel_p50_s": stats["shown_key_to_pixel_p50_s"],
        "shown_key_to_pixel_p95_s": stats["shown_key_to_pixel_p95_s"],
        "shown_keys_measured": stats["shown_keys_measured"],
        "shown_gap_p50_s": stats["shown_gap_p50_s"],
        "shown_gap_p95_s": stats["shown_gap_p95_s"],
        "shown_gap_max_s": stats["shown_gap_max_s"],
        "pace_delay_p50_s": stats["pace_delay_p50_s"],
        "pace_delay_max_s": stats["pace_delay_max_s"],
        "client_gap_p50_s": play.percentile(gaps, 50),
        "client_gap_p95_s": play.percentile(gaps, 95),
        "client_gap_max_s": float(gaps.max()) if len(gaps) else None,
        "peak_vram_gib": peaks[0],
        "ulysses_size": ranks,
        "peak_vram_gib_per_rank": peaks,
        "decode_peak_vram_gib": (stats["vram"] or {}).get("decode_peak_gib"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
