"""Reading checkpoint files safely: path checks, the safetensors header, weights-only torch files, and
`TensorFile` (keys, shapes and one tensor at a time from either kind of file).

Every problem with a file ends as one FileNotFoundError (nothing there) or CheckpointError (a
ValueError: a folder, a symlink loop, no read permission, a damaged or refused file) whose message
names the file. Torch files are only ever read with `torch.load(weights_only=True, mmap=True)`:
nothing is unpickled beyond tensors, and tensors stay memory-mapped until a caller copies one.
"""

import errno
import json
import math
import os
import pickle
import re
import stat
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
LIST_LIMIT = 12  # names shown per error list
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
UNMAPPED_BYTES = 64 << 20  # a legacy (non-zip) torch file up to this size is read whole

# safetensors dtype names, in the order of the format's Dtype enum (writers sort by it).
ST_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file (and tensor)."""


def name_list(names, limit: int = LIST_LIMIT) -> str:
    """Sorted names, comma-separated, at most `limit` of them, for error messages."""
    names = sorted(map(str, names))
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ----------------------------------------------------------------------------- paths


def path_problem(path) -> str | None:
    """Why `path` is not a readable regular file ('not found', 'is a folder', 'symlink loop',
    'cannot be read (permission denied)', ...), or None when it is one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"not found (a broken symlink to {os.readlink(path)})"
        return "not found"
    except NotADirectoryError:
        return "not found (a folder on its path is a file)"
    except PermissionError:
        return "cannot be read (permission denied)"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "symlink loop"
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return None


def file_error(path, what: str = "file", err: OSError | None = None) -> Exception:
    """The error to raise for a file that cannot be read: FileNotFoundError when nothing is there,
    else CheckpointError saying what is wrong with it."""
    problem = path_problem(path)
    if problem is None:  # readable by the checks, yet opening it failed
        problem = f"cannot be read ({err.strerror or err})" if err is not None else "cannot be read"
    if problem.startswith("not found"):
        return FileNotFoundError(f"{path}: {what} {problem}")
    return CheckpointError(f"{path}: {problem}")


def check_file(path, what: str = "file") -> Path:
    """`path` as a Path if it is a readable regular file; else raises `file_error`."""
    if path_problem(path) is not None:
        raise file_error(path, what)
    return Path(path)


def check_dir(path, what: str = "folder") -> Path:
    """`path` as a Path if it is a folder; else FileNotFoundError or CheckpointError saying what it is."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{path}: {what} not found") from None
    except OSError as e:
        raise file_error(path, what, e) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{path}: is a file, not a folder (expected the {what})")
    return Path(path)


def exists(path) -> bool:
    """Whether anything is at `path`: a file, a folder, a broken or looping symlink, or something
    this process may not look at."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


# ----------------------------------------------------------------------------- safetensors header


@dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor lives: ``start``/``end`` are absolute byte offsets in ``file``
    (-1 for tensors of a torch state dict)."""

    name: str  # model key (a loader may strip a prefix)
    file: Path
    key: str  # key inside the file
    dtype: torch.dtype
    shape: tuple
    start: int = -1
    end: int = -1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path, what: str = "checkpoint file") -> tuple[dict, dict]:
    """Parse and check a safetensors header: ({key: TensorRef}, metadata). Reads no tensor data.

    Checks the 8-byte length, the JSON, every dtype/shape/offset, that the offsets tile the data
    region without gaps or overlaps, and that the file is long enough to hold them (truncation).
    """
    path = check_file(path, what)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            raw = f.read(n) if n is not None and n <= MAX_HEADER_BYTES and 8 + n <= size else None
    except OSError as e:
        raise file_error(path, what, e) from None
    if n is None:
        raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes, no header)")
    if raw is None or len(raw) != n:
        raise CheckpointError(
            f"{path}: corrupt or truncated safetensors header (declares {n} header bytes, "
            f"file has {size} bytes)"
        )
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not an object)")
    base = 8 + n
    refs, spans = {}, []
    for key, info in header.items():
        try:
            if info["dtype"] not in ST_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {key!r} has dtype {info['dtype']!r}, which this loader does not read "
                    f"(known: {', '.join(ST_DTYPES)})"
                )
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
            if min(shape, default=0) < 0 or start < 0 or end < start:
                raise ValueError("negative size or offset")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: corrupt header entry for tensor {key!r} ({e!r})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {key!r} header says {end - start} bytes, but {info['dtype']} "
                f"{list(shape)} needs {nbytes}"
            )
        refs[key] = TensorRef(key, path, key, dtype, shape, base + start, base + end)
        spans.append((start, end, key))
    spans.sort()
    pos = 0
    for start, end, key in spans:
        if start != pos:
            raise CheckpointError(f"{path}: corrupt header, tensor {key!r} starts at {start}, expected {pos}")
        pos = end
    if base + pos > size:
        last = next((k for s, e, k in spans if base + e > size), "?")
        raise CheckpointError(
            f"{path}: truncated, tensor {last!r} needs bytes up to {base + pos} but the file has {size}"
        )
    return refs, metadata


# ----------------------------------------------------------------------------- torch files

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _first_sentence(err: BaseException) -> str:
    """The gist of a library's error message: its first sentence, without terminal colour codes."""
    text = _ANSI.sub("", str(err)).strip()
    line = (text.splitlines() or [type(err).__name__])[0]
    return re.split(r"(?<=\.)\s", line, maxsplit=1)[0].rstrip(".")[:300]


