"""Live play's session (session.play) on the tiny Fast checkpoint: headless, a scripted clock and keys."""

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
from lingbot_world.session import play
from lingbot_world.session.controls import MOVE_STEP, PoseTrack, Slot
from lingbot_world.wan.fast import FastSession


class Clock:
    def __init__(self):
        self.t = 0.0
        self._lock = threading.Lock()

    def __call__(self):
        return self.t

    def advance(self, seconds: float) -> None:
        """From any thread (the decode worker's too)."""
        with self._lock:
            self.t += seconds


def make_session(fast_ckpt, frames, clock, **kw):
    files = resolve_fast_dir(fast_ckpt)
    return play.PlaySession(
        files,
        "cpu",
        area=64 * 112,
        t5_mode="inprocess",
        condition_frames=4,
        clock=clock,
        on_frame=frames.append,
        **kw,
    )


@pytest.fixture
def image(shipped_example):
    return cli.load_image(shipped_example / "image.jpg")


def test_play_three_chunks_follows_the_keys(fast_ckpt, image, monkeypatch):
    """v1 Fast (3 latent frames a chunk), history mode: W pressed in the second half of the first window moves
    only in latent frame 2; a right turn from the start of the next window turns all of chunk 1; released in
    the last third of chunk 2's window: chunk 2 turns twice, then stands."""
    encoded = []
    real_encode = play.text_encode.encode_prompts

    def encode(path, prompts, **kw):
        encoded.append(prompts[0])
        return real_encode(path, prompts, **kw)

    monkeypatch.setattr(play.text_encode, "encode_prompts", encode)
    clock, frames = Clock(), []
    session = make_session(fast_ckpt, frames, clock)
    try:
        session.start(image, "a castle")
        assert (
            session.config.local_attn_size == play.PLAY_WINDOW[0]
        )  # v1 Fast's unbounded cache gets a window
        session.key("KeyW", True, 0.6)
        session.key("KeyX", True, 0.7)  # ignored
        clock.t = 1.0
        assert session.step() == 9  # 1 + 4 + 4 frames
        session.key("KeyW", False, 1.2)
        session.key("ArrowRight", True, 1.2)
        clock.t = 2.0
        assert session.step() == 12
        session.key("ArrowRight", False, 2.9)
        session.set_prompt("a castle at night")
        clock.t = 3.0
        assert session.step() == 12
        assert encoded == ["a castle", "a castle at night"]

        want = PoseTrack()
        w, right, none = Slot(frozenset({"w"})), Slot(frozenset({"right"})), Slot()
        want.advance([none, w])
        want.advance([right] * 3)
        want.advance([right, right, none])
        assert np.array_equal(np.stack(session.poses), np.stack(want.poses))
        np.testing.assert_allclose(session.poses[2][:3, 3], [0, 0, 4 * MOVE_STEP], atol=1e-6)
        assert np.array_equal(session.poses[8], session.poses[7])  # the last latent frame stands still
        assert not np.allclose(session.poses[7][:3, :3], session.poses[2][:3, :3])  # it turned

        assert [f.index for f in frames] == list(range(33))
        assert [f.latent for f in frames] == [0] + [i for i in range(1, 9) for _ in range(4)]
        h, w = session.size[2:]
        assert all(f.image.shape == (h, w, 3) and f.image.dtype == torch.uint8 for f in frames)
        assert all(np.array_equal(f.pose, session.poses[f.latent]) for f in frames)
        stats = session.stats()
        assert stats["frames"] == 33 and stats["chunks"] == 3 and stats["rollouts"] == 1
        # 4 key edges landed (W down, W up, right down, right up); the ignored key is not one of them
        assert stats["key_events_measured"] == 4
        # each edge rides with the first frame of its latent frame (a pacing front end measures to its show)
        keyed = [f for f in frames if f.keys]
        assert sum(len(f.keys) for f in keyed) == 4 and frames[5].keys == (0.6,)  # W: latent frame 2
        assert all(f.index == min(g.index for g in frames if g.latent == f.latent) for f in keyed)
        assert session._model.loads == 1
    finally:
        session.close()
    assert session._session is None and session._model is None


