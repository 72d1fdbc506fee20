"""Prompts -> umT5 embeddings without keeping the ~11 GB encoder around.

`encode_prompts` looks every prompt up in a small on-disk cache first; a full hit never touches the
encoder. Misses are encoded either
- in a child Python process (mode='subprocess', the default) that loads the encoder, encodes, writes
  only the embeddings to a safetensors file and exits, so the weights never enter the caller's memory;
- or in this process (mode='inprocess'), which loads, encodes and then drops the model and returns
  freed RAM and VRAM (gc, torch.cuda.empty_cache, malloc_trim).
Both modes run the same `_encode_local`, so they return identical tensors.

Each prompt is encoded alone (batch of one, padded to text_len) as upstream's i2v pipeline does, and
comes back trimmed to its true token count: a bf16 CPU tensor [tokens, 4096].
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..wan.config import T5_DTYPE, TEXT_LEN
from ..wan.t5 import encode_trimmed
from .interrupts import InterruptGuard
from .monitor import free_memory, rss_anon
from .tensor_file import check_file
from .text_encoder import (
    TokenizerSource,
    UMT5Tokenizer,
    file_identity,
    load_text_encoder,
    read_encoder_config,
    resolve_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]  # the pack folder, where lingbot.py lives
CACHE_VERSION = 1
DEFAULT_TIMEOUT_S = 3600.0
MODES = ("subprocess", "inprocess")
WORK_PREFIX = "lingbot_t5_"  # temp folders: lingbot_t5_<parent pid>_<random>
LOCK_NAME = "owner.lock"
# The child's first lines, before any heavy import: on Linux ask the kernel to SIGKILL it when its
# parent goes (PR_SET_PDEATHSIG = 1), exit if the parent is already gone, then read the request and
# delete it at once (it holds the prompts). It imports the pack by path (as lingbot.py does), so it
# needs neither the CLI nor ComfyUI. argv: pack folder, request.json, parent pid.
_CHILD_BOOT = """
import json, os, sys
if sys.platform.startswith("linux"):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
    except Exception:
        pass
if os.getppid() != int(sys.argv[3]):
    os._exit(70)
with open(sys.argv[2], encoding="utf-8") as f:
    request = json.load(f)