def load_torch_state(path, what: str, supported: str, allow_unmapped: bool = False) -> dict:
    """A flat {name: tensor} state dict from a torch file, read with `torch.load(weights_only=True,
    mmap=True)` (tensors stay memory-mapped).

    A file that pickles anything but tensors is refused: unpickling it would run code from the file.
    The legacy (non-zip) format cannot be memory-mapped: a file in it is read whole (still weights-only)
    when it is at most UNMAPPED_BYTES or `allow_unmapped` (files known to be small, such as the VAE), and
    refused otherwise.
    """
    path = check_file(path, what)
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            size = path.stat().st_size
            if not allow_unmapped and size > UNMAPPED_BYTES:
                raise CheckpointError(
                    f"{path}: refused: a legacy (non-zip) torch file of {size / (1 << 30):.1f} GiB cannot be "
                    "memory-mapped and is not read whole; save it again with torch.save's default (zip) "
                    f"format or as .safetensors; supported: {supported}"
                ) from None
            with warnings.catch_warnings():  # torch's note on the pickle protocol: the error says it all
                warnings.simplefilter("ignore", UserWarning)
                sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy non-zip format
    except CheckpointError:
        raise
    except OSError as e:
        raise file_error(path, what, e) from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad files; all mean "unreadable"
        text = _ANSI.sub("", str(e))
        if isinstance(e, pickle.UnpicklingError) and "weights only" in text.lower():
            # torch's advice to retry with weights_only=False is exactly what must not be done
            found = re.search(r"GLOBAL ([\w.]+)", text)
            if found:
                raise CheckpointError(
                    f"{path}: refused: besides tensors the file pickles {found.group(1)}, and loading "
                    f"it would run code from the file. Use a file that holds only tensors; "
                    f"supported: {supported}"
                ) from None
            detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
            raise CheckpointError(
                f"{path}: could not read it as a torch state dict with torch.load(weights_only=True, "
                f"mmap=True) ({detail.group(1).strip() if detail else 'not a weights-only pickle'}): "
                f"the file is damaged, or pickles more than tensors, which is refused because loading "
                f"it would run code from the file; supported: {supported}"
            ) from None
        raise CheckpointError(
            f"{path}: could not read it as a torch state dict with torch.load(weights_only=True, "
            f"mmap=True) ({_first_sentence(e)}); supported: {supported}"
        ) from None
    if not isinstance(sd, dict):
        raise CheckpointError(
            f"{path}: expected a flat dict of tensors (a state dict), got {type(sd).__name__}"
        )
    others = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if others:
        raise CheckpointError(
            f"{path}: expected a flat dict of tensors (a state dict); not tensors: {name_list(others)}"
        )
    return sd


# ----------------------------------------------------------------------------- either kind


class TensorFile:
    """Keys, shapes and one tensor at a time from a `.safetensors` file or a weights-only torch file.

    `what` names the file's role in errors; `supported` says which files would do; `allow_unmapped`:
    see `load_torch_state`.
    """

    def __init__(self, path, what: str, supported: str, allow_unmapped: bool = False):
        self.path = check_file(path, f"{what} file")
        suffix = self.path.suffix.lower()
        self._st = self._sd = None
        if suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            refs, _ = read_safetensors_header(self.path, f"{what} file")
            try:
                self._st = safe_open(str(self.path), framework="pt", device="cpu")
            except OSError as e:
                raise file_error(self.path, f"{what} file", e) from None
            except SafetensorError as e:
                raise CheckpointError(f"{self.path}: not a readable .safetensors file ({e})") from None
            self.shapes = {k: r.shape for k, r in refs.items()}
            self.dtypes = {k: r.dtype for k, r in refs.items()}
        elif suffix in TORCH_SUFFIXES:
            self._sd = load_torch_state(self.path, f"{what} file", supported, allow_unmapped)
            self.shapes = {k: tuple(v.shape) for k, v in self._sd.items()}
            self.dtypes = {k: v.dtype for k, v in self._sd.items()}
        else:
            raise CheckpointError(
                f"{self.path}: unsupported {what} file type {suffix!r}; supported: {supported}"
            )

    @property
    def keys(self) -> list:
        return list(self.shapes)

    def shape(self, key: str) -> tuple:
        return self.shapes[key]

    def dtype(self, key: str) -> torch.dtype:
        return self.dtypes[key]

    def get(self, key: str) -> torch.Tensor:
        return self._st.get_tensor(key) if self._st is not None else self._sd[key]