def test_play_restarts_without_reloading(fast_ckpt, image, monkeypatch):
    """R and the end of the RoPE table both start a new rollout from the image: identity pose, 1 frame for its
    first latent frame, indices continuing; the model is loaded once."""
    monkeypatch.setattr(play, "rollout_latent_frames", lambda chunk: 2 * chunk)  # 2 chunks a rollout
    clock, frames = Clock(), []
    session = make_session(fast_ckpt, frames, clock, mode="hold")
    try:
        session.start(image, "a castle")
        session.key("d", True, 0.5)
        counts = []
        for t in (1.0, 2.0, 3.0):  # the third chunk is past the 2-chunk rollout: a new one
            clock.t = t
            counts.append(session.step())
        session.restart()
        clock.t = 4.0
        counts.append(session.step())
        assert counts == [9, 12, 9, 9]
        assert session.rollouts == 3 and session._model.loads == 1
        assert [f.index for f in frames] == list(range(39))
        firsts = [f for f in frames if f.latent == 0]
        assert [f.index for f in firsts] == [0, 21, 30] and [f.rollout for f in firsts] == [0, 1, 2]
        assert all(np.array_equal(f.pose, np.eye(4)) for f in firsts)
        # hold mode: D held from the first latent frame of each rollout's first chunk
        np.testing.assert_allclose(session.poses[1][:3, 3], [4 * MOVE_STEP, 0, 0], atol=1e-6)
    finally:
        session.close()


def test_play_refuses_an_unbounded_cache(fast_ckpt):
    with pytest.raises(ValueError, match="local_attn_size: play runs without end"):
        make_session(fast_ckpt, [], Clock(), local_attn_size=-1)


def play_script(fast_ckpt, image, **kw):
    """Three chunks with keys, a restart before the third: (frames, step() counts, session)."""
    clock, frames = Clock(), []
    session = make_session(fast_ckpt, frames, clock, **kw)
    counts = []
    try:
        session.start(image, "a castle")
        session.key("KeyW", True, 0.6)
        clock.t = 1.0
        counts.append(session.step())
        session.key("KeyW", False, 1.2)
        session.key("ArrowRight", True, 1.2)
        clock.t = 2.0
        counts.append(session.step())
        session.restart()  # while chunk 1 may still be in the decoder
        session.key("ArrowRight", False, 2.5)
        clock.t = 3.0
        counts.append(session.step())
        session.flush()
    finally:
        session.close()
    return frames, counts, session


def decode_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "lingbot-decode" and t.is_alive()]


def test_play_decode_worker_hands_out_the_serial_frames(fast_ckpt, image):
    """The decode overlapping the next chunk (`overlap`) hands out exactly the frames, indices, poses and key
    stamps of the synchronous hand-off, a restart included; step() then counts the previous chunk's frames."""
    serial, serial_counts, _ = play_script(fast_ckpt, image, overlap=False)
    frames, counts, session = play_script(fast_ckpt, image, overlap=True)
    assert serial_counts == [9, 12, 9] and counts == [0, 9, 12]
    assert len(frames) == len(serial) == 30 and [f.index for f in frames] == list(range(30))
    assert [f.rollout for f in frames] == [0] * 21 + [1] * 9
    for a, b in zip(frames, serial, strict=True):
        assert (a.index, a.rollout, a.latent, a.keys) == (b.index, b.rollout, b.latent, b.keys)
        assert torch.equal(a.image, b.image) and np.array_equal(a.pose, b.pose)
    assert sum(len(f.keys) for f in frames) == 4  # W down/up, right down/up
    assert len(session.decode_seconds) == 3 and session.stats()["decode_s_per_chunk"] is not None
    assert session.closed and not decode_threads()


