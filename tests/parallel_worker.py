"""Rank bodies for tests/test_parallel.py, spawned with torch.multiprocessing (importable by name)."""

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lingbot import load_pack  # noqa: E402

load_pack()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lingbot_world.loaders import synthetic  # noqa: E402
from lingbot_world.session import distributed  # noqa: E402
from lingbot_world.wan.dit import WanModel, init_random_  # noqa: E402
from lingbot_world.wan.parallel import SequenceParallel  # noqa: E402

GRID = (3, 3, 5)  # 45 tokens: padded for world sizes 2 and 4


def grid_inputs(seed: int = 3, text_dim: int = 32):
    """(x, y, context, cam) at GRID: noise, i2v condition, 7 text tokens, a small camera tensor."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = GRID
    x = torch.randn(16, f, 2 * h, 2 * w, generator=g)
    y = torch.randn(20, f, 2 * h, 2 * w, generator=g)
    cam = 0.1 * torch.randn(1, 384, f, 2 * h, 2 * w, generator=g)
    context = torch.randn(7, text_dim, generator=g)
    return x, y, context, cam


def tiny_inputs():
    x, y, context, cam = grid_inputs()
    return x, torch.tensor([700.0]), context, y, cam


def tiny_model():
    model = init_random_(WanModel.from_config(synthetic.tiny_config("cam")), seed=5)
    model.compute_dtype = torch.float32
    return model


def forward(model):
    x, t, context, y, cam = tiny_inputs()
    with torch.no_grad():
        return model(x, t, context, y=y, cam=cam)


def peers_done():
    """Ranks that finished wait for each other before gloo is torn down, as session.distributed does: a rank
    that closes its connections while its peer's last work is in flight can abort that peer at exit
    ("terminate called without an active exception", seen in CI)."""
    with contextlib.suppress(RuntimeError):
        dist.barrier()


def dit_rank(rank, world, port, out_dir, lean=False, compile=False):
    from lingbot_world.wan import speed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_model()
        model.sequence_parallel = SequenceParallel()
        if lean:  # lean blocks on each rank's 23 local tokens, in chunks of 4 (the last one short)
            model.lean_activations, model.lean_chunk = True, 4
        graphs = []
        if compile:
            model.block_runner, graphs = traced_runner(speed.run_block)
        out = forward(model)
        if compile:
            out = {"out": out, "graphs": graphs, "graph_breaks": graph_breaks()}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        peers_done()
    finally:
        dist.destroy_process_group()


def failing_rank(rank, world, port, out_dir):
    """Rank 1's expert fails to load; rank 0 is already waiting in the first forward's collective."""
    from lingbot_world.wan import pipeline
    from lingbot_world.wan.config import SampleConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, _, context, y, cam = tiny_inputs()

    def experts(name):
        if rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return tiny_model()

    try:
        pipeline.denoise(
            experts, x, y, context, context, cam, SampleConfig(sample_steps=2), parallel=SequenceParallel()
        )
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        (Path(out_dir) / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}")
        raise
    finally:
        dist.destroy_process_group()


# --- sequence parallel with the other settings: block swap, LoRAs, the step cache ------------------------

SWAP_CFG = synthetic.tiny_config("cam", num_layers=4)  # 4 heads


def nf4_model(path):
    """The tiny NF4 expert in fp32 compute, with bitsandbytes' portable CPU kernel (as tests/test_block_swap)."""
    import bitsandbytes as bnb
    from lingbot_world.loaders.stream import load_expert

    model = load_expert(path, "cpu", compute_dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def swap_lora(model):
    """A LoRA on layers of swapped and resident blocks (attention, FFN, camera, a norm's diff)."""
    from helpers import lora_for

    return lora_for(
        model,
        ("blocks.3.self_attn.q", "blocks.2.ffn.0", "blocks.0.cross_attn.o", "blocks.1.cam_injector_layer1"),
    )


def swap_inputs():
    return grid_inputs(4, SWAP_CFG.text_dim)


def swap_forward(model):
    x, y, context, cam = swap_inputs()
    with torch.no_grad():
        return model(x, torch.tensor([700.0]), context, y=y, cam=cam)


def swap_rank(rank, world, port, out_dir, nf4_dir, lora):
    """One forward of the NF4 expert with its last 3 blocks swapped (and a LoRA attached) on each rank."""
    from lingbot_world.wan.block_swap import BlockSwapper
    from lingbot_world.wan.lora import attach_lora

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = nf4_model(nf4_dir)
        if lora:
            attach_lora(model, swap_lora(model))
        swapper = BlockSwapper(model, 3)
        model.sequence_parallel = SequenceParallel()
        out = swap_forward(model)
        torch.save(
            {"out": out, "live": len(swapper._live), "host": swapper.host_bytes},
            Path(out_dir) / f"rank{rank}.pt",
        )
        peers_done()
    finally:
        dist.destroy_process_group()


def cached_denoise(experts, parallel=None, threshold=1.0):
    """pipeline.denoise with EasyCache on: (final latent, the forwards run and skipped). With threshold 1 the
    tiny expert skips 3 of its 10 CFG steps, every decision at least 12 % away from the threshold."""
    from lingbot_world.wan import pipeline
    from lingbot_world.wan.config import SampleConfig
    from lingbot_world.wan.speed import SpeedOptions, SpeedStats

    x, y, context, cam = swap_inputs()
    speed = SpeedOptions(cache="easycache", cache_threshold=threshold, cache_keep_first=2, cache_keep_last=1)
    stats = SpeedStats()
    settings = SampleConfig(sample_steps=12, guide_scale=(3.0, 4.0))
    with torch.no_grad():
        latent = pipeline.denoise(
            experts, x, y, context, 0.5 * context, cam, settings, speed=speed, stats=stats, parallel=parallel
        )
    return latent, stats.as_dict()


def switcher(nf4_dir):
    """Both experts from the same NF4 folder, 3 blocks swapped, the LoRA on the high-noise one."""
    from lingbot_world.loaders.experts import ExpertSwitcher

    lora = swap_lora(nf4_model(nf4_dir))
    return ExpertSwitcher({"high": nf4_dir, "low": nf4_dir}, "cpu", swap_blocks=3, loras={"high": [lora]})


def cached_rank(rank, world, port, out_dir, nf4_dir):
    """The step cache with block swap and a LoRA under sequence parallel: the whole sampling loop."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        experts = switcher(nf4_dir)
        try:
            latent, stats = cached_denoise(experts, SequenceParallel())
        finally:
            experts.close()
        torch.save({"latent": latent, "stats": stats}, Path(out_dir) / f"rank{rank}.pt")
        peers_done()
    finally:
        dist.destroy_process_group()


def torchrun_env(rank, world, port) -> None:
    """The environment torchrun gives a rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )


