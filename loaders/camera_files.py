"""Read an upstream example/action folder (poses.npy, intrinsics.npy, action files) into arrays.

Every file goes through np.load(allow_pickle=False) and the shape checks of `wan.camera`, so an
error names the offending file.
"""

from pathlib import Path

import numpy as np

from ..wan.camera import validate_actions, validate_intrinsics, validate_poses

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

    require_poses=False suits act2cam with an action string, which needs only intrinsics.npy.
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
    return out
