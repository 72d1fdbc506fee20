"""Wall time, peak anonymous RSS and peak VRAM (the CLI's per-phase summary, tests, benchmarks), and
handing freed memory back to the system.

Anonymous RSS (RssAnon; pinned buffers included) is what the OOM killer weighs. File-backed pages of
a memory-mapped safetensors file are reclaimable page cache, so they are reported apart (VmHWM).
"""

import contextlib
import ctypes
import gc
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch


def proc_status(pid="self") -> dict:
    """/proc/<pid>/status memory fields in bytes (RssAnon, RssFile, VmRSS, VmHWM, ...); {} off Linux."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def rss_anon(pid="self") -> int:
    """Anonymous resident bytes of a process (Linux); plain RSS elsewhere."""
    value = proc_status(pid).get("RssAnon")
    if value is not None:
        return value
    return (psutil.Process() if pid == "self" else psutil.Process(int(pid))).memory_info().rss


class RssSampler:
    """Samples a process's RSS on a thread: `with RssSampler() as s: ...` then s.start_bytes, s.peak,
    s.growth (anonymous RSS) and s.start_total, s.peak_total (all resident pages, file pages included)."""

    def __init__(self, interval: float = 0.002, pid="self"):
        self.interval, self.pid = interval, pid
        self.start_bytes = self.peak = self.start_total = self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        rss = rss_anon(self.pid)
        self.peak = max(self.peak, rss)
        self.peak_total = max(self.peak_total, proc_status(self.pid).get("VmRSS", rss))
        return rss

    def _run(self):
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, psutil.Error):
                self.sample()

    def __enter__(self):
        self.start_bytes = self.peak = self.sample()
        self.start_total = self.peak_total
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError, psutil.Error):
            self.sample()

    @property
    def growth(self) -> int:
        return self.peak - self.start_bytes


@dataclass
class PhaseRecord:
    name: str
    seconds: float = 0.0
    peak_rss_anon: int = 0  # bytes, absolute
    rss_anon_start: int = 0
    peak_vram: int | None = None  # bytes allocated by torch on the device, if CUDA
    peak_reserved: int | None = None  # bytes its caching allocator held (what a memory cap limits)
    background: bool = False  # ran beside the other phases (its time is in theirs too)

    def as_dict(self) -> dict:
        gib = 1 << 30
        if self.background:  # its memory was another process's: the time alone
            return {"phase": self.name, "seconds": round(self.seconds, 3), "background": True}
        return {
            "phase": self.name,
            "seconds": round(self.seconds, 3),
            "peak_rss_anon_gib": round(self.peak_rss_anon / gib, 3),
            "rss_anon_growth_gib": round((self.peak_rss_anon - self.rss_anon_start) / gib, 3),
            "peak_vram_gib": None if self.peak_vram is None else round(self.peak_vram / gib, 3),
            "peak_reserved_gib": None if self.peak_reserved is None else round(self.peak_reserved / gib, 3),
        }


@dataclass
class PhaseLog:
    """Collects one PhaseRecord per `with log.phase(name):` block."""

    records: list = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        rec = PhaseRecord(name)
        t0 = time.perf_counter()
        with RssSampler(interval=0.02) as sampler:
            try:
                yield rec
            finally:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                    rec.peak_vram = torch.cuda.max_memory_allocated()
                    rec.peak_reserved = torch.cuda.max_memory_reserved()
        rec.seconds = time.perf_counter() - t0
        rec.peak_rss_anon, rec.rss_anon_start = sampler.peak, sampler.start_bytes
        self.records.append(rec)

    def add_background(self, name: str, seconds: float) -> None:
        """A phase that ran beside the others from the start (listed first)."""
        self.records.insert(0, PhaseRecord(name, seconds, background=True))

    def table(self) -> str:
        rows = [r.as_dict() for r in self.records]
        head = f"{'phase':<16}{'time s':>9}{'peak RAM (anon) GiB':>21}{'peak VRAM GiB':>15}"
        lines = [head, "-" * len(head)]
        for r in rows:
            if r.get("background"):
                lines.append(
                    f"{r['phase']:<16}{r['seconds']:>9.2f}  (in the background, beside the phases below)"
                )
                continue
            vram = "-" if r["peak_vram_gib"] is None else f"{r['peak_vram_gib']:.2f}"
            lines.append(f"{r['phase']:<16}{r['seconds']:>9.2f}{r['peak_rss_anon_gib']:>21.2f}{vram:>15}")
        total = sum(r["seconds"] for r in rows if not r.get("background"))
        lines.append(f"{'total':<16}{total:>9.2f}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- giving memory back


def trim_heap() -> None:
    """Hand freed malloc heap pages back to the OS (glibc keeps them, and RSS with them)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def free_memory() -> None:
    """Return freed memory to the system: Python cycles, CUDA and pinned-host caches, malloc arenas."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    trim_heap()
