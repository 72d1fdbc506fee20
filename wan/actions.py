"""act2cam: WASD/IJKL keyboard actions -> synthetic camera-to-world poses for the Cam model.

Upstream (`--allow_act2cam`, `--action_string`) integrates one pose per video frame, starting at
identity, with this motion model (OpenCV axes: x right, y down, z forward; the world frame is the
first camera's):
- i / k: pitch +/-2 deg about the camera's own x axis (right-multiplied). +x rotation turns the
  view towards -y, i.e. i looks up. A step that would leave [-85, 85] deg is dropped, so from
  level the pitch stops at +/-84 deg.
- j / l: yaw -/+2 deg about the world y axis (left-multiplied); l turns the view towards +x
  (right), j towards -x (left).
- w / s: move +/-0.05 along the camera's forward axis with its y component removed (x-z plane);
  d / a: +/-0.05 along the right axis flattened the same way. The flattened vector is divided by
  (norm + 1e-6), so a step is 0.05 / (1 + 1e-6) long, as upstream.
Rotation is applied first, then the move uses the new orientation. Keys count as pressed where the
action value is > 0.5. Intrinsics are not synthesised: upstream reads intrinsics.npy from
--action_path even for --action_string, and so must our callers.
"""

import re
from typing import NamedTuple

import numpy as np

from .camera import validate_actions
from .config import SampleConfig
from .i2v import latent_frames, pad_frame_num

MOVE_STEP = 0.05
ROTATE_STEP_DEG = 2.0
PITCH_LIMIT_DEG = 85.0
KEY_THRESHOLD = 0.5
WASD = "wasd"  # column order of wasd_action.npy
IJKL = "ijkl"  # column order of ijkl_action.npy
_SEGMENT_COUNT = re.compile(r"[0-9]+")


def parse_action_string(action_string: str) -> tuple[np.ndarray, np.ndarray]:
    """DSL like `w-10,a-10,iw-15,none-10` -> (wasd [F, 4], ijkl [F, 4]) float32 0/1, unpadded.

    Each comma-separated segment is `<keys>-<frames>` (split at the last '-'); keys are any of
    w a s d i j k l (case-insensitive) or `none`. Whitespace is ignored and a full-width comma is
    accepted, as upstream. An empty key part (`-5`) means no keys, also as upstream.
    """
    if not isinstance(action_string, str):
        raise ValueError(f"action_string: expected a string, got {type(action_string).__name__}")
    s = "".join(action_string.replace("，", ",").split())
    if not s:
        raise ValueError("action_string: empty; expected segments like 'w-10,iw-15,none-10'")
    rows = []
    for part in s.split(","):
        if not part:
            raise ValueError(f"action_string: empty segment in {s!r} (check the commas)")
        keys, sep, count = part.rpartition("-")
        if not sep:
            raise ValueError(
                f"action_string: segment {part!r} is not <keys>-<frames>, e.g. 'w-3' or 'none-5'"
            )
        if not _SEGMENT_COUNT.fullmatch(count) or int(count) <= 0:
            raise ValueError(
                f"action_string: segment {part!r} has frame count {count!r}; expected a positive integer"
            )
        keys = keys.lower()
        if keys == "none":
            keys = ""
        bad = sorted({c for c in keys if c not in WASD + IJKL})
        if bad:
            raise ValueError(
                f"action_string: unknown key(s) {bad} in segment {part!r}; allowed: w a s d i j k l, none"
            )
        row = np.array([[c in keys for c in WASD + IJKL]], dtype=np.float32)
        rows.append(np.repeat(row, int(count), axis=0))
    keys = np.concatenate(rows)
    return keys[:, :4], keys[:, 4:]


