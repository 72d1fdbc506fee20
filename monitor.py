"""Wall time, peak anonymous RSS and peak VRAM per phase, for the CLI summary and the benchmarks.

Anonymous RSS (RssAnon; pinned buffers included) is what the OOM killer weighs. File-backed pages of
a memory-mapped safetensors file are reclaimable page cache, so they are reported apart (VmHWM).
"""

import contextlib
import threading
import time
from dataclasses import dataclass, field

import psutil
import torch


def _status_kb(field_name: str, pid="self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_anon(pid="self") -> int:
    """Anonymous resident bytes of a process (Linux); plain RSS elsewhere."""
    kb = _status_kb("RssAnon", pid)
    if kb is not None:
        return kb * 1024
    proc = psutil.Process() if pid == "self" else psutil.Process(int(pid))
    return proc.memory_info().rss


def vm_hwm(pid="self") -> int | None:
    kb = _status_kb("VmHWM", pid)
    return None if kb is None else kb * 1024


class PeakSampler:
    """Samples a process's anonymous RSS on a thread; `.peak` is the highest value seen."""

    def __init__(self, pid="self", interval: float = 0.02):
        self.pid, self.interval = pid, interval
        self.start_value = self.peak = rss_anon(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, rss_anon(self.pid))
            except (OSError, psutil.Error):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError, psutil.Error):
            self.peak = max(self.peak, rss_anon(self.pid))


@dataclass
class PhaseRecord:
    name: str
    seconds: float = 0.0
    peak_rss_anon: int = 0  # bytes, absolute
    rss_anon_start: int = 0
    peak_vram: int | None = None  # bytes allocated by torch on the device, if CUDA

    def as_dict(self) -> dict:
        gib = 1 << 30
        return {
            "phase": self.name,
            "seconds": round(self.seconds, 3),
            "peak_rss_anon_gib": round(self.peak_rss_anon / gib, 3),
            "rss_anon_growth_gib": round((self.peak_rss_anon - self.rss_anon_start) / gib, 3),
            "peak_vram_gib": None if self.peak_vram is None else round(self.peak_vram / gib, 3),
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
        with PeakSampler() as sampler:
            try:
                yield rec
            finally:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                    rec.peak_vram = torch.cuda.max_memory_allocated()
        rec.seconds = time.perf_counter() - t0
        rec.peak_rss_anon, rec.rss_anon_start = sampler.peak, sampler.start_value
        self.records.append(rec)

    def table(self) -> str:
        rows = [r.as_dict() for r in self.records]
        head = f"{'phase':<16}{'time s':>9}{'peak RAM (anon) GiB':>21}{'peak VRAM GiB':>15}"
        lines = [head, "-" * len(head)]
        for r in rows:
            vram = "-" if r["peak_vram_gib"] is None else f"{r['peak_vram_gib']:.2f}"
            lines.append(f"{r['phase']:<16}{r['seconds']:>9.2f}{r['peak_rss_anon_gib']:>21.2f}{vram:>15}")
        total = sum(r["seconds"] for r in rows)
        lines.append(f"{'total':<16}{total:>9.2f}")
        return "\n".join(lines)