def test_play_decode_worker_backpressure_errors_and_close(fast_ckpt, image):
    """The DiT runs at most one chunk ahead of the decoder; an exception in the decode (here the frame callback)
    stops `run()` in the caller; close() leaves no decode thread."""
    gate, seen = threading.Event(), []

    def on_frame(frame):
        gate.wait()
        if frame.index == 10:
            raise RuntimeError("boom in the decode")
        seen.append(frame.index)

    session = make_session(fast_ckpt, [], Clock(), overlap=True)
    session.on_frame = on_frame
    try:
        session.start(image, "a castle")
        assert session.step() == 0  # chunk 0 is in the decoder, held at its first frame
        errors = []

        def play():
            try:
                session.run(threading.Event())
            except RuntimeError as err:
                errors.append(err)

        player = threading.Thread(target=play)
        player.start()
        deadline = time.monotonic() + 600
        while session.rollout_chunk < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # chunk 1's DiT ran beside chunk 0's decode; its hand-over waits for the decoder
        assert session.rollout_chunk == 2 and player.is_alive() and seen == [] and session.chunks == 1
        gate.set()
        player.join(600)
        assert not player.is_alive() and [str(e) for e in errors] == ["boom in the decode"]
        assert seen == list(range(10))  # chunk 0's 9 frames and chunk 1's first, in order
    finally:
        gate.set()
        session.close()
    assert not decode_threads() and session._model is None and session._vae is None


def test_play_plans_the_decode_device_apart(fast_ckpt, image, monkeypatch):
    """--decode_device: the DiT's device is planned without the VAE, the decode device with the VAE and a
    chunk's decode; a refusal names the device that would not fit. On one device with `overlap` the forward
    and the decode are counted together."""
    files = resolve_fast_dir(fast_ckpt)
    kw = {"area": 64 * 112, "condition_frames": 4, "camera_cache": False}  # its 'auto': tests/test_fast_ui.py
    apart = play.PlaySession(files, "cuda:0", decode_device="cuda:1", **kw)
    alone = play.PlaySession(files, "cuda:0", **kw)
    assert apart.overlap and not alone.overlap
    need, same = apart.memory(image), alone.memory(image)
    assert need.encode == 0 and need.work_decode == 0 and need.work == need.work_forward
    assert same.encode > 0 and same.work_decode > 0 and same.work == max(same.work_forward, same.work_decode)
    decode = apart.decode_memory(image)
    assert decode > same.work_decode and alone.decode_memory(image) is None
    both = play.PlaySession(files, "cuda:0", overlap=True, **kw).memory(image)
    assert both.work == both.work_forward + both.work_decode

    free = {}
    monkeypatch.setattr(play, "free_memory", lambda device: (free[device.index], None))
    free.update({0: need.peak, 1: decode - 1})
    with pytest.raises(ValueError, match=r"^memory on cuda:1 \(the decode device, where the VAE runs\)"):
        apart.check_memory(image)
    free.update({0: need.peak - 1, 1: decode})
    with pytest.raises(ValueError, match=r"^memory on cuda:0 \(the DiT\): predicted peak"):
        apart.check_memory(image)
    free.update({0: need.peak, 1: decode})
    apart.check_memory(image)

    # one GPU, overlap left to the plan: on where the forward and the decode fit side by side, else serial
    asked, real_issue = [], play.fast_run.fast_fit_issue

    def fit_issue(*args, overlap, **kw):
        asked.append(overlap)
        return "too big" if overlap and tight[0] else real_issue(*args, overlap=overlap, **kw)

    monkeypatch.setattr(play.fast_run, "fast_fit_issue", fit_issue)
    free[0] = 1 << 40
    tight = [False]
    # the plan is asked once where overlap fits, and again without it where it does not
    for tight[0], expected, plans in ((False, True, [True]), (True, False, [True, False])):
        asked.clear()
        alone.check_memory(image)
        assert alone.overlap is expected and asked == plans
    explicit = play.PlaySession(files, "cuda:0", overlap=False, **kw)
    asked.clear()
    explicit.check_memory(image)
    assert not explicit.overlap and asked == [False]


def test_play_decides_the_camera_cache_at_each_memory_check(fast_ckpt, image, monkeypatch):
    """`camera_cache` 'auto' (play's default) is decided by each `check_memory` from what was asked: on where the
    plan fits it, off where only the plan without it fits; the figure `memory` gives then counts what was decided."""
    monkeypatch.setattr(play.fast_run, "first_frame_encode", lambda *a: 0)  # the tiny model's peak: the loop
    files = resolve_fast_dir(fast_ckpt)
    session = play.PlaySession(files, "cuda:0", area=64 * 112, condition_frames=4, overlap=False)
    assert session.config.camera_cache == "auto"
    plain = session.memory(image)  # 'auto' not yet decided: counted as off
    session.config = replace(session.config, camera_cache=True)
    kept = session.memory(image)
    session.config = replace(session.config, camera_cache="auto")
    assert kept.caches > plain.caches and kept.peak > plain.peak
    free = {}
    monkeypatch.setattr(play, "free_memory", lambda device: (free["vram"], None))
    for vram, decided in ((kept.peak, True), (kept.peak - 1, False), (kept.peak, True)):
        free["vram"] = vram
        session.check_memory(image)
        assert session.config.camera_cache is decided, vram
        assert session.memory(image).peak == (kept if decided else plain).peak
    free["vram"] = plain.peak - 1
    with pytest.raises(ValueError, match="memory: predicted peak"):
        session.check_memory(image)


