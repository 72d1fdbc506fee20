"""Rank bodies for tests/test_parallel.py, spawned with torch.multiprocessing (importable by name)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lingbot import load_pack  # noqa: E402

load_pack()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lingbot_world.loaders import synthetic  # noqa: E402
from lingbot_world.wan.dit import WanModel, init_random_  # noqa: E402
from lingbot_world.wan.parallel import SequenceParallel  # noqa: E402

GRID = (3, 3, 5)  # 45 tokens: padded for world sizes 2 and 4


def tiny_inputs():
    g = torch.Generator().manual_seed(3)
    f, h, w = GRID
    x = torch.randn(16, f, 2 * h, 2 * w, generator=g)
    y = torch.randn(20, f, 2 * h, 2 * w, generator=g)
    cam = 0.1 * torch.randn(1, 384, f, 2 * h, 2 * w, generator=g)
    context = torch.randn(7, 32, generator=g)
    return x, torch.tensor([700.0]), context, y, cam


def tiny_model():
    model = init_random_(WanModel.from_config(synthetic.tiny_config("cam")), seed=5)
    model.compute_dtype = torch.float32
    return model


def forward(model):
    x, t, context, y, cam = tiny_inputs()
    with torch.no_grad():
        return model(x, t, context, y=y, cam=cam)


def dit_rank(rank, world, port, out_dir, lean=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_model()
        model.sequence_parallel = SequenceParallel()
        if lean:  # lean blocks on each rank's 23 local tokens, in chunks of 4 (the last one short)
            model.lean_activations, model.lean_chunk = True, 4
        torch.save(forward(model), Path(out_dir) / f"rank{rank}.pt")
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
        pipeline.denoise(experts, x, y, context, context, cam, SampleConfig(sample_steps=2),
                         parallel=SequenceParallel())  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        (Path(out_dir) / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}")
        raise
    finally:
        dist.destroy_process_group()
