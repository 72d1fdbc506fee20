"""Output files written atomically: to a temporary file beside the target, then renamed into place, so an
interrupted or failed write leaves no partial file and an existing file is never overwritten by accident.
MP4s through PyAV, encoded as the frames come (`Mp4Writer`), so a long video holds one batch in memory."""

import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch


def _entry(path: Path) -> Path:
    """Where a rename onto `path` lands: its folder resolved, its own name kept (a link is replaced, not followed)."""
    return path.parent.resolve() / path.name


def replaced_input(path, inputs) -> str | None:
    """What of the run's `inputs` writing `path` would replace ('FLAG PATH', or 'a file of FLAG FOLDER'), or
    None. `inputs`: (flag, path) pairs, files or folders (None skipped)."""
    path = Path(path).expanduser()
    for flag, given in inputs:
        if given is None:
            continue
        source = Path(given).expanduser()
        if source.is_dir():
            root = source.resolve()
            if path.exists() and (_entry(path).is_relative_to(root) or path.resolve().is_relative_to(root)):
                return f"a file of {flag} {given}"
        else:
            same = path.exists() and source.exists() and os.path.samefile(path, source)
            if same or _entry(path) == _entry(source):
                return f"{flag} {given}"
    return None


def check_output(path, overwrite: bool = False, inputs=()) -> Path:
    """Refuse an output path that cannot be written, before any work: a folder, a missing or read-only
    parent folder, or an existing file without `overwrite`; and, whatever `overwrite` says, anything but
    a regular file (a device, a pipe) and any of the run's `inputs` ((flag, path) pairs, see
    `replaced_input`). Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name such as {path / 'out.mp4'}")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path} is not a regular file (a device, pipe or socket); give a file name")
    source = replaced_input(path, inputs)
    if source is not None:
        raise ValueError(f"{path}: not replacing {source}, which this run also uses; give another file name")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"output folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"output folder {parent} is not writable")
    return path


class AtomicFile:
    """`with AtomicFile(path) as f:` write to `f.tmp` (a temporary name beside `path`); leaving the block
    renames it into place, an error or interrupt deletes it. An OSError on the way (a full disk, say)
    comes out as one message naming `path`, not the temporary name."""

    def __init__(self, path, overwrite: bool = False, suffix: str = ""):
        self.path = check_output(path, overwrite)
        self.overwrite = overwrite
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial{suffix}")

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
            if isinstance(exc, OSError):
                raise self.named(exc) from None

    def commit(self) -> None:
        try:
            if self.path.exists() and not self.overwrite:  # appeared while we were writing
                raise FileExistsError(f"{self.path} appeared while writing; not overwriting it")
            os.replace(self.tmp, self.path)
        except OSError as err:
            raise self.named(err) from None
        finally:
            self.discard()

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)

    def named(self, err: OSError) -> OSError:
        """`err` as one message naming the file (a full disk's own message names none, or the temporary)."""
        if str(self.path) in str(err):
            return err
        named = OSError(f"{self.path} could not be written: {err.strerror or err}")
        named.errno = err.errno
        return named


def write_atomic(path, data: bytes, overwrite: bool = False) -> Path:
    """`data` as the file `path`, whole or not at all (see AtomicFile). Returns the path."""
    with AtomicFile(path, overwrite) as out:
        out.tmp.write_bytes(data)
    return out.path


def _check_frames(array: np.ndarray) -> None:
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames: expected uint8 [F, H, W, 3], got {array.dtype} {list(array.shape)}")
    if array.shape[1] % 2 or array.shape[2] % 2:
        raise ValueError(f"frames: H.264 needs even height and width, got {array.shape[1]}x{array.shape[2]}")


class Mp4Writer:
    """An MP4 encoded batch by batch as frames come (`add`), finished and renamed into place by `close()`;
    `abort()`, or an error inside a `with` block, leaves nothing. The output is the same file
    `write_mp4` makes from all the frames at once."""

    def __init__(self, path, fps: float = 16, overwrite: bool = False, crf: int = 18):
        self._file = AtomicFile(path, overwrite, suffix=".mp4")
        self.path, self.fps, self.crf = self._file.path, fps, crf
        self._container = self._stream = None

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, frames) -> None:
        """frames: uint8 [F, H, W, 3] (tensor or array), the same H and W every time."""
        array = np.ascontiguousarray(frames.numpy() if isinstance(frames, torch.Tensor) else frames)
        _check_frames(array)
        import av  # imported here so the rest of the pack works where PyAV is absent

        try:
            if self._container is None:
                self._container = av.open(str(self._file.tmp), "w")
                stream = self._container.add_stream(
                    "libx264", rate=Fraction(self.fps).limit_denominator(1000)
                )
                stream.width, stream.height = array.shape[2], array.shape[1]
                stream.pix_fmt = "yuv420p"
                stream.options = {"crf": str(self.crf)}
                self._stream = stream
            elif (array.shape[1], array.shape[2]) != (self._stream.height, self._stream.width):
                raise ValueError(
                    f"frames: {array.shape[2]}x{array.shape[1]} after {self._stream.width}x"
                    f"{self._stream.height}; every frame of one video has the same size"
                )
            for frame in array:
                self._container.mux(self._stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        except BaseException as err:
            raise self._failed(err) from None

    def close(self) -> Path:
        """Flush the encoder and rename the file into place. Returns the path."""
        if self._container is None:
            raise ValueError(f"{self.path}: no frames were given; no video written")
        try:
            self._container.mux(self._stream.encode())
            self._container.close()
            self._container = None
        except BaseException as err:
            raise self._failed(err) from None
        self._file.commit()
        return self.path

    def abort(self) -> None:
        """Stop and delete the temporary file (nothing is left)."""
        if self._container is not None:
            container, self._container = self._container, None
            try:
                container.close()
            except Exception:  # noqa: BLE001 - the file is deleted next whatever it holds
                pass
        self._file.discard()

    def _failed(self, err: BaseException) -> BaseException:
        """Abort; the error to raise (an OSError naming the file)."""
        self.abort()
        return self._file.named(err) if isinstance(err, OSError) else err


def write_mp4(frames, path, fps: float = 16, overwrite: bool = False, crf: int = 18) -> Path:
    """frames: uint8 [F, H, W, 3] (tensor or array). Returns the written path."""
    with Mp4Writer(path, fps, overwrite, crf) as writer:
        writer.add(frames)
    return writer.path


def read_mp4_info(path) -> dict:
    """Frame count, size and frame rate of an MP4, by decoding it (the tests check outputs with it)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream))
        return {
            "frames": count,
            "width": stream.width,
            "height": stream.height,
            "fps": float(stream.average_rate),
        }