def test_compiled_play_warms_up_unseen_and_then_plays_as_a_fresh_session(
    fast_ckpt, image, traced_chunk_blocks
):
    """With compile, start() first plays the chunks up to the window's first roll (where the blocks compile)
    without handing anything out, then starts over: the frames, their indices, rollouts, poses, key stamps
    and figures are those of a session without the warm-up (its first chunks run uncompiled)."""
    plain, plain_counts, _ = play_script(fast_ckpt, image)
    frames, counts, session = play_script(fast_ckpt, image, compile=True)
    assert traced_chunk_blocks  # the warm-up reached the roll and compiled the blocks
    assert session.warm_chunks == 0 and counts == plain_counts == [9, 12, 9]
    assert session.chunks == 3 and session.rollouts == 2 and len(session.chunk_seconds) == 3
    assert len(frames) == len(plain) == 30
    for a, b in zip(frames, plain, strict=True):
        assert (a.index, a.rollout, a.latent, a.keys) == (b.index, b.rollout, b.latent, b.keys)
        assert torch.equal(a.image, b.image) and np.array_equal(a.pose, b.pose)


def test_play_under_sequence_parallel_equals_one_rank(fast_ckpt, shipped_example, tmp_path):
    """Two gloo ranks play the script (keys, a new prompt, a restart): rank 0 hands out the one-rank play's
    frames and poses, both ranks made its chunk latents, and rank 0's close reached the follower, which
    freed its model and left."""
    import parallel_worker as worker
    import torch.multiprocessing as mp
    from helpers import free_port, one_thread

    image = shipped_example / "image.jpg"
    clock, frames = worker.Clock(), []
    with one_thread(), worker.recorded_chunks() as made:
        session = worker.play_session(fast_ckpt, "cpu", 1, clock, frames)
        try:
            worker.scripted_play(session, clock, cli.load_image(image))
        finally:
            session.close()
        want = worker.play_record(session, frames, made)
    assert want["chunks"] == 3 and want["rollouts"] == 2 and len(want["latents"]) == 3
    mp.spawn(worker.play_rank, args=(2, free_port(), str(tmp_path), str(fast_ckpt), str(image)), nprocs=2)
    lead, follower = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert lead["frames"] == want["frames"] and lead["rollouts"] == 2
    assert all(np.array_equal(a, b) for a, b in zip(lead["poses"], want["poses"], strict=True))
    for got in (lead, follower):
        assert got["chunks"] == 3 and got["closed"] is True
        for a, b in zip(got["latents"], want["latents"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # fp32: GEMM rounding
    # the frames decoded from those latents: a few uint8 steps apart at most, in a few pixels
    diff = (lead["images"].int() - want["images"].int()).abs()
    assert diff.max() <= 3 and (diff > 0).float().mean() < 0.01
    assert follower["frames"] == [] and follower["rollouts"] == 2  # the follower decodes nothing


@pytest.mark.slow
def test_a_follower_whose_rank_0_vanishes_stops_with_a_clear_error(fast_ckpt, shipped_example, tmp_path):
    """Rank 0 leaves after a chunk without a stop: the follower's wait ends at once with PeerLost (no hang until
    the group's timeout), its model freed."""
    import parallel_worker as worker
    import torch.multiprocessing as mp
    from helpers import free_port

    image = shipped_example / "image.jpg"
    args = (2, free_port(), str(tmp_path), str(fast_ckpt), str(image), 1)
    mp.spawn(worker.play_rank, args=args, nprocs=2)
    follower = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert "rank 0 ended without a stop" in follower["error"] and follower["chunks"] == 1
    assert follower["closed"] is True


def test_play_plans_each_ranks_share_under_sequence_parallel(fast_ckpt, image):
    """Under N ranks the memory plan is per GPU (each holds its share of the attention cache); compile is
    taken (the compiled blocks trace the all-to-all: tests/test_parallel.py)."""
    one = make_session(fast_ckpt, [], Clock()).memory(image)
    two = make_session(fast_ckpt, [], Clock(), ranks=2).memory(image)
    assert two.caches < one.caches and two.model == one.model  # every rank holds the whole model
    assert make_session(fast_ckpt, [], Clock(), ranks=2, compile=True).config.compile


def test_compiled_play_traces_nothing_after_the_warm_up(fast_ckpt, image, traced_chunk_blocks):
    """Past the warm-up no block traces again, over the window's roll and a restart's (the decode worker runs
    compiled code beside the DiT: a trace in one thread while the other runs a compiled function fails)."""
    clock, frames = Clock(), []
    session = make_session(fast_ckpt, frames, clock, compile=True, local_attn_size=7, sink_size=1)
    try:
        session.start(image, "a castle")
        warm = len(traced_chunk_blocks)
        assert warm and not frames
        for _ in range(2):
            for _ in range(4):  # past the roll (chunk 2 of 3 latent frames with a 7-frame window)
                clock.t += 1.0
                session.step()
            session.restart()
        session.flush()
    finally:
        session.close()
    assert len(traced_chunk_blocks) == warm and session.rollouts == 2 and frames


@pytest.mark.parametrize("overlap", [True, False])
def test_play_hands_the_latent_over_before_the_commit_and_reads_input_after_it(
    fast_ckpt, image, monkeypatch, overlap
):
    """The host runs ahead of the GPU: a chunk's latent goes to the decoder as soon as its last step is queued
    (its decode runs beside the commit pass), and the next chunk's input is read only after the previous chunk's
    DiT end, commit included, was waited for, so a key does not sit behind a DiT already queued. Each chunk's
    read-to-frame time runs from that read to the first frame a key can land in."""
    order = []

    class Event:
        def __init__(self, what):
            self.what = what

        def synchronize(
            self,
        ):  # the decode worker waits on the hand-over's: the caller's waits are the ones here
            if threading.current_thread() is threading.main_thread():
                order.append(("waited", self.what))
                clock.advance(0.5)  # the wait before the read: not part of read-to-frame

    handed = play.hand_over

    def hand_over(tensor, device):
        order.append(("handed over",))
        return handed(tensor, device)[0], Event("hand-over")

    forward = FastSession._forward

    def recorded(self, *args, **kwargs):
        order.append(("forward",))
        clock.advance(1.0)  # a forward takes a second
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(play, "hand_over", hand_over)
    monkeypatch.setattr(
        play, "queued_end", lambda device: order.append(("dit end recorded",)) or Event("dit end")
    )
    monkeypatch.setattr(FastSession, "_forward", recorded)
    clock = Clock()
    session = make_session(fast_ckpt, [], clock, overlap=overlap)

    def on_frame(frame):
        # handing a frame out takes 10 ms, for chunks 0 and 2 (9 + 12 frames): with overlap chunk 1's hand-out
        # runs beside chunk 2's forwards, and would add to chunk 2's figure however the threads take turns
        if frame.index < 9 or frame.index >= 21:
            clock.advance(0.01)

    session.on_frame = on_frame
    slots = session.controls.slots
    try:
        session.start(image, "a castle")
        monkeypatch.setattr(session.controls, "slots", lambda *a: order.append(("input",)) or slots(*a))
        order.clear()
        for _ in range(3):
            session.step()
        session.flush()
    finally:
        session.close()
    steps = len(session.config.timestep_index)
    # the steps, the hand-over, the commit, then the event the next chunk's input waits for
    chunk = [("forward",)] * steps + [("handed over",), ("forward",), ("dit end recorded",)]
    assert order == [("input",), *chunk] + [("waited", "dit end"), ("input",), *chunk] * 2
    # read-to-frame: from the read (after the wait) to the first frame a key can land in, handed out once the
    # chunk's forwards, commit included, are done; the last chunk's decode has nothing running beside it
    first, second, last = session.read_to_frame
    assert last == pytest.approx(steps + 1 + 0.01)  # its first frame, not its last (+0.12)
    if overlap:  # chunks 0 and 1 are handed out beside the next chunk's forwards
        assert second >= steps + 1 and first >= steps + 1 + 0.02
        # the next chunk's hand-over waits for the decoder: a chunk is out before the next one's commit ends
        assert max(first, second) <= 2 * (steps + 1) + 0.5 + 0.2
    else:  # a rollout's first chunk: the image's frame, then latent frame 1's first
        assert (first, second) == pytest.approx((steps + 1 + 0.02, steps + 1))


def test_a_sequence_parallel_follower_is_planned_without_the_vae(fast_ckpt, image, monkeypatch):
    """Rank 0 alone holds the VAE (encode, decode): another rank's plan has neither, and its check asks only for
    its own device's memory, whatever --decode_device says."""
    files = resolve_fast_dir(fast_ckpt)
    kw = {"area": 64 * 112, "condition_frames": 4, "ranks": 2}
    lead = play.PlaySession(files, "cuda:0", **kw).memory(image)
    monkeypatch.setattr(play.distributed, "rank", lambda: 1)
    for decode_device in (None, "cuda:2"):
        follower = play.PlaySession(files, "cuda:1", decode_device=decode_device, **kw)
        need = follower.memory(image)
        assert need.encode == 0 and need.work_decode == 0 and need.work == need.work_forward
        assert lead.encode > 0 and need.peak < lead.peak and follower.decode_memory(image) is None
        asked, peak = [], need.peak

        def free(device, asked=asked, peak=peak):
            asked.append(str(device))
            return peak, None

        monkeypatch.setattr(play, "free_memory", free)
        follower.check_memory(image)  # fits its own share exactly
        assert asked == ["cuda:1"]


@pytest.mark.parametrize("in_flight", [True, False], ids=["gpu-copy", "cpu"])
def test_play_queues_each_latent_frames_decode_before_handing_out_the_previous_ones(
    fast_ckpt, image, monkeypatch, in_flight
):
    """Where a latent frame's frames are still on their way to the host (an event to wait for: a GPU decode), the
    decode worker queues latent frame i+1's decode before it hands out frame i's (the front end's JPEG encoding
    then runs while the GPU decodes), and reads them only after waiting for the copy; where they are there already
    (a CPU decode) each latent frame is handed out at once. Frames come out in order, as many as before."""
    order = []
    to_host = play.frames_to_host

    class Filled:
        def __init__(self, n):
            self.n = n

        def synchronize(self):
            order.append(("filled", self.n))

    def recorded(video):
        frames, _ = to_host(video)
        n = sum(1 for e in order if e[0] == "decoded")
        order.append(("decoded", n))
        return frames, Filled(n) if in_flight else None

    monkeypatch.setattr(play, "frames_to_host", recorded)
    frames = []
    session = make_session(fast_ckpt, frames, Clock(), overlap=False)
    session.on_frame = lambda f: order.append(("out", f.latent)) or frames.append(f)
    try:
        session.start(image, "a castle")
        order.clear()
        assert session.step() == 9  # the rollout's first chunk: latent frames 0, 1, 2 give 1, 4 and 4 frames
    finally:
        session.close()
    out = [[("out", 0)], [("out", 1)] * 4, [("out", 2)] * 4]
    if in_flight:
        want = [
            ("decoded", 0),
            ("decoded", 1),
            ("filled", 0),
            *out[0],
            ("decoded", 2),
            ("filled", 1),
            *out[1],
        ]
        want += [("filled", 2), *out[2]]
    else:
        want = [e for i in range(3) for e in [("decoded", i), *out[i]]]
    assert order == want
    assert [f.index for f in frames] == list(range(9)) and all(f.image.dtype == torch.uint8 for f in frames)


def test_frames_to_host_on_the_cpu_is_frames_to_uint8():
    from lingbot_world.session.decode_worker import frames_to_host
    from lingbot_world.wan.pipeline import frames_to_uint8

    video = torch.rand(3, 4, 8, 10, generator=torch.Generator().manual_seed(0)) * 2.2 - 1.1
    frames, filled = frames_to_host(video)
    assert filled is None and frames.shape == (4, 8, 10, 3) and torch.equal(frames, frames_to_uint8(video))
