"""Camera node: a pose folder (poses.npy + intrinsics.npy) or act2cam keys -> raw arrays.

The sampler packs them into the DiT's camera tensor once the video size and the experts' control
type are known (`CameraInput.pack`).
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import folder_paths
import numpy as np

from ..loaders.camera_files import load_camera_dir
from ..wan.actions import act2cam_trajectory, parse_action_string
from ..wan.camera import camera_conditioning, usable_frames, used_frame_count
from .models import CATEGORY

CAMERA = "LINGBOT_CAMERA"
PACK_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PATH = "examples/00"
log = logging.getLogger("LingBot-World")


def resolve_camera_dir(text: str) -> Path:
    """Absolute path as is; a relative one against the pack folder, then ComfyUI's input folder."""
    path = Path(text.strip()).expanduser()
    if path.is_absolute():
        return path
    tried = [PACK_ROOT / path, Path(folder_paths.get_input_directory()) / path]
    for candidate in tried:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"camera folder {text!r} not found (looked in {', '.join(str(t) for t in tried)}); "
        "expected a folder with poses.npy and intrinsics.npy"
    )


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

    @property
    def act2cam(self) -> bool:
        return self.action_string is not None or self.act2cam_files

    def frames(self) -> int:
        """The longest 4n+1 video this camera input can drive."""
        if self.action_string is not None:
            return act2cam_trajectory(action_string=self.action_string).frame_num
        return usable_frames(len(self.wasd if self.act2cam_files else self.poses))

    def plan(self, frame_num: int) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(poses, actions, frames) for a requested 4n+1 `frame_num`, with upstream's rules: an action
        string fixes the length (frame_num must equal it), a pose file caps it."""
        if self.action_string is not None:
            t = act2cam_trajectory(action_string=self.action_string, frame_num=frame_num)
            return t.poses, None, t.frame_num
        if self.act2cam_files:
            t = act2cam_trajectory(wasd=self.wasd, ijkl=self.ijkl, frame_num=frame_num)
            return t.poses, None, t.frame_num
        used = used_frame_count(len(self.poses), frame_num)
        if used < frame_num:
            log.warning(
                "%s has %d poses: generating %d frames, not %d", self.path, len(self.poses), used, frame_num
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
            poses, self.intrinsics, frames, h, w, lat_h, lat_w, control_type=control_type,
            actions=actions, device=device, act2cam=self.act2cam,
        )  # fmt: skip


class LingBotCamera:
    DESCRIPTION = (
        "Camera path for LingBot-World: a folder with poses.npy + intrinsics.npy (upstream's example "
        "layout), or WASD/IJKL keys turned into a path (act2cam, Cam model) using the folder's intrinsics."
    )
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (CAMERA, "INT")
    RETURN_NAMES = ("camera", "frame_num")
    OUTPUT_TOOLTIPS = (
        "Camera arrays; the sampler converts them for the chosen size.",
        "Most frames this path can drive (4n+1). An action string sets the length exactly: wire this "
        "into the sampler's frame_num.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "camera_path": ("STRING", {
                    "default": DEFAULT_PATH,
                    "tooltip": "Folder with poses.npy [N,4,4] camera-to-world (OpenCV) and intrinsics.npy [N,4] "
                    "(fx, fy, cx, cy at 480x832); action.npy too for the Act model. Relative paths are looked up "
                    "in this node pack's folder, then in ComfyUI's input folder.",
                }),
            },
            "optional": {
                "action_string": ("STRING", {
                    "default": "",
                    "tooltip": "act2cam keys instead of poses.npy, e.g. 'w-10,a-10,iw-15,none-10' "
                    "(keys w a s d i j k l or none, then frames). Empty = use the poses.",
                }),
                "act2cam_from_files": ("BOOLEAN", {
                    "default": False,
                    "tooltip": "Drive the camera from the folder's wasd_action.npy / ijkl_action.npy (act2cam) "
                    "instead of poses.npy.",
                }),
            },
        }  # fmt: skip

    @classmethod
    def VALIDATE_INPUTS(cls, camera_path=None, action_string=None):
        """Checked when the prompt is queued: the folder exists and the action string parses."""
        try:
            if isinstance(camera_path, str):
                resolve_camera_dir(camera_path)
            if isinstance(action_string, str) and action_string.strip():
                parse_action_string(action_string)
        except (FileNotFoundError, ValueError) as e:
            return str(e)
        return True

    @classmethod
    def IS_CHANGED(cls, camera_path, action_string="", act2cam_from_files=False):
        """Re-run when the folder's .npy files change (ComfyUI otherwise caches on the inputs alone)."""
        try:
            folder = resolve_camera_dir(camera_path)
        except FileNotFoundError:
            return camera_path  # load() reports it
        return ";".join(f"{f.name}:{f.stat().st_mtime_ns}" for f in sorted(folder.glob("*.npy")))

    def load(self, camera_path, action_string="", act2cam_from_files=False):
        folder = resolve_camera_dir(camera_path)
        action_string = action_string.strip() or None
        act2cam = action_string is not None or act2cam_from_files
        files = load_camera_dir(folder, require_poses=not act2cam)
        if act2cam_from_files and action_string is None and "wasd" not in files:
            raise FileNotFoundError(f"act2cam_from_files: {folder / 'wasd_action.npy'} not found")
        cam = CameraInput(
            path=folder,
            intrinsics=files["intrinsics"],
            poses=files.get("poses"),
            actions=files.get("action"),
            wasd=files.get("wasd"),
            ijkl=files.get("ijkl"),
            action_string=action_string,
            act2cam_files=act2cam_from_files and action_string is None,
        )
        return (cam, cam.frames())