def group_rank(rank, world, port, out_dir, fail_rank=None):
    """Inside `session.distributed.process_group` as torchrun would start it: one all-reduce, then rank
    `fail_rank` raises on its way out while the others finish. Each rank records how it left."""
    torchrun_env(rank, world, port)
    t0 = time.monotonic()
    try:
        with distributed.process_group(world, "cpu"):
            total = torch.ones(1)
            dist.all_reduce(total)
            if rank == fail_rank:
                raise RuntimeError(f"injected failure on rank {rank}")
    except RuntimeError as err:
        status = str(err)
    else:
        status = f"ok {total.item():g}"
    record = {"status": status, "initialized": dist.is_initialized(), "seconds": time.monotonic() - t0}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))


# --- chunked generation (v1 Fast, v2) under sequence parallel -------------------------------------------

FAST_LAT = (
    12,
    6,
    10,
)  # 15 tokens a frame: a 3-frame chunk's 45 tokens pad for 2 ranks, a 4-frame one's 60 do not


def fast_settings(kind: str):
    """The kind's chunk, steps and shift with a window that rolls within the 12 latent frames (v1 Fast: 4
    chunks, v2: 3), and a camera."""
    from lingbot_world.wan.config import CHUNKED_KINDS
    from lingbot_world.wan.fast import FastConfig

    chunk = CHUNKED_KINDS[kind].chunk_frames
    return FastConfig.for_kind(CHUNKED_KINDS[kind], seed=7, local_attn_size=2 * chunk + 1, sink_size=1)


def fast_generate(kind: str, compile: bool = False, camera_cache: bool = False):
    """The tiny cam model's whole chunked clip: (latent, the caches' bytes on this rank)."""
    from lingbot_world.wan.fast import FastSession

    model = tiny_model()
    config = dataclasses.replace(fast_settings(kind), compile=compile, camera_cache=camera_cache)
    g = torch.Generator().manual_seed(8)
    y = torch.randn(20, *FAST_LAT, generator=g)
    context = torch.randn(7, 32, generator=g)
    cam = 0.1 * torch.randn(1, 384, *FAST_LAT, generator=g)
    model.sequence_parallel = SequenceParallel() if dist.is_initialized() else None
    session = FastSession(model, context, y, FAST_LAT, config, "cpu")
    chunk, cache = config.chunk_frames, None
    for k in range(session.num_chunks):
        session.next_chunk(cam[:, :, k * chunk : (k + 1) * chunk])
        cache = cache or session.kv_cache_bytes()  # after the first chunk: the text keys are in it too
    return session.latent(), cache


