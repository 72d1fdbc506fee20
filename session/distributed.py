"""The CLI's torch.distributed glue for sequence-parallel generation under `torchrun`.

`torchrun --nproc_per_node N lingbot.py generate ... --ulysses_size N` (or `--parallel auto`, which takes
N from torchrun's WORLD_SIZE) starts N copies of the CLI; `process_group` joins them (NCCL on CUDA with
one GPU per rank, cuda:LOCAL_RANK; gloo on the CPU) with a timeout, so a rank that dies cannot leave the
others waiting forever, and destroys the group on the way out, error or not. `fast` and `play` run the same
way (`play`: rank 0 sends the others each chunk's order with `broadcast_message`, see session.play).
"""

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Longest a rank waits in one collective: rank 0 encodes the text and the first frame while the others
# wait for the broadcast, so this covers a CPU text encode; a rank that exits closes its connections and
# ends the others' waits at once (gloo) or torchrun stops them (it terminates the group on any failure).
TIMEOUT = timedelta(minutes=int(os.environ.get("LINGBOT_DIST_TIMEOUT_MIN", "30")))


def requested_size(ulysses_size: int, parallel: str, command: str = "generate") -> int:
    """--ulysses_size / --parallel auto -> the number of ranks; checked against torchrun's environment (the
    launch line named is `command`'s)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "auto":
        if ulysses_size not in (1, world):
            raise ValueError(f"--parallel auto takes the world size ({world}); --ulysses_size {ulysses_size}")
        return world
    if ulysses_size < 1:
        raise ValueError(f"--ulysses_size: expected an integer >= 1, got {ulysses_size}")
    if ulysses_size > 1 and world != ulysses_size:
        raise ValueError(
            f"--ulysses_size {ulysses_size}: launch with `torchrun --nproc_per_node {ulysses_size} "
            f"lingbot.py {command} ...` (this process sees WORLD_SIZE={world})"
        )
    if ulysses_size == 1 and world > 1:
        raise ValueError(
            f"started by torchrun with {world} processes but --ulysses_size is 1: pass --ulysses_size "
            f"{world} or --parallel auto"
        )
    return ulysses_size


@contextlib.contextmanager
def process_group(size: int, device: str):
    """Join the torchrun world of `size` ranks (nothing for 1) and yield this rank's device (text, as
    --device takes it); the group is destroyed on exit."""
    if size == 1:
        yield device
        return
    kind = torch.device(device).type
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"rank with LOCAL_RANK={local} has no GPU of its own ({torch.cuda.device_count()} visible)"
            )
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=TIMEOUT, device_id=torch.device(device))
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        yield device
        if kind != "cuda":
            # gloo: a rank that tears its connections down while a peer's last work is still in flight
            # can make that peer abort at exit ("terminate called without an active exception"), so
            # ranks that finished wait for each other. A rank that failed has left already, which ends
            # this barrier with an error rather than a wait (not so with NCCL, hence gloo only).
            with contextlib.suppress(RuntimeError):
                dist.barrier()
    finally:
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class PeerLost(RuntimeError):
    """This rank waited for rank 0, which failed, was stopped or timed out (said without a traceback)."""


def broadcast_message(
    message, tensors: list[torch.Tensor] | None, device
) -> tuple[object, list[torch.Tensor]]:
    """Rank 0's `message` (small, picklable) and `tensors` on every rank (the others pass None for both), the
    tensors on `device`: one object broadcast (the message, shapes and dtypes), then one per tensor."""
    lead = rank() == 0
    meta = [(message, [(t.shape, t.dtype) for t in tensors]) if lead else None]
    device = torch.device(device)
    # this rank's GPU for the pickled object: a thread other than the one process_group set it in (the
    # play loop's) would otherwise use cuda:0 on every rank
    dist.broadcast_object_list(meta, src=0, device=device if device.type == "cuda" else None)
    message, specs = meta[0]
    out = []
    for i, (shape, dtype) in enumerate(specs):
        t = tensors[i].to(device).contiguous() if lead else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        out.append(t)
    return message, out


def broadcast_tensors(tensors: list[torch.Tensor] | None, device) -> list[torch.Tensor]:
    """Rank 0's `tensors` (others pass None) on every rank, on `device` (shapes and dtypes sent first)."""
    return broadcast_message(None, tensors, device)[1]
