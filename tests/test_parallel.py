"""Sequence parallel (Ulysses) on the CPU with gloo: N ranks give the one-process result."""

import socket

import parallel_worker as worker
import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_dit_forward_split_across_ranks_equals_one_process(world, tmp_path):
    expected = worker.forward(worker.tiny_model())
    mp.spawn(worker.dit_rank, args=(world, free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
