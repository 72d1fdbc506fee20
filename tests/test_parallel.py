"""Sequence parallel (Ulysses) on the CPU with gloo: N ranks give the one-process result."""

import dataclasses

import parallel_worker as worker
import pytest
import torch
import torch.multiprocessing as mp
from helpers import check_torchrun_cli_equals_one_process, free_port, one_thread
from lingbot_world.wan.fast import kv_cache_bytes_for


@pytest.mark.parametrize("world", [2, 4])
def test_dit_forward_split_across_ranks_equals_one_process(world, tmp_path):
    expected = worker.forward(worker.tiny_model())
    mp.spawn(worker.dit_rank, args=(world, free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compiled_blocks_under_sequence_parallel_trace_the_all_to_all_and_equal_one_process(tmp_path):
    """`generate --compile --ulysses_size 2`: each block runs as one traced graph with its four all-to-alls
    inside (functional collectives, no graph break) and the forward equals the one-process one."""
    expected = worker.forward(worker.tiny_model())
    mp.spawn(worker.dit_rank, args=(2, free_port(), str(tmp_path), False, True), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["graphs"] and got["graph_breaks"] == 0
        assert all(code.count("all_to_all_single") == 4 for code in got["graphs"])
        torch.testing.assert_close(got["out"], expected, rtol=1e-5, atol=1e-5)


def test_failure_on_rank_1_stops_both_ranks(tmp_path):
    ctx = mp.spawn(worker.failing_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False)
    # Whichever rank spawn hears from first: rank 1 with its error, or rank 0 whose collective lost its peer.
    with pytest.raises(
        mp.ProcessRaisedException, match="injected failure on rank 1|Connection closed by peer"
    ):
        while not ctx.join(timeout=60):
            pass
    for p in ctx.processes:  # spawn stops the survivors; none is left hanging in a collective
        p.join(timeout=30)
        assert not p.is_alive()
    assert "injected failure on rank 1" in (tmp_path / "rank1.err").read_text()


@pytest.mark.parametrize("fail_rank", [None, 0])
def test_process_group_waits_for_every_rank_and_never_hangs_on_a_failed_one(fail_rank, tmp_path):
    """On gloo, ranks that finished wait for each other before tearing the group down; a rank that
    failed on its way out does not leave the others waiting. Every rank destroys the group."""
    import json

    mp.spawn(worker.group_rank, args=(2, free_port(), str(tmp_path), fail_rank), nprocs=2)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert not any(r["initialized"] for r in records)
    assert records[1]["status"] == "ok 2" and records[1]["seconds"] < 30
    assert records[0]["status"] == ("ok 2" if fail_rank is None else "injected failure on rank 0")


@pytest.mark.slow
@pytest.mark.usefixtures("embedding_cache")
def test_torchrun_cli_two_ranks_equals_one_process(nf4_ckpt, shipped_example, tmp_path):

    def args(name):
        return [
            "generate",
            "--ckpt_dir",
            str(nf4_ckpt),
            "--image",
            str(shipped_example / "image.jpg"),
            "--prompt",
            "a castle",
            "--action_path",
            str(shipped_example),
            "--size",
            "64*112",
            "--frame_num",
            "9",
            "--sampling_steps",
            "3",
            "--device",
            "cpu",
            "--t5_mode",
            "inprocess",
            "--output",
            str(tmp_path / f"{name}.mp4"),
            "--save_latent",
            str(tmp_path / f"{name}.latent"),
        ]

    # torchrun starts each rank with OMP_NUM_THREADS=1; the reference runs with one thread too, since on some
    # CPUs (AMX/avx512-bf16 kernels) the thread count changes bf16 matmul rounding, which 3 steps amplify
    check_torchrun_cli_equals_one_process(args, tmp_path, 9)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".mp4") == ["one.mp4", "two.mp4"]


def test_ulysses_size_is_checked_before_anything_loads():
    from lingbot_world.loaders import synthetic
    from lingbot_world.session.request import RequestError, plan_request
    from lingbot_world.wan.config import SampleConfig

    cfg = synthetic.tiny_config("cam")  # 4 heads
    with pytest.raises(RequestError, match="does not divide the experts' 4 attention heads"):
        plan_request((480, 832), cfg, SampleConfig(), max_area=480 * 832, ulysses_size=3)
    with pytest.raises(RequestError, match="this process group has 1"):
        plan_request((480, 832), cfg, SampleConfig(), max_area=480 * 832, ulysses_size=2)


@pytest.mark.slow
@pytest.mark.usefixtures("embedding_cache")
def test_ctrl_c_under_torchrun_ends_every_rank_cleanly(nf4_ckpt, shipped_example, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole foreground group: torchrun and both ranks) mid-denoise:
    every process exits within a minute, no MP4 or temporary file is left, nothing hangs in a collective."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(root / "lingbot.py"),
        "generate",
        "--ckpt_dir",
        str(nf4_ckpt),
        "--image",
        str(shipped_example / "image.jpg"),
        "--prompt",
        "a castle",
        "--action_path",
        str(shipped_example),
        "--size",
        "64*112",
        "--frame_num",
        "9",
        "--sampling_steps",
        "400",
        "--device",
        "cpu",
        "--t5_mode",
        "inprocess",
        "--output",
        str(out_dir / "clip.mp4"),
        "--parallel",
        "auto",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(64), b"")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while b"denoising" not in b"".join(err) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, b"".join(err).decode(errors="replace")[-3000:]
    assert b"denoising" in b"".join(err), "no denoising step started within 240 s"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("torchrun did not end within 60 s of Ctrl-C") from None
    reader.join(timeout=10)
    assert rc != 0
    text = b"".join(err).decode(errors="replace")
    assert "interrupted: models released, no output written" in text, text[-3000:]
    time.sleep(1)
    with pytest.raises(ProcessLookupError):  # no rank of the group is left running
        os.killpg(proc.pid, 0)
    assert list(out_dir.iterdir()) == []


# --- with the other settings: block swap, LoRAs, the step cache (compile stays refused) ---------------------


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    from lingbot_world.loaders import synthetic

    return synthetic.write_nf4_expert(tmp_path_factory.mktemp("sp") / "nf4", worker.SWAP_CFG, seed=3)


@pytest.mark.parametrize("lora", [False, True], ids=["swap", "swap+lora"])
def test_block_swap_and_lora_on_two_ranks_equal_one_process(nf4_dir, lora, tmp_path):
    """Each rank streams 3 of its 4 NF4 blocks from its own host buffer (with a LoRA on swapped and resident
    layers): the same prediction as one process with every block resident."""
    from lingbot_world.wan.lora import attach_lora

    model = worker.nf4_model(nf4_dir)
    plain = worker.swap_forward(model)
    if lora:
        attach_lora(model, worker.swap_lora(model))
    expected = worker.swap_forward(model)
    if lora:
        assert (expected - plain).abs().max() > 1e-3  # the LoRA changes the prediction
    mp.spawn(worker.swap_rank, args=(2, free_port(), str(tmp_path), str(nf4_dir), lora), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["host"] > 0 and got["live"] == 0  # swapped, and nothing left fetched after the forward
        torch.testing.assert_close(got["out"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~1.5 min of CPU: CI runs it with -m slow
def test_step_cache_with_swap_and_lora_on_two_ranks_stays_in_lockstep(nf4_dir, tmp_path):
    """EasyCache decides on the replicated latent (rank 0's decision is shared): both ranks skip the same
    steps as one process and end on its latent; block swap and a LoRA run underneath."""
    experts = worker.switcher(nf4_dir)
    try:
        expected, stats = worker.cached_denoise(experts)
    finally:
        experts.close()
    assert stats["total_skipped_forwards"] > 0 and stats["total_forwards"] > 0  # the cache did skip
    mp.spawn(worker.cached_rank, args=(2, free_port(), str(tmp_path), str(nf4_dir)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["stats"] == stats
        torch.testing.assert_close(got["latent"], expected, rtol=1e-4, atol=1e-4)


def test_settings_under_sequence_parallel_are_accepted_or_refused_by_name():
    from lingbot_world.loaders import synthetic
    from lingbot_world.session.request import RequestError, plan_request
    from lingbot_world.wan.config import SampleConfig
    from lingbot_world.wan.speed import SpeedOptions

    cfg = synthetic.tiny_config("cam")

    def plan(**kw):
        return plan_request(
            (480, 832), cfg, SampleConfig(), max_area=480 * 832, ulysses_size=2, ulysses_world=2, **kw
        )

    assert plan(swap_blocks=1).swap_blocks == 1 and plan(swap_blocks="auto").swap_blocks == "auto"
    assert plan(speed=SpeedOptions(cache="easycache")).speed.cache == "easycache"
    assert plan(speed=SpeedOptions(compile=True), swap_blocks=1).speed.compile
    with pytest.raises(RequestError, match="does not divide the experts' 4 attention heads") as err:
        plan_request((480, 832), cfg, SampleConfig(), max_area=480 * 832, ulysses_size=3, ulysses_world=3)
    assert err.value.param == "ulysses_size"


def test_step_cache_takes_the_shared_decision():
    """`agree` overrides the local decision and the cache's state follows it (a vetoed skip restarts the sum)."""
    from lingbot_world.wan.step_cache import EasyCache

    def steps(agree):
        cache = EasyCache(keep_first=0, keep_last=0)
        cache.start(6, threshold=10.0)
        x, out = torch.ones(4), []
        for i in range(6):
            x = x + 0.1
            skip = cache.should_skip(x, agree)
            out.append((skip, cache.accumulated))
            if not skip:
                cache.store("cond", x, 2 * x + i)
        return out

    local = steps(None)
    assert [s for s, _ in local] == [False, False, True, True, True, True]
    vetoed = steps(lambda skip: False)  # rank 0 said compute: every step runs, the sum restarts each time
    assert all(not s and a == 0.0 for s, a in vetoed)


@pytest.mark.parametrize(
    "kind, camera_cache",
    [("fast", False), ("v2-1.3b", False), ("fast", True)],
    ids=["fast", "v2", "fast-cams"],
)
def test_chunked_generation_split_across_ranks_equals_one_process(kind, camera_cache, tmp_path):
    """v1 Fast (3-frame chunks, tokens padded across the ranks) and v2 (4-frame chunks) with a rolling window
    and a sink: two ranks give the one-process clip, each rank's K/V cache holding half the heads (as the
    planner counts it); with the camera injections kept, each rank keeps its share of the (padded) tokens',
    against the one-process clip without them."""
    with one_thread():  # as the spawned ranks run
        expected, cache = worker.fast_generate(kind, camera_cache=camera_cache)
        if camera_cache:
            torch.testing.assert_close(expected, worker.fast_generate(kind)[0], rtol=0, atol=0)
    mp.spawn(worker.fast_rank, args=(2, free_port(), str(tmp_path), kind, False, camera_cache), nprocs=2)
    model = worker.tiny_model()
    config = dataclasses.replace(worker.fast_settings(kind), camera_cache=camera_cache)
    planned = [kv_cache_bytes_for(model.config, worker.FAST_LAT, config, torch.float32, n) for n in (1, 2)]
    assert cache == planned[0]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["latent"].shape == expected.shape and got["cache"] == planned[1] < cache
        torch.testing.assert_close(got["latent"], expected, rtol=1e-4, atol=1e-4)  # fp32: GEMM rounding


def test_compiled_chunk_loop_under_sequence_parallel_traces_the_all_to_all_and_equals_one_process(tmp_path):
    """`fast/play --compile` on 2 ranks: once the window rolls each block runs as one traced graph with the
    all-to-alls inside (functional collectives, no graph break), and the clip is the one-process eager clip."""
    with one_thread():
        expected, _ = worker.fast_generate("v2-1.3b")
    mp.spawn(worker.fast_rank, args=(2, free_port(), str(tmp_path), "v2-1.3b", True), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["graphs"] and got["graph_breaks"] == 0
        assert all(code.count("all_to_all_single") == 4 for code in got["graphs"])  # q, k, v in; output out
        torch.testing.assert_close(got["latent"], expected, rtol=1e-4, atol=1e-4)


def test_chunked_session_refuses_a_degree_that_does_not_split_the_heads():
    from lingbot_world.wan.fast import FastConfig, FastSession

    model = worker.tiny_model()  # 4 heads
    sp = object.__new__(worker.SequenceParallel)  # a 3-rank group's view, with no group to start
    sp.world, sp.rank, sp.group = 3, 0, None
    model.sequence_parallel = sp
    y, context = torch.zeros(20, *worker.FAST_LAT), torch.zeros(7, 32)
    with pytest.raises(
        ValueError, match=r"ulysses_size 3 must divide the model's 4 attention heads \(1, 2, 4\)"
    ):
        FastSession(model, context, y, worker.FAST_LAT, FastConfig(), "cpu")
