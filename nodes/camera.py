"""Camera node: a pose folder (poses.npy + intrinsics.npy) or act2cam keys -> raw arrays.

The sampler packs them into the DiT's camera tensor once the video size and the experts' control
type are known (`CameraInput.pack`).
"""

import logging
from pathlib import Path

import folder_paths

from ..loaders.camera_files import CameraInput
from ..wan.actions import parse_action_string
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
        cam = CameraInput.from_dir(folder, action_string, act2cam_from_files)
        return (cam, cam.frames())
