"""Camera nodes: a pose folder (poses.npy + intrinsics.npy), act2cam keys or a preset -> raw arrays;
a preview picture of any of them.

The sampler packs them into the DiT's camera tensor once the video size and the experts' control
type are known (`CameraInput.pack`).
"""

import logging
from pathlib import Path

import folder_paths
import torch

from ..loaders.camera_authoring import camera_path_arrays, preset_camera, save_camera_dir
from ..loaders.camera_files import CameraInput
from ..loaders.camera_preview import render_path
from ..wan import i2v
from ..wan.actions import parse_action_string
from ..wan.camera_presets import DEFAULT_HFOV_DEG, allot_frames, parse_preset
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
                "camera_path": (
                    "STRING",
                    {
                        "default": DEFAULT_PATH,
                        "tooltip": "Folder with poses.npy [N,4,4] camera-to-world (OpenCV) and intrinsics.npy [N,4] "
                        "(fx, fy, cx, cy at 480x832); action.npy too for the Act model. Relative paths are looked up "
                        "in this node pack's folder, then in ComfyUI's input folder.",
                    },
                ),
            },
            "optional": {
                "action_string": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "act2cam keys instead of poses.npy, e.g. 'w-10,a-10,iw-15,none-10' "
                        "(keys w a s d i j k l or none, then frames). Empty = use the poses.",
                    },
                ),
                "act2cam_from_files": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Drive the camera from the folder's wasd_action.npy / ijkl_action.npy (act2cam) "
                        "instead of poses.npy.",
                    },
                ),
            },
        }

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


def preset_save_dir(text: str) -> Path:
    """Where the preset node writes poses.npy + intrinsics.npy: an absolute path as is, a relative one
    under ComfyUI's input folder (where the camera-path node looks)."""
    path = Path(text.strip()).expanduser()
    return path if path.is_absolute() else Path(folder_paths.get_input_directory()) / path


class LingBotCameraPreset:
    DESCRIPTION = (
        "Camera path from a short description: segments like 'pan left 30 40f ease, dolly in 1 40f' "
        "(pan/tilt/roll in degrees, dolly/truck/pedestal in scene units, orbit around a point, zoom, "
        "static; '+' runs motions together). Same output as LingBot Camera Path; can also save the "
        "path as a poses.npy + intrinsics.npy folder."
    )
    CATEGORY = CATEGORY
    FUNCTION = "build"
    RETURN_TYPES = (CAMERA, "INT")
    RETURN_NAMES = ("camera", "frame_num")
    OUTPUT_TOOLTIPS = (
        "Camera poses (OpenCV camera-to-world) and intrinsics, as a pose folder would give them.",
        "Frames of the path (4n+1): wire it into the sampler's frame_num.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "preset": (
                    "STRING",
                    {
                        "multiline": True,
                        "default": "orbit left 30 around 2 + dolly in 0.5 40f ease, pan right 15 40f ease",
                        "tooltip": "Segments separated by ',' or ';', each '<motion> [direction] [amount] [+ more "
                        "motions] [Nf] [easing]'. Motions: pan left|right DEG, tilt up|down DEG, roll left|right "
                        "DEG, dolly in|out UNITS, truck left|right UNITS, pedestal up|down UNITS, orbit left|right "
                        "DEG [around DIST], zoom in|out FACTOR, static. Easing: linear, ease-in, ease-out, "
                        "ease-in-out (ease). Segments without Nf share the frames left.",
                    },
                ),
                "frame_num": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 1601,
                        "step": 1,
                        "tooltip": "Frames of the path, 4n+1. 0 = 81 when a segment has no frame count, else the "
                        "segments' total rounded up to 4n+1 (the last pose is held).",
                    },
                ),
                "speed": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 10.0,
                        "step": 0.05,
                        "tooltip": "Scales every amount (degrees, units, zoom). The model sees translations "
                        "normalised per path (as upstream), so speed mostly changes the rotations.",
                    },
                ),
                "fov": (
                    "FLOAT",
                    {
                        "default": DEFAULT_HFOV_DEG,
                        "min": 10.0,
                        "max": 150.0,
                        "step": 1.0,
                        "tooltip": "Horizontal field of view in degrees, for the intrinsics.",
                    },
                ),
                "width": (
                    "INT",
                    {
                        "default": 832,
                        "min": 16,
                        "max": 4096,
                        "step": 16,
                        "tooltip": "Video width the intrinsics are meant for (square pixels at width x height); "
                        "stored at 480x832 as upstream's intrinsics.npy.",
                    },
                ),
                "height": (
                    "INT",
                    {
                        "default": 480,
                        "min": 16,
                        "max": 4096,
                        "step": 16,
                        "tooltip": "Video height the intrinsics are meant for.",
                    },
                ),
            },
            "optional": {
                "save_folder": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Also write poses.npy + intrinsics.npy here (relative = under ComfyUI's input "
                        "folder, where LingBot Camera Path finds it). Existing files there are replaced. Empty = "
                        "don't save.",
                    },
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, preset=None, frame_num=None):
        """Checked when the prompt is queued: the preset parses and its frames fit."""
        if isinstance(preset, str):
            try:
                segments = parse_preset(preset)
                if isinstance(frame_num, int):
                    allot_frames(segments, frame_num or None, preset)
            except ValueError as e:
                return str(e)
        return True

    def build(self, preset, frame_num, speed, fov, width, height, save_folder=""):
        cam, path = preset_camera(preset, frame_num or None, speed, (height, width), fov)
        if save_folder.strip():
            folder = save_camera_dir(
                preset_save_dir(save_folder), path.poses, path.intrinsics, overwrite=True
            )
            log.info("LingBot-World camera preset saved to %s", folder)
        return (cam, path.frame_num)


class LingBotCameraPreview:
    DESCRIPTION = (
        "Draws a camera path (a pose folder, act2cam keys or a preset) before sampling: top-down and side "
        "views of the camera centres with frustum glyphs, coloured by time, a dot every 4 frames."
    )
    CATEGORY = CATEGORY
    FUNCTION = "render"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("preview",)
    OUTPUT_TOOLTIPS = ("The picture [1, H, W, 3]; feed Preview Image or Save Image.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "camera": (CAMERA, {"tooltip": "From LingBot Camera Path or LingBot Camera Preset."}),
                "frame_num": (
                    "INT",
                    {
                        "default": 81,
                        "min": 1,
                        "max": 1601,
                        "step": 4,
                        "tooltip": "Frames the sampler will generate (4n+1); a pose file is drawn up to there. Wire "
                        "the camera node's frame_num. Action strings and presets set their own length.",
                    },
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, frame_num=None):
        if frame_num is not None:
            return i2v.frame_num_issue(frame_num) or True
        return True

    def render(self, camera, frame_num):
        poses, intrinsics = camera_path_arrays(camera, frame_num)
        image = render_path(poses, intrinsics, title=str(camera.path))
        return (torch.from_numpy(image).float().div(255.0)[None],)
