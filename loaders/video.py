"""MP4 output through PyAV: written to a temporary file beside the target, then renamed into place,
so an interrupted run leaves no partial file and an existing file is never overwritten by accident."""

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


def write_mp4(frames, path, fps: float = 16, overwrite: bool = False, crf: int = 18) -> Path:
    """frames: uint8 [F, H, W, 3] (tensor or array). Returns the written path."""
    path = check_output(path, overwrite)
    array = frames.numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"frames: expected uint8 [F, H, W, 3], got {array.dtype} {list(array.shape)}")
    if array.shape[1] % 2 or array.shape[2] % 2:
        raise ValueError(f"frames: H.264 needs even height and width, got {array.shape[1]}x{array.shape[2]}")
    import av  # imported here so the rest of the pack works where PyAV is absent

    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial.mp4")
    try:
        with av.open(str(tmp), "w") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
            stream.width, stream.height = array.shape[2], array.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(crf)}
            for frame in array:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        if path.exists() and not overwrite:  # appeared while we were encoding
            raise FileExistsError(f"{path} appeared while writing; not overwriting it")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
