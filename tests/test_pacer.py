"""The play pacer's timing (session.pacer) on a fake clock: simulated chunks whose frames come in a burst at the
end of each chunk (latent frame by latent frame), the pacer pumped at every arrival and every due time."""

import pytest
from lingbot_world.session.pacer import Pacer

N = 16  # frames a chunk (v2: 4 latent frames of 4)
FIRST = [1, 4, 4, 4]  # a rollout's first chunk: its first latent frame decodes to 1 frame
LATENT_DECODE = 0.05  # seconds a latent frame's decode takes


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(chunk_times, keys=(), **kw):
    """Play chunks taking `chunk_times` seconds each. Returns (pacer, [(frame index, arrival, show time)],
    [chunk start times]); `keys`: {frame index: key arrival time} handed with those frames."""
    clock, shown = Clock(), []
    pacer = Pacer(lambda p: shown.append((p, clock.t)), N, clock=clock, **kw)
    events, arrivals, starts, t, index = [], {}, [], 0.0, 0
    for c, seconds in enumerate(chunk_times):
        starts.append(t)
        t += seconds
        per_latent = FIRST if c == 0 else [N // 4] * 4
        for j, count in enumerate(per_latent):
            at = t - (len(per_latent) - 1 - j) * LATENT_DECODE
            for _ in range(count):
                arrivals[index] = at
                events.append((at, lambda i=index: pacer.push(i, keys=[keys[i]] if i in keys else [])))
                index += 1
        made = sum(per_latent)
        events.append((t, lambda s=seconds, n=made: pacer.produced(s, n)))
    due = None
    for at, act in events:
        while due is not None and due < at:
            clock.t = due
            due = pacer.pump()
        clock.t = at
        act()
        due = pacer.pump()
    while due is not None:
        clock.t = due
        due = pacer.pump()
    return pacer, [(i, arrivals[i], s) for i, s in shown], starts


def first_frames(played, chunks):
    """(arrival, show) of each chunk's first frame from chunk 1 on."""
    return [played[13 + N * (c - 1)][1:] for c in range(1, chunks)]


def test_steady_production_plays_steadily():
    """1 s a chunk: after the warm-up (the first chunk is left out of the rate; the second goes out as it
    comes) frames leave 1/16 s apart, across chunk boundaries too; a chunk's first frame waits about the
    2-interval buffer; nothing is shown before it arrives, and in order."""
    pacer, played, _ = simulate([1.0] * 12)
    assert [i for i, _, _ in played] == list(range(13 + 11 * N))
    assert all(show >= arrival for _, arrival, show in played)
    assert pacer.interval == pytest.approx(1 / N)
    paced = [show for _, _, show in played[13 + N :]]  # from the third chunk on
    gaps = [b - a for a, b in zip(paced, paced[1:], strict=False)]
    assert max(gaps) <= 1.15 / N + 1e-9 and min(gaps) >= 1 / 1.25 / N - 1e-9
    late = gaps[-4 * N :]  # settled
    assert max(late) == pytest.approx(1 / N, rel=0.02) and min(late) == pytest.approx(1 / N, rel=0.02)
    for arrival, show in first_frames(played, 12)[-4:]:
        assert show - arrival == pytest.approx(2 / N, abs=0.01)
    stats = pacer.stats()
    assert stats["shown_fps"] == pytest.approx(N, rel=0.03)
    assert stats["shown_gap_max_s"] <= 1.15 / N + 1e-9
    # a frame waits at most a chunk's time (spread over the chunk) plus the buffer
    assert stats["pace_delay_max_s"] <= 1.0 + 2 / N


def test_unpaced_frames_come_in_bursts():
    """pace=False: every frame leaves on arrival; the shown gaps show the freeze while a chunk denoises."""
    pacer, played, _ = simulate([1.0] * 6, pace=False)
    assert all(show == arrival for _, arrival, show in played)
    stats = pacer.stats()
    assert stats["shown_gap_max_s"] == pytest.approx(1.0 - 3 * LATENT_DECODE)
    assert stats["shown_gap_p50_s"] == 0.0 and stats["pace_delay_max_s"] == 0.0


def test_jitter_does_not_starve():
    """Chunks alternating 0.95 / 1.05 s: the buffer absorbs it; no gap grows past the stretch limit."""
    pacer, played, _ = simulate([0.95, 1.05] * 8)
    paced = [show for _, _, show in played[13 + 3 * N :]]
    gaps = [b - a for a, b in zip(paced, paced[1:], strict=False)]
    assert max(gaps) <= 1.15 * pacer.interval + 1e-9
    assert pacer.stats()["shown_fps"] == pytest.approx(N, rel=0.05)


def test_rate_follows_production():
    """Production slows from 1 s to 2 s a chunk: the interval doubles and playback is steady again. It speeds
    back up to 1 s: the first fast chunk still plays at the old rate (the rate is known after a chunk), so
    frames queue up; they drain (played up to 1.25x fast) until a chunk's first frame waits the buffer again."""
    times = [1.0] * 5 + [2.0] * 8 + [1.0] * 12
    pacer, played, _ = simulate(times)
    slow = [show for _, _, show in played[13 + 11 * N : 13 + 12 * N]]  # the 13th chunk: settled at 2 s
    gaps = [b - a for a, b in zip(slow, slow[1:], strict=False)]
    assert min(gaps) == pytest.approx(2 / N, rel=0.05) and max(gaps) == pytest.approx(2 / N, rel=0.05)
    assert pacer.interval == pytest.approx(1 / N)
    waits = [show - arrival for arrival, show in first_frames(played, len(times))]
    assert max(waits) < 2.0
    assert waits[-2:] == pytest.approx([2 / N] * 2, abs=0.01)


def test_one_slow_chunk_leaves_no_lag():
    """One chunk twice as slow: the display waits for it once (a freeze), and the playback rate does not
    follow it, so the chunks after it wait no more than the buffer."""
    pacer, played, _ = simulate([1.0] * 5 + [2.0] + [1.0] * 5)
    waits = [show - arrival for arrival, show in first_frames(played, 11)]
    assert max(waits[5:]) <= 2 / N + 0.01
    assert pacer.interval == pytest.approx(1 / N)


def test_key_to_pixel_counts_to_the_show_time():
    """A frame's keys are measured to when it is shown, which the pacer delays; warm-up frames' keys too."""
    index = 13 + 4 * N + 8  # latent frame 2 of the 6th chunk: it waits for its turn
    pacer, played, _ = simulate([1.0] * 7, keys={2: 0.5, index: 3.5})
    want = [played[2][2] - 0.5, played[index][2] - 3.5]
    assert pacer.latencies == pytest.approx(want)
    assert played[index][2] - played[index][1] > 0.3  # it waited in the pacer
    stats = pacer.stats()
    assert stats["shown_keys_measured"] == 2
    assert stats["shown_key_to_pixel_p50_s"] == pytest.approx(sum(want) / 2)


def test_texts_keep_their_place_and_close_flushes():
    """A text pushed after a frame leaves right after it; close() sends what is still queued at once, in
    order, without counting it as shown."""
    clock, out = Clock(), []
    pacer = Pacer(lambda p: out.append((p, clock.t)), 4, clock=clock)
    pacer.produced(1.0, 4)  # warm-up, left out
    pacer.produced(0.4, 4)
    assert pacer.interval == pytest.approx(0.1)
    for i in range(4):
        pacer.push(f"f{i}")
    pacer.push("stats", frame=False)
    # f1 came with f0: 1 interval in hand, the buffer asks 2: stretched, by 15 % at most
    assert pacer.pump() == pytest.approx(0.115)
    assert out == [("f0", 0.0)]
    clock.t = 0.15
    pacer.pump()
    assert [p for p, _ in out] == ["f0", "f1"]
    pacer.close()
    assert [p for p, _ in out] == ["f0", "f1", "f2", "f3", "stats"]
    assert len(pacer.shown) == 2 and pacer.stats()["paced"] is True
