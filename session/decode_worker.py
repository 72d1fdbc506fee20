"""The decode worker of the chunked runs (`play`, `fast`): a chunk's VAE decode in a thread of its own, on its own
CUDA stream (ahead of the DiT's, `DECODE_PRIORITY`), while the caller's thread runs the next chunk's DiT; on the
DiT's GPU or on another device."""

import contextlib
import threading
from collections.abc import Callable

import torch

from ..wan.pipeline import uint8_frames

# The decode stream outranks the DiT's where both share a GPU: the card's scheduler runs a queued latent frame's
# decode first instead of splitting itself with the next chunk's forwards, so a chunk's frames come out sooner
# (live play's key->pixel; BENCHMARKS.md, "Live play ... decode pipelined"; `fast`'s worker shares it, unmeasured
# there). Kernels and results are the same.
DECODE_PRIORITY = -1  # lower is higher; torch maps it into the device's range


def same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` is `cuda:0` here (the CLI's devices are not moved off it)."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def queued_end(device: torch.device):
    """An event marking the end of the work queued so far on `device`'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done


def hand_over(tensor: torch.Tensor, device: torch.device) -> tuple:
    """(`tensor` on the decode `device`, the event `DecodeWorker.submit` waits for before the worker reads it: a
    torch.cuda.Event recorded after the copy, None on the CPU)."""
    tensor = tensor.to(device)
    return tensor, queued_end(device)  # the worker's stream starts after the caller's work and the copy


def frames_to_host(video: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`frames_to_uint8(video)` without waiting for it: (the uint8 frames [F, H, W, 3] on the CPU, the event after
    which they are filled, None where they already are). On a GPU they are copied into pinned memory on the
    current stream, so the caller can queue more work before it reads them."""
    frames = uint8_frames(video)
    if frames.device.type != "cuda":
        return frames, None
    host = torch.empty(frames.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(frames, non_blocking=True)
    return host, queued_end(frames.device)


class DecodeWorker:
    """One thread that runs `work(job)` for each submitted job in order, under no_grad and, on a GPU, on its own
    CUDA stream. `submit` waits until the previous job is done, so at most one is in hand; an exception in a
    job is raised by the next `submit`, `wait` or `close`."""

    def __init__(self, device: torch.device, work: Callable[[object], None]):
        self.work = work
        self.stream = torch.cuda.Stream(device, priority=DECODE_PRIORITY) if device.type == "cuda" else None
        self._cond = threading.Condition()
        self._job = self._error = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="lingbot-decode", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                job = self._job
            if job is None:
                return
            job, ready = job
            try:
                if ready is not None:
                    ready.synchronize()
                stream = (
                    torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
                )
                with stream, torch.no_grad():
                    self.work(job)
            except BaseException as err:  # raised in the caller's thread
                self._error = err
            with self._cond:
                self._job = None
                self._cond.notify_all()

    def wait(self) -> None:
        """Until the job in hand is done; raises its exception."""
        with self._cond:
            while self._job is not None:
                self._cond.wait()
            err, self._error = self._error, None
        if err is not None:
            raise err

    def submit(self, job, ready=None) -> None:
        """`ready`: `hand_over`'s event for the job's tensor (None: nothing to wait for)."""
        self.wait()
        if not self._thread.is_alive():
            raise RuntimeError("the decode worker has stopped")
        with self._cond:
            self._job = job, ready
            self._cond.notify_all()

    def close(self) -> None:
        """Finish the job in hand, stop the thread (raises the job's exception)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.wait()
