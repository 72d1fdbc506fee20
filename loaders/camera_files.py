"""Read an upstream example/action folder (poses.npy, intrinsics.npy, action files) into arrays.

Every file goes through np.load(allow_pickle=False) and the shape checks of `wan.camera`, so an
error names the offending file.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..wan.actions import act2cam_trajectory, action_string_frames
from ..wan.camera import (
    camera_conditioning,
    check_intrinsics_rows,
    usable_frames,
    used_frame_count,
    validate_actions,
    validate_intrinsics,
    validate_poses,
)
from ..wan.config import SampleConfig
from ..wan.i2v import latent_frames

log = logging.getLogger("LingBot-World")

# key in the returned dict -> file name in the folder (upstream's layout)
CAMERA_FILES = {
    "poses": "poses.npy",  # [N, 4, 4] float32 c2w, OpenCV axes
    "intrinsics": "intrinsics.npy",  # [N, 4] fx, fy, cx, cy at 480x832
    "action": "action.npy",  # [N, 4] int32 W, A, S, D (Act model)
    "wasd": "wasd_action.npy",  # [N, 4] w, a, s, d (act2cam)
    "ijkl": "ijkl_action.npy",  # [N, 4] i, j, k, l (act2cam)
}
_VALIDATE = {"poses": validate_poses, "intrinsics": validate_intrinsics}


def load_npy(path) -> np.ndarray:
    """One .npy array, never unpickled; FileNotFoundError / ValueError name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:  # object arrays need pickle; also malformed headers
        raise ValueError(f"{path}: not a plain numeric .npy array ({e})") from e
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: unreadable .npy file ({e})") from e


def load_camera_dir(path, require_poses: bool = True) -> dict:
    """Arrays of a camera folder: 'poses' and 'intrinsics' (required), 'action', 'wasd', 'ijkl' if present.

    require_poses=False suits act2cam with an action string, which needs only intrinsics.npy. With poses,
    intrinsics.npy must have a row per pose or a single row (`wan.camera.check_intrinsics_rows`).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: camera folder not found (expected poses.npy, intrinsics.npy, ...)"
        )
    required = {"intrinsics"} | ({"poses"} if require_poses else set())
    out = {}
    for key, name in CAMERA_FILES.items():
        file = folder / name
        if not file.is_file() and key not in required:
            continue
        arr = load_npy(file)
        validate = _VALIDATE.get(key, validate_actions)
        out[key] = validate(arr, str(file))
    if "poses" in out:
        check_intrinsics_rows(
            len(out["intrinsics"]),
            len(out["poses"]),
            str(folder / CAMERA_FILES["intrinsics"]),
            str(folder / CAMERA_FILES["poses"]),
        )
    return out


@dataclass(frozen=True)
class CameraInput:
    """What flows on a LINGBOT_CAMERA link."""

    path: Path
    intrinsics: np.ndarray  # [N, 4] at 480x832
    poses: np.ndarray | None  # [N, 4, 4] c2w; None for an act2cam action string
    actions: np.ndarray | None  # action.npy [N, 4] (Act model)
    wasd: np.ndarray | None
    ijkl: np.ndarray | None
    action_string: str | None
    act2cam_files: bool

    @classmethod
    def from_dir(cls, folder, action_string: str | None = None, act2cam_files: bool = False) -> "CameraInput":
        """A pose folder, or act2cam keys (a string, or wasd/ijkl files) with the folder's intrinsics."""
        folder = Path(folder)
        act2cam = action_string is not None or act2cam_files
        files = load_camera_dir(folder, require_poses=not act2cam)
        if act2cam_files and action_string is None and "wasd" not in files:
            raise FileNotFoundError(f"act2cam from files: {folder / 'wasd_action.npy'} not found")
        return cls(
            path=folder,
            intrinsics=files["intrinsics"],
            poses=files.get("poses"),
            actions=files.get("action"),
            wasd=files.get("wasd"),
            ijkl=files.get("ijkl"),
            action_string=action_string,
            act2cam_files=act2cam_files and action_string is None,
        )

    @property
    def act2cam(self) -> bool:
        return self.action_string is not None or self.act2cam_files

    def frames(self) -> int:
        """The longest 4n+1 video this camera input can drive."""
        if self.action_string is not None:
            return action_string_frames(self.action_string)
        return usable_frames(len(self.wasd if self.act2cam_files else self.poses))

    def plan(self, frame_num: int | None) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(poses, actions, frames) for a requested 4n+1 `frame_num` (None: the default, or the action
        string's length), with upstream's rules: an action string fixes the length (a given
        frame_num must equal it), a pose file caps it."""
        if self.action_string is not None:
            t = act2cam_trajectory(action_string=self.action_string, frame_num=frame_num)
            return t.poses, None, t.frame_num
        if self.act2cam_files:
            t = act2cam_trajectory(wasd=self.wasd, ijkl=self.ijkl, frame_num=frame_num)
            return t.poses, None, t.frame_num
        frame_num = SampleConfig.frame_num if frame_num is None else frame_num
        latent_frames(frame_num)  # raises unless 4n+1, naming the nearest valid counts
        used = used_frame_count(len(self.poses), frame_num)
        if used < frame_num:
            log.warning(
                "%s has %d poses: generating %d frames, not %d (as upstream)",
                self.path,
                len(self.poses),
                used,
                frame_num,
            )
        return self.poses, self.actions, used

    def pack(self, control_type: str | None, frame_num: int, size, device):
        """(camera tensor [1, C, lat_f, lat_h, lat_w], frames actually generated)."""
        if control_type is None:
            raise ValueError(
                "camera: these experts have no camera layers (plain Wan2.2 i2v); disconnect the camera input"
            )
        poses, actions, frames = self.plan(frame_num)
        lat_h, lat_w, h, w = size
        return camera_conditioning(
            poses,
            self.intrinsics,
            frames,
            h,
            w,
            lat_h,
            lat_w,
            control_type=control_type,
            actions=actions,
            device=device,
            act2cam=self.act2cam,
        )
