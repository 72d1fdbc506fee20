"""Frame pacing for live play: a chunk's frames are made in a burst (the chunk denoises, then its latent frames
decode one after another), then nothing comes while the next chunk denoises. Shown as they come, they play as
a burst and a freeze; the pacer shows them one interval apart instead, the interval following the production
rate, so the picture moves steadily.

- Rate: the interval is the recent production time per frame (`produced(seconds, frames)` after each chunk:
  the shorter of the last 2 chunks' seconds per frame: one slow chunk does not slow playback down, which
  would add latency for several chunks; a guess on the short side makes the display wait once). The first
  chunk reported (warm-up) is left out; frames that come before a rate is known go out as they come.
- Buffer, trough based: when a frame comes, the slack is how long before it is needed (the previous frame's
  show time plus one interval, minus now; 0 when the display already waited). Its minimum over the last chunk
  of arrivals (the trough, met at a chunk's first frame) should be `buffer` intervals; the interval is
  stretched (up to `stretch`, when the trough is short: playback would starve) or shortened (down to
  1 / (1 + `hurry`), when frames wait longer than needed: latency) to make up the difference over one chunk.
  So a chunk's first frame waits about `buffer` intervals and its later frames are spread over the chunk's
  time: the least delay that steady playback needs.
- Order: frames and text messages leave in the order they were pushed; a text goes right after the frame before
  it.

`pump()` emits what is due and is all the timing logic (tests drive it with a fake clock); `start()` runs it in
a thread. `stats()`: what was shown, i.e. emitted (the page shows a frame when it arrives): FPS as shown and the
gaps between frames after warm-up (frames pushed once a rate was known), the delay the pacer added, and
key->pixel to the frame's show time. Frames still queued at `close()` are sent at once and not counted as shown.
"""

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from .play import percentile


class Pacer:
    def __init__(
        self,
        emit: Callable,
        per_chunk: int,
        *,
        pace: bool = True,
        buffer: float = 2.0,
        stretch: float = 0.15,
        hurry: float = 0.25,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.emit, self.per_chunk, self.pace, self.clock = emit, per_chunk, pace, clock
        self.buffer, self.stretch, self.hurry = buffer, stretch, hurry
        self.interval: float | None = None  # seconds per frame as produced recently
        self._chunks: deque = deque(maxlen=2)  # seconds per frame of the last chunks
        self._reported = 0
        self._slack: deque = deque(maxlen=per_chunk)
        self._last_frame = None  # show time given to the last frame pushed
        self._tail = None  # show time given to the last item pushed
        self._queue: deque = deque()  # (due, payload, is frame, arrival, keys, steady)
        self._cond = threading.Condition()
        self._closing = False
        self._thread = None
        self.shown: list[float] = []  # show times of the frames after warm-up (pushed once a rate was known)
        self.delays: list[float] = []  # show time - arrival, frames after warm-up
        self.latencies: list[float] = []  # show time - a key's arrival, for the frame that answers it

    def produced(self, seconds: float, frames: int) -> None:
        """A chunk of `frames` frames took `seconds` to make (the first report is warm-up and left out)."""
        with self._cond:
            self._reported += 1
            if self._reported > 1 and frames > 0:
                self._chunks.append(seconds / frames)
                self.interval = min(self._chunks)

    def _schedule(self, t: float) -> float:
        step, last = self.interval, self._last_frame
        if not self.pace or step is None or last is None:
            return t
        self._slack.append(max(last + step - t, 0.0))
        factor = 1.0 + (self.buffer * step - min(self._slack)) / (step * self.per_chunk)
        factor = min(max(factor, 1.0 / (1.0 + self.hurry)), 1.0 + self.stretch)
        return max(t, last + step * factor)

    def push(self, payload, *, frame: bool = True, keys=()) -> float:
        """Queue `payload` (a frame's message, or a text when frame=False); returns its show time. `keys`: the
        arrival times (same clock) of the input events this frame is the first to answer."""
        with self._cond:
            t = self.clock()
            if frame:
                due = self._last_frame = self._schedule(t)
            else:
                due = t if self._tail is None else max(t, self._tail)
            self._tail = due
            self._queue.append((due, payload, frame, t, tuple(keys), self.interval is not None))
            self._cond.notify()
        return due

    def pump(self) -> float | None:
        """Emit every item that is due; returns the show time of the next one (None: the queue is empty)."""
        while True:
            with self._cond:
                if not self._queue:
                    return None
                now = self.clock()
                if self._queue[0][0] > now:
                    return self._queue[0][0]
                _, payload, frame, arrival, keys, steady = self._queue.popleft()
                if frame:
                    self.latencies.extend(now - k for k in keys)
                    if steady:
                        self.shown.append(now)
                        self.delays.append(now - arrival)
            self.emit(payload)

    def _run(self) -> None:
        while True:
            self.pump()
            with self._cond:
                if self._closing:
                    return
                if not self._queue:
                    self._cond.wait()
                else:
                    wait = self._queue[0][0] - self.clock()
                    if wait > 0:
                        self._cond.wait(wait)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="play-pacer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; send what is still queued at once (not counted as shown)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            rest, self._queue = self._queue, deque()
        for item in rest:
            self.emit(item[1])

    def stats(self) -> dict:
        with self._cond:
            shown, delays, latencies = list(self.shown), list(self.delays), list(self.latencies)
        fps = None
        if len(shown) > 1 and shown[-1] > shown[0]:
            fps = (len(shown) - 1) / (shown[-1] - shown[0])
        gaps = np.diff(shown) if len(shown) > 1 else []
        return {
            "paced": self.pace,
            "pace_interval_s": self.interval,
            "shown_fps": fps,
            "shown_gap_p50_s": percentile(gaps, 50),
            "shown_gap_p95_s": percentile(gaps, 95),
            "shown_gap_max_s": float(max(gaps)) if len(gaps) else None,
            "pace_delay_p50_s": percentile(delays, 50),
            "pace_delay_max_s": max(delays) if delays else None,
            "shown_key_to_pixel_p50_s": percentile(latencies, 50),
            "shown_key_to_pixel_p95_s": percentile(latencies, 95),
            "shown_keys_measured": len(latencies),
        }