os.unlink(sys.argv[2])
sys.path.insert(0, sys.argv[1])
from lingbot import load_pack
load_pack()
from lingbot_world.loaders.text_encode import child_main
sys.exit(child_main(request))
"""
_REPORTED_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


class EncoderProcessError(RuntimeError):
    """The text-encoder child failed without a ValueError/FileNotFoundError of its own: it crashed,
    was killed, or wrote nothing usable. The message has its exit status and last output lines."""


class EncodeCancelled(Exception):
    """A background encode stopped because the run it was for ended first."""


class BackgroundEncode:
    """`encode_prompts` on a thread of this process, so the caller goes on while the child encodes (its
    first-frame encode and expert load overlap the child's start, load and encode; the planner decides
    when both fit the card). `result()` waits and returns the embeddings (or raises what the encode
    raised); `close()` (also on leaving a `with`) stops a child still running and joins the thread.
    `seconds` is the encode's wall time, `waited` how long `result()` blocked."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("mode", "subprocess") != "subprocess":
            raise ValueError("a background encode runs the encoder in its child process (mode='subprocess')")
        self._cancel = threading.Event()
        self._value, self._error = None, None
        self.seconds = self.waited = 0.0
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(
            target=self._run,
            args=args,
            kwargs=dict(kwargs, cancel=self._cancel),
            daemon=True,
            name="text-encode",
        )
        self._thread.start()

    def _run(self, *args, **kwargs):
        try:
            self._value = encode_prompts(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the caller by result()
            self._error = err
        finally:
            self.seconds = time.perf_counter() - self._t0

    def result(self) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        with InterruptGuard() as guard:  # a signal's exception raised in a callback is not lost
            while self._thread.is_alive():  # in slices, so Ctrl-C reaches the main thread
                self._thread.join(0.1)
                guard.check()
        self.waited += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        return self._value

    def close(self) -> None:
        self._cancel.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def default_cache_dir() -> Path:
    """$LINGBOT_WORLD_CACHE/text_embeddings, else ~/.cache/lingbot_world/text_embeddings."""
    base = os.environ.get("LINGBOT_WORLD_CACHE")
    if base:
        return Path(base) / "text_embeddings"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "lingbot_world" / "text_embeddings"


class EmbeddingCache:
    """One safetensors file per embedding, LRU by mtime, bounded in entries and bytes.

    Writes are atomic (temp file + os.replace); a missing, partial or foreign file is just a miss, so
    the folder may be deleted at any time.
    """

    def __init__(self, root, max_entries: int = 256, max_bytes: int = 1 << 30):
        self.root = Path(root).expanduser().absolute()
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    @staticmethod
    def key(**fields) -> str:
        blob = json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def get(self, key: str, prompt: str) -> torch.Tensor | None:
        from safetensors import safe_open

        path = self._path(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if (f.metadata() or {}).get("prompt") != prompt:
                    return None
                tensor = f.get_tensor("context")
        except Exception:  # vanished, truncated or foreign file: a miss, and drop it
            _unlink(path)
            return None
        try:
            os.utime(path)  # mark as recently used
        except OSError:
            pass
        return tensor

    def put(self, key: str, prompt: str, tensor: torch.Tensor) -> None:
        """Store atomically; a cache that cannot be written only costs a warning."""
        from safetensors.torch import save_file

        tmp = self.root / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            save_file({"context": tensor.contiguous()}, str(tmp), metadata={"prompt": prompt})
            os.replace(tmp, self._path(key))
            self._evict()
        except OSError as e:
            warnings.warn(f"text-embedding cache {self.root} not written: {e}", stacklevel=2)
        finally:
            _unlink(tmp)

    def _evict(self) -> None:
        entries = []
        for p in self.root.glob("*.safetensors"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, p))
        entries.sort()  # oldest first
        total = sum(size for _, size, _ in entries)
        while len(entries) > 1 and (len(entries) > self.max_entries or total > self.max_bytes):
            _, size, p = entries.pop(0)
            _unlink(p)
            total -= size


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def encode_prompts(
    encoder_path,
    prompts: list[str],
    tokenizer_path=None,
    device="cpu",
    mode: str = "subprocess",
    cache_dir=None,
    *,
    text_len: int = TEXT_LEN,
    use_cache: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    while_waiting: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
) -> list[torch.Tensor]:
    """Embeddings [tokens, 4096] (bf16, CPU) for each prompt, in order.

    encoder_path: upstream .pth or ComfyUI umT5 .safetensors; tokenizer_path: see resolve_tokenizer.
    device: where the encoder runs ('cpu', 'cuda', 'cuda:1'). cache_dir: None = default_cache_dir().
    while_waiting: work for this process while the child encodes (subprocess mode, on a cache miss).
    cancel: set it to stop the child and raise EncodeCancelled (subprocess mode; see BackgroundEncode).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_prompts(prompts)
    encoder_path = check_file(encoder_path, "text encoder file").absolute()
    source = _source(tokenizer_path, encoder_path)
    sweep_stale_work_dirs()  # at every start, whether or not a child runs this time

    cache = EmbeddingCache(cache_dir if cache_dir is not None else default_cache_dir()) if use_cache else None
    key_fields = dict(
        version=CACHE_VERSION,
        encoder=file_identity(encoder_path),
        tokenizer=source.identity(),
        text_len=text_len,
        device=torch.device(device).type,
        dtype=str(T5_DTYPE),
    )
    keys = {p: EmbeddingCache.key(prompt=p, **key_fields) for p in prompts}
    found = {}
    if cache is not None:
        for p in keys:
            hit = cache.get(keys[p], p)
            if hit is not None:
                found[p] = hit
    todo = [p for p in dict.fromkeys(prompts) if p not in found]
    if todo:
        if mode == "subprocess":
            embs, _ = encode_in_subprocess(
                encoder_path, todo, source, device, text_len, timeout, while_waiting, cancel
            )
        else:
            embs, _ = encode_in_process(encoder_path, todo, source, device, text_len)
        for p, e in zip(todo, embs, strict=True):
            found[p] = e
            if cache is not None:
                cache.put(keys[p], p, e)
    return [found[p] for p in prompts]


def _check_prompts(prompts) -> None:
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r:.200}")


def _source(tokenizer, encoder_path) -> TokenizerSource:
    """The tokenizer, its path made absolute (a child process runs in another folder)."""
    source = (
        tokenizer if isinstance(tokenizer, TokenizerSource) else resolve_tokenizer(tokenizer, encoder_path)
    )
    return TokenizerSource(source.kind, source.path.absolute())


# ---------------------------------------------------------------------------------------------------
# In this process


def _encode_local(encoder_path, prompts, source: TokenizerSource, device, text_len):
    """Load tokenizer and encoder, encode each prompt alone, free the encoder. -> (embeddings, report)."""
    device = torch.device(device)
    tokenizer = UMT5Tokenizer(source, text_len)
    tokenizer.check_fits(read_encoder_config(encoder_path)["vocab"], encoder_path)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    report = dict(rss_anon_before=rss_anon(), vram_before=torch.cuda.memory_allocated(device) if cuda else 0)
    t0 = time.perf_counter()
    model = load_text_encoder(encoder_path, device=device, dtype=T5_DTYPE)
    t1 = time.perf_counter()
    try:
        embs = []
        for p in prompts:
            ids, mask = tokenizer([p])
            (emb,) = encode_trimmed(model, ids.to(device), mask.to(device))
            embs.append(emb.to("cpu").clone())
        t2 = time.perf_counter()
    finally:
        del model
        free_memory()
    report.update(
        load_s=t1 - t0,
        encode_s=t2 - t1,
        release_s=time.perf_counter() - t2,
        tokens=[int(e.shape[0]) for e in embs],
        rss_anon_after=rss_anon(),
        device=str(device),
    )
    if cuda:
        report.update(
            vram_peak=torch.cuda.max_memory_allocated(device),
            vram_after=torch.cuda.memory_allocated(device),
            gpu=torch.cuda.get_device_name(device),
        )
    return embs, report


def encode_in_process(encoder_path, prompts, tokenizer=None, device="cpu", text_len: int = TEXT_LEN):
    """Encode here, then release the encoder. -> (embeddings, report dict). No cache."""
    _check_prompts(prompts)
    return _encode_local(encoder_path, list(prompts), _source(tokenizer, encoder_path), device, text_len)


# ---------------------------------------------------------------------------------------------------
# In a child process


def _child_command(request_path: Path) -> list[str]:
    return [sys.executable, "-c", _CHILD_BOOT, str(ROOT), str(request_path), str(os.getpid())]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"


def _stop(proc: subprocess.Popen) -> None:
    """Kill the child (it holds nothing to save) and reap it; a second interrupt cannot skip the kill."""
    if proc.poll() is not None:
        return
    try:
        proc.kill()
    finally:
        proc.wait()


def _kill_children_in(work: Path) -> None:
    """Kill and reap child processes running in `work` (a child whose Popen never returned)."""
    import psutil

    for child in psutil.Process().children():
        try:
            if Path(child.cwd()) == work:
                child.kill()
                child.wait(10)
        except (psutil.Error, OSError):
            pass


def _lock(path: Path):
    """An exclusive lock held while the returned file stays open; the kernel drops it when this
    process dies, however it dies. None where unsupported (e.g. Windows) or when already held."""
    try:
        import fcntl
    except ImportError:
        return None
    f = open(path, "a+b")  # noqa: SIM115 - kept open to hold the lock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _owner_running(folder: Path) -> bool:
    """Whether the process named in `folder` (lingbot_t5_<pid>_...) runs and is the one that made it: a
    process of that pid started after the folder last changed (1 s of slack: start times are counted
    from a boot time in whole seconds) is another one that reuses the pid."""
    import psutil

    try:
        proc = psutil.Process(int(folder.name[len(WORK_PREFIX) :].split("_", 1)[0]))
        started = proc.create_time()
        return proc.status() != psutil.STATUS_ZOMBIE and started <= folder.stat().st_mtime + 1.0
    except (ValueError, OSError, psutil.Error):
        return False  # no such process (a pid from another pid namespace keeps its lock: checked next)


def sweep_stale_work_dirs(tmp_dir=None, min_age_s: float = 60.0) -> list[Path]:
    """Delete temp folders left by encoders whose parent process died without cleaning up (killed
    with SIGKILL, or by a SIGTERM nobody handled). A folder is stale only when the process named in it
    is gone and nobody holds its lock; folders younger than `min_age_s` without a lock file are being set
    up and stay."""
    removed = []
    for folder in Path(tmp_dir or tempfile.gettempdir()).glob(f"{WORK_PREFIX}*_*"):
        try:
            info = folder.stat()
            if info.st_uid != os.getuid():  # another user's (a shared /tmp): not ours to judge or read
                continue
            age = time.time() - info.st_mtime
            if not folder.is_dir() or (not (folder / LOCK_NAME).is_file() and age < min_age_s):
                continue
            if _owner_running(folder):
                continue
            held = _lock(folder / LOCK_NAME) if (folder / LOCK_NAME).is_file() else True
        except OSError:  # gone meanwhile, or unreadable: leave it
            continue
        if held is None:
            continue  # its owner is alive (or locking is unsupported)
        shutil.rmtree(folder, ignore_errors=True)
        if held is not True:
            held.close()
        removed.append(folder)
    return removed


def encode_in_subprocess(
    encoder_path,
    prompts,
    tokenizer=None,
    device="cpu",
    text_len: int = TEXT_LEN,
    timeout: float = DEFAULT_TIMEOUT_S,
    while_waiting: Callable[[], None] | None = None,
    cancel: threading.Event | None = None,
):
    """Encode in a child Python that exits afterwards. -> (embeddings, the child's report). No cache.
    `while_waiting()` runs here once the child has started (its time counts towards `timeout`);
    `cancel`, once set, stops the child and raises EncodeCancelled.

    The child gets every path absolute, deletes its request file (the prompts) as soon as it has
    read it, and dies with this process (Linux; elsewhere it notices within a second). A child that
    fails, is killed, times out or writes nothing raises EncoderProcessError or TimeoutError here
    with its exit status and last output lines; its own ValueError/FileNotFoundError comes back as
    such. On every way out of here (return, error, KeyboardInterrupt, SystemExit from a signal
    handler) the child is killed and reaped and the temp folder deleted.
    """
    from safetensors import safe_open

    _check_prompts(prompts)
    encoder_path = check_file(encoder_path, "text encoder file").absolute()
    source = _source(tokenizer, encoder_path)
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}_")).absolute()
    lock, proc = None, None
    try:
        lock = _lock(work / LOCK_NAME)
        out, err, log_path = work / "embeddings.safetensors", work / "error.json", work / "child.log"
        request = dict(
            encoder_path=str(encoder_path),
            tokenizer=dict(kind=source.kind, path=str(source.path)),
            prompts=list(prompts),
            device=str(device),
            text_len=text_len,
            output=str(out),
            error=str(err),
            parent_pid=os.getpid(),
        )
        request_path = work / "request.json"
        request_path.write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
        with open(log_path, "wb") as log:
            # cwd = the temp folder: `python -c` puts cwd on sys.path, and ComfyUI's own folder there
            # would let the pack's __init__ import ComfyUI into the child.
            try:
                proc = subprocess.Popen(
                    _child_command(request_path),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=work,
                )
            except BaseException:  # e.g. Ctrl-C after the fork but before Popen returned
                _kill_children_in(work)
                raise
            try:
                start = time.monotonic()
                if while_waiting is not None:
                    while_waiting()
                rc = _wait(proc, None if timeout is None else start + timeout, cancel)
            except subprocess.TimeoutExpired:
                _stop(proc)
                raise TimeoutError(
                    f"text-encoder subprocess did not finish within {timeout:g} s and was stopped; "
                    f"its last output:\n{_tail(log_path)}"
                ) from None
        if rc != 0:
            info = _read_error(err)
            exc = _REPORTED_ERRORS.get(info.get("type"))
            if exc is not None and isinstance(info.get("message"), str):
                raise exc(info["message"])
            if rc < 0:
                name = signal.Signals(-rc).name if -rc in signal.valid_signals() else "?"
                status = f"was killed by signal {-rc} ({name})"
                if -rc == getattr(signal, "SIGKILL", None):
                    status += ", e.g. by the out-of-memory killer"
            else:
                status = f"exited with status {rc}"
            raise EncoderProcessError(
                f"text-encoder subprocess {status}; its last output:\n{_tail(log_path)}"
            )
        if not out.is_file():
            raise EncoderProcessError(
                f"text-encoder subprocess exited with status 0 but wrote no embeddings ({out}); "
                f"its last output:\n{_tail(log_path)}"
            )
        try:
            with safe_open(str(out), framework="pt", device="cpu") as f:
                report = json.loads((f.metadata() or {}).get("report", "{}"))
                embs = [f.get_tensor(f"emb_{i}") for i in range(len(prompts))]
        except Exception as e:  # noqa: BLE001 - any fault in our own child's output file
            raise EncoderProcessError(f"text-encoder subprocess wrote unreadable embeddings ({e})") from None
        return embs, report
    finally:
        try:
            if proc is not None:
                _stop(proc)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if lock is not None:
                lock.close()


def _wait(proc: subprocess.Popen, deadline: float | None, cancel: threading.Event | None) -> int:
    """The child's exit status; subprocess.TimeoutExpired past `deadline` (monotonic), EncodeCancelled
    once `cancel` is set (the caller's cleanup kills the child)."""
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0)
        if cancel is None:
            return proc.wait(timeout=left)
        try:
            return proc.wait(timeout=0.05 if left is None else min(left, 0.05))
        except subprocess.TimeoutExpired:
            if cancel.is_set():
                raise EncodeCancelled("text encoding was cancelled") from None
            if left == 0:
                raise


def _read_error(path: Path) -> dict:
    """The child's {type, message} error report, {} when there is none or it is unreadable."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _watch_parent(parent_pid: int) -> None:
    """Exit if the parent goes away, so an abandoned child never keeps the weights in memory (the
    fallback where the kernel cannot be asked to kill the child with its parent)."""
    import psutil

    def loop():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid or not psutil.pid_exists(parent_pid):
                os._exit(70)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def _peak_rss() -> int:
    try:
        import resource
    except ImportError:  # Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child_main(request) -> int:
    """Entry of the encoding child that `encode_in_subprocess` starts (`_CHILD_BOOT`): the request
    dict, or the path of its JSON file. 0 on success; on an error, 1 and the error written to the
    request's `error` file."""
    from safetensors.torch import save_file

    if not isinstance(request, dict):
        request = json.loads(Path(request).read_text(encoding="utf-8"))
    _watch_parent(int(request["parent_pid"]))
    try:
        source = TokenizerSource(request["tokenizer"]["kind"], Path(request["tokenizer"]["path"]))
        embs, report = _encode_local(
            request["encoder_path"], request["prompts"], source, request["device"], int(request["text_len"])
        )
        report["child_peak_rss"] = _peak_rss()
        out = Path(request["output"])
        tmp = out.with_suffix(".tmp")
        tensors = {f"emb_{i}": e.contiguous() for i, e in enumerate(embs)}
        save_file(tensors, str(tmp), metadata={"report": json.dumps(report)})
        os.replace(tmp, out)
        return 0
    except Exception as e:
        traceback.print_exc()
        # the parent re-raises these two kinds by name; subclasses (CheckpointError) go as their base
        kind = next((name for name, cls in _REPORTED_ERRORS.items() if isinstance(e, cls)), type(e).__name__)
        try:
            Path(request["error"]).write_text(
                json.dumps(dict(type=kind, message=str(e)), ensure_ascii=False), encoding="utf-8"
            )
        except OSError:
            pass
        return 1