def traced_runner(fn):
    """A compiled block runner of `fn` with a backend that runs each traced graph as is: (runner, the graphs'
    code)."""
    from lingbot_world.wan import speed

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return speed.CompiledBlocks(backend=backend, fn=fn), graphs


def traced_chunk_blocks():
    """The chunk loop's shared compiled runner as `traced_runner`'s; returns the graphs' code."""
    from lingbot_world.wan import speed

    speed.compiler_missing = lambda device: None
    speed._shared_runners[speed.run_chunk_block], graphs = traced_runner(speed.run_chunk_block)
    return graphs


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def fast_rank(rank, world, port, out_dir, kind, compile=False, camera_cache=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        graphs = traced_chunk_blocks() if compile else []
        latent, cache = fast_generate(kind, compile, camera_cache)
        out = {"latent": latent, "cache": cache, "graphs": graphs, "graph_breaks": graph_breaks()}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        peers_done()
    finally:
        dist.destroy_process_group()


# --- live play under sequence parallel --------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@contextlib.contextmanager
def recorded_chunks():
    """The clean latent of every chunk a FastSession makes in the block (on this rank), in order."""
    from lingbot_world.wan.fast import FastSession

    made, real = [], FastSession.next_chunk

    def next_chunk(self, cam=None, on_latent=None):
        out = real(self, cam, on_latent)
        made.append(out.clone())
        return out

    FastSession.next_chunk = next_chunk
    try:
        yield made
    finally:
        FastSession.next_chunk = real


def play_session(ckpt, device, ranks, clock, frames):
    from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
    from lingbot_world.session import play

    files = resolve_fast_dir(Path(ckpt))
    session = play.PlaySession(
        files,
        device,
        area=64 * 112,
        t5_mode="inprocess",
        condition_frames=4,
        clock=clock,
        on_frame=frames.append,
        ranks=ranks,
    )
    load = session._load_dit

    def load_fp32():  # fp32 compute: ranks and one process agree to GEMM rounding (bf16 would hide a bug)
        dit = load().float()
        dit.compute_dtype = torch.float32
        return dit

    session._load_dit = load_fp32
    return session


def scripted_play(session, clock, image) -> None:
    """3 chunks: W in the first, a right turn and a new prompt in the second, a restart (a new rollout, its own
    seed) with D held in the third; under sequence parallel rank 0 also idles once (a keep-alive)."""
    session.start(image, "a castle")
    session.idle()
    session.key("KeyW", True, 0.6)
    clock.t = 1.0
    session.step()
    session.key("KeyW", False, 1.2)
    session.key("ArrowRight", True, 1.2)
    session.set_prompt("a castle at night")
    clock.t = 2.0
    session.step()
    session.key("ArrowRight", False, 2.5)
    session.key("KeyD", True, 2.6)
    session.restart()
    clock.t = 3.0
    session.step()


def play_record(session, frames, made) -> dict:
    return {
        "latents": made,
        "poses": [f.pose for f in frames],
        "images": torch.stack([f.image for f in frames]) if frames else None,
        "frames": [(f.index, f.rollout, f.latent) for f in frames],
        "chunks": session.chunks,
        "rollouts": session.rollouts,
        "closed": session.closed and session._dit is None and session._session is None,
    }


def play_rank(rank, world, port, out_dir, ckpt, image_path, die_after=None):
    """One rank of a sequence-parallel play inside `distributed.process_group`, as torchrun starts it: rank 0
    plays the script (or, with `die_after`, leaves without a word after that many chunks) and closes; the
    others follow. Each rank saves what it made, or the error that ended it."""
    from lingbot_world import cli
    from lingbot_world.session import play

    torchrun_env(rank, world, port)
    cli.import_runtime()
    play.KEEPALIVE_S = 0.0  # idle() sends one at once
    clock, frames = Clock(), []
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        with distributed.process_group(world, "cpu") as device, recorded_chunks() as made:
            session = play_session(ckpt, device, world, clock, frames)
            if rank:
                session.follow()
            elif die_after is None:
                try:
                    scripted_play(session, clock, cli.load_image(Path(image_path)))
                finally:
                    session.close()
            else:
                session.start(cli.load_image(Path(image_path)), "a castle")
                for _ in range(die_after):
                    clock.t += 1.0
                    session.step()
                torch.save({"chunks": session.chunks}, out)
                os._exit(0)  # no stop, no goodbye
            torch.save(play_record(session, frames, made), out)
    except distributed.PeerLost as err:
        torch.save({"error": str(err), "chunks": session.chunks, "closed": session._dit is None}, out)