def _rot_x(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _rot_y(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _flat_unit(v: np.ndarray) -> np.ndarray:
    flat = np.array([v[0], 0.0, v[2]])
    n = np.linalg.norm(flat)
    return flat / (n + 1e-6) if n > 0 else flat


class CameraRig:
    """act2cam's motion model as a state that steps one video frame at a time (the one pose integrator:
    `actions_to_poses` here, the CLI's steering keys and live play all step it).

    `step(d_yaw, d_pitch, forward, right, up)`: turn by d_yaw (about the world y axis, + turns right) and
    d_pitch (about the camera's x axis, + looks up; a step leaving [-85, 85] deg is dropped), then move
    forward/right along the new orientation's flattened axes and up along world -y, each in units of
    MOVE_STEP; returns the new c2w [4, 4] float64."""

    def __init__(self):
        self.rot, self.pos, self.pitch = np.eye(3), np.zeros(3), 0.0

    def pose(self) -> np.ndarray:
        c2w = np.eye(4)
        c2w[:3, :3], c2w[:3, 3] = self.rot, self.pos
        return c2w

    def step(self, d_yaw=0.0, d_pitch=0.0, forward=0.0, right=0.0, up=0.0) -> np.ndarray:
        limit = np.deg2rad(PITCH_LIMIT_DEG)
        if -limit <= self.pitch + d_pitch <= limit:
            self.pitch += d_pitch
        else:
            d_pitch = 0.0
        self.rot = _rot_y(d_yaw) @ self.rot @ _rot_x(d_pitch)
        move = np.zeros(3)
        if forward:
            move += _flat_unit(self.rot[:, 2]) * (MOVE_STEP * forward)
        if right:
            move += _flat_unit(self.rot[:, 0]) * (MOVE_STEP * right)
        if up:
            move += np.array([0.0, -MOVE_STEP * up, 0.0])
        self.pos = self.pos + move
        return self.pose()


def actions_to_poses(wasd, ijkl=None) -> np.ndarray:
    """Per-frame keys wasd [F, 4] (and ijkl [F, 4], None = no turning) -> float64 c2w [F+1, 4, 4]."""
    wasd = validate_actions(wasd, "wasd") > KEY_THRESHOLD
    ijkl = np.zeros_like(wasd) if ijkl is None else validate_actions(ijkl, "ijkl") > KEY_THRESHOLD
    if len(ijkl) != len(wasd):
        raise ValueError(f"ijkl: expected as many rows as wasd ({len(wasd)}), got {len(ijkl)}")
    step = np.deg2rad(ROTATE_STEP_DEG)
    rig = CameraRig()
    poses = np.tile(np.eye(4), (len(wasd) + 1, 1, 1))
    for f, ((w, a, s, d), (look_up, turn_left, look_down, turn_right)) in enumerate(
        zip(wasd, ijkl, strict=True), start=1
    ):
        poses[f] = rig.step(
            step * (int(turn_right) - int(turn_left)),
            step * (int(look_up) - int(look_down)),
            int(w) - int(s),
            int(d) - int(a),
        )
    return poses


def action_string_frames(action_string: str) -> int:
    """The video length (4n+1) an action string fixes: its frames padded with no-key frames, as
    `act2cam_trajectory` pads them; found without integrating the poses (a long string is refused on its length
    before any pose is made)."""
    return pad_frame_num(len(parse_action_string(action_string)[0]))


class Act2Cam(NamedTuple):
    poses: np.ndarray  # [frame_num + 1, 4, 4] float64 c2w; pass to camera_conditioning(act2cam=True)
    wasd: np.ndarray  # [frame_num, 4] keys per video frame, no-key padding included
    ijkl: np.ndarray  # [frame_num, 4]
    frame_num: int  # video frames, 4n+1


def act2cam_trajectory(
    action_string: str | None = None, wasd=None, ijkl=None, frame_num: int | None = None
) -> Act2Cam:
    """Keys from `action_string` or from wasd/ijkl arrays (wasd_action.npy/ijkl_action.npy) -> poses.

    String: its frame total is padded with no-key frames to 4n+1, which sets frame_num (a given
    frame_num must equal it, as upstream's CLI insists). Arrays: the first frame_num rows are used
    (default SampleConfig.frame_num = 81); ijkl may be None (examples 03/04 ship no ijkl file).
    """
    if action_string is not None:
        if wasd is not None or ijkl is not None:
            raise ValueError("action_string: give either an action string or wasd/ijkl arrays, not both")
        wasd, ijkl = parse_action_string(action_string)
        padded = pad_frame_num(len(wasd))
        if frame_num is not None and frame_num != padded:
            raise ValueError(
                f"frame_num: {frame_num} must equal the action_string's {len(wasd)} frames padded to 4n+1 "
                f"({padded}), or be left unset"
            )
        frame_num = padded
        pad = ((0, frame_num - len(wasd)), (0, 0))
        wasd, ijkl = np.pad(wasd, pad), np.pad(ijkl, pad)
    else:
        if wasd is None:
            raise ValueError("wasd: give an action_string or a [N, 4] wasd array (wasd_action.npy)")
        frame_num = SampleConfig.frame_num if frame_num is None else frame_num
        latent_frames(frame_num)  # raises unless 4n+1
        wasd = validate_actions(wasd, "wasd", min_rows=frame_num)[:frame_num]
        if ijkl is not None:
            ijkl = validate_actions(ijkl, "ijkl", min_rows=frame_num)[:frame_num]
        else:
            ijkl = np.zeros_like(wasd)
    return Act2Cam(actions_to_poses(wasd, ijkl), wasd, ijkl, frame_num)
