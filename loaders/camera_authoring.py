"""Camera presets as camera inputs, and pose folders written in upstream's layout.

`preset_camera` turns preset text (`wan.camera_presets`) into the `CameraInput` the sampler and the
CLI take, exactly as a `poses.npy` + `intrinsics.npy` folder would; `save_camera_dir` writes such a
folder, which `CameraInput.from_dir` (the CLI's --action_path, the camera-path node) reads back.
"""

import os
import tempfile
from pathlib import Path

import numpy as np

from ..wan import camera_presets
from ..wan.camera import validate_intrinsics, validate_poses
from ..wan.camera_presets import DEFAULT_HFOV_DEG, PresetPath, build_preset
from ..wan.config import INTRINSICS_SIZE
from .camera_files import CAMERA_FILES, CameraInput

__all__ = [
    "DEFAULT_HFOV_DEG",
    "PRESET_HELP",
    "arrays_camera",
    "camera_path_arrays",
    "describe_path",
    "preset_camera",
    "save_camera_dir",
]
# The preset grammar, for `lingbot.py camera --help`: the module documentation of wan.camera_presets.
PRESET_HELP = camera_presets.__doc__


def preset_camera(
    text: str,
    frame_num: int | None = None,
    speed: float = 1.0,
    size: tuple = INTRINSICS_SIZE,
    hfov_deg: float = DEFAULT_HFOV_DEG,
) -> tuple[CameraInput, PresetPath]:
    """(CameraInput with the preset's poses and intrinsics, the built path)."""
    path = build_preset(text, frame_num=frame_num, speed=speed, size=size, hfov_deg=hfov_deg)
    return arrays_camera(path.poses, path.intrinsics, f"camera preset {path.description!r}"), path


def arrays_camera(poses: np.ndarray, intrinsics: np.ndarray, name: str) -> CameraInput:
    """A CameraInput from in-memory arrays, checked like the files of a pose folder."""
    return CameraInput(
        path=Path(name),
        intrinsics=validate_intrinsics(intrinsics, f"{name}: intrinsics"),
        poses=validate_poses(poses, f"{name}: poses"),
        actions=None,
        wasd=None,
        ijkl=None,
        action_string=None,
        act2cam_files=False,
    )


def save_camera_dir(folder, poses: np.ndarray, intrinsics: np.ndarray, overwrite: bool = False) -> Path:
    """Write poses.npy [N, 4, 4] + intrinsics.npy [N, 4] (float32) into `folder` (created if needed).
    Existing files are replaced only with overwrite=True; each file is written atomically."""
    folder = Path(folder).expanduser()
    poses = validate_poses(poses, "poses").astype(np.float32)
    intrinsics = validate_intrinsics(intrinsics, "intrinsics").astype(np.float32)
    targets = {folder / CAMERA_FILES["poses"]: poses, folder / CAMERA_FILES["intrinsics"]: intrinsics}
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder}: exists and is not a folder")
    if not overwrite:
        existing = [str(p) for p in targets if p.exists()]
        if existing:
            raise FileExistsError(f"{', '.join(existing)} exist(s); pass overwrite to replace")
    folder.mkdir(parents=True, exist_ok=True)
    for target, array in targets.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".npy", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, array, allow_pickle=False)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return folder


def camera_path_arrays(camera: CameraInput, frame_num: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(poses, intrinsics) the sampler would use for `frame_num` (None: the camera's default length):
    a pose file cut to the generated frames, an action string's synthetic poses (its own length)."""
    poses, _, frames = camera.plan(None if camera.action_string is not None else frame_num)
    if not camera.act2cam:
        poses = poses[:frames]
    return np.asarray(poses), np.asarray(camera.intrinsics)


def describe_path(poses: np.ndarray, intrinsics: np.ndarray) -> str:
    """One line: frames, path length, net turn and focal range, for the CLI."""
    poses = np.asarray(poses, dtype=np.float64)
    rel = np.linalg.inv(poses[0]) @ poses[-1]
    steps = np.linalg.norm(np.diff(poses[:, :3, 3], axis=0), axis=1)
    turn = np.degrees(np.arccos(np.clip((np.trace(rel[:3, :3]) - 1) / 2, -1.0, 1.0)))
    fx = np.asarray(intrinsics)[:, 0]
    return (
        f"{len(poses)} poses: path length {steps.sum():.3g} units, end {np.round(rel[:3, 3], 3).tolist()} from "
        f"the start, net rotation {turn:.1f} deg, fx {fx.min():.1f}..{fx.max():.1f} px at 832 wide"
    )
