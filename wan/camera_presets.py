"""Camera presets: a short motion description -> camera-to-world poses + intrinsics (upstream's layout).

A preset is a chain of segments separated by ',' or ';'. A segment is one or more motions joined by
'+' (they run together), then optionally a frame count (`40f`) and an easing
(`linear`, `ease-in`, `ease-out`, `ease-in-out` or `ease`):

    pan left 30 40f ease; dolly in 1.5 + pedestal up 0.2 40f
    orbit left 45 around 2 80f ease-in-out
    static 20f, tilt up 10 60f ease-out

Motions (amounts may be negative; a missing amount takes the default in `DEFAULT_AMOUNT`):
- `pan left|right DEG`: turn about the vertical axis, camera centre fixed.
- `tilt up|down DEG`, `roll left|right DEG` (right = clockwise seen from behind the camera):
  about the camera's own x / z axis, centre fixed.
- `dolly in|out UNITS` (along the view axis), `truck left|right UNITS` (along the camera's x axis),
  `pedestal up|down UNITS` (along the vertical axis).
- `orbit left|right DEG [around DIST]`: circle the point DIST units ahead of the camera about the
  vertical axis through it, still looking the same way relative to it (distance kept).
- `zoom in|out FACTOR`: multiply (in) or divide (out) the focal length by FACTOR.
- `static`: hold the pose.

Axes are upstream's OpenCV convention (x right, y down, z forward); the world frame is the first
camera's, so the vertical axis is -y and the path starts at the identity pose. Within a segment the
moves use the segment's starting orientation turned by the segment's pan/orbit so far, so `orbit +
dolly in` spirals towards the orbit centre. Frame counts are steps between poses; segments without
one share the frames left, and frames left over at the end hold the last pose. Upstream normalises
the camera translations of a path (its fastest step counts as 1), so only relative speeds of the
moves reach the model; rotations keep their degrees. Upstream's conditioning reads the first row of
the intrinsics only, so a zoom shows in the saved intrinsics and the preview, not in the video.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

# scipy and torch (through .i2v) load on first use: `lingbot.py camera --help` shows this module's
# docstring without them
from .config import INTRINSICS_SIZE, SampleConfig

UP = np.array([0.0, -1.0, 0.0])  # world vertical in OpenCV axes (y points down)
DEFAULT_HFOV_DEG = 80.0  # close to upstream's examples/00 (fx = 503 px at 832 wide)
DEFAULT_ORBIT_DISTANCE = 1.0
MAX_FRAMES = 1601

# kind -> {direction word: sign}; the first word listed is the positive one
DIRECTIONS = {
    "pan": {"right": 1.0, "left": -1.0},
    "tilt": {"up": 1.0, "down": -1.0},
    "roll": {"right": 1.0, "cw": 1.0, "left": -1.0, "ccw": -1.0},
    "dolly": {"in": 1.0, "forward": 1.0, "out": -1.0, "back": -1.0},
    "truck": {"right": 1.0, "left": -1.0},
    "pedestal": {"up": 1.0, "down": -1.0},
    "orbit": {"left": 1.0, "right": -1.0},
    "zoom": {"in": 1.0, "out": -1.0},
}
DEFAULT_AMOUNT = {
    "pan": 30.0,
    "tilt": 15.0,
    "roll": 15.0,
    "dolly": 1.0,
    "truck": 1.0,
    "pedestal": 0.5,
    "orbit": 45.0,
    "zoom": 1.5,
}
UNITS = {
    "pan": "degrees",
    "tilt": "degrees",
    "roll": "degrees",
    "orbit": "degrees",
    "dolly": "units",
    "truck": "units",
    "pedestal": "units",
    "zoom": "a focal factor > 0",
}
EASINGS = {
    "linear": lambda t: t,
    "ease-in": lambda t: t * t,
    "ease-out": lambda t: 1.0 - (1.0 - t) ** 2,
    "ease-in-out": lambda t: 0.5 - 0.5 * math.cos(math.pi * t),
}
EASING_ALIASES = {
    "ease": "ease-in-out",
    "smooth": "ease-in-out",
    "ease_in": "ease-in",
    "ease_out": "ease-out",
    "ease_in_out": "ease-in-out",
    "easein": "ease-in",
    "easeout": "ease-out",
}
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?(?:deg|°|u|x)?$")
_FRAMES = re.compile(r"(\d+)f$")


@dataclass(frozen=True)
class Motion:
    kind: str  # a DIRECTIONS key or 'static'
    amount: float = 0.0  # signed: degrees, units, or for zoom the focal factor's log
    distance: float = DEFAULT_ORBIT_DISTANCE  # orbit only


@dataclass(frozen=True)
class Segment:
    motions: tuple
    frames: int | None = None
    easing: str = "linear"


@dataclass(frozen=True)
class PresetPath:
    """A built path: `poses` [N, 4, 4] float32 c2w (OpenCV), `intrinsics` [N, 4] float32 (fx, fy, cx, cy)
    at 480x832 pixels, N = frame_num (4n+1)."""

    poses: np.ndarray
    intrinsics: np.ndarray
    frame_num: int
    description: str


def _err(text: str, message: str) -> ValueError:
    return ValueError(f"camera preset {text!r}: {message}")


def _number(token: str) -> float | None:
    if not _NUMBER.match(token):
        return None
    return float(re.sub(r"(deg|°|u|x)$", "", token))


def _parse_motion(words: list, text: str) -> Motion:
    kind = words[0]
    if kind == "static":
        if len(words) > 1:
            raise _err(text, f"'static' takes no arguments, got {' '.join(words)!r}")
        return Motion("static")
    if kind not in DIRECTIONS:
        raise _err(text, f"unknown motion {kind!r}; expected one of static, {', '.join(DIRECTIONS)}")
    rest = words[1:]
    sign = 1.0
    if rest and rest[0] in DIRECTIONS[kind]:
        sign = DIRECTIONS[kind][rest.pop(0)]
    elif rest and _number(rest[0]) is None:
        raise _err(text, f"{kind}: unknown direction {rest[0]!r}; expected {' or '.join(DIRECTIONS[kind])}")
    amount = DEFAULT_AMOUNT[kind]
    if rest and _number(rest[0]) is not None:
        amount = _number(rest.pop(0))
    distance = DEFAULT_ORBIT_DISTANCE
    if kind == "orbit" and rest and rest[0] in ("around", "at", "distance", "radius"):
        rest.pop(0)
        value = _number(rest.pop(0)) if rest else None
        if value is None or value <= 0:
            raise _err(text, "orbit: 'around' needs a positive distance, e.g. 'orbit left 30 around 2'")
        distance = value
    if rest:
        raise _err(text, f"{kind}: unexpected {' '.join(rest)!r} (amount in {UNITS[kind]})")
    if not math.isfinite(amount):
        raise _err(text, f"{kind}: amount must be finite, got {amount}")
    if kind == "zoom":
        if amount <= 0:
            raise _err(text, f"zoom: expected a focal factor > 0 (e.g. 'zoom in 1.5'), got {amount:g}")
        return Motion(kind, sign * math.log(amount))
    return Motion(kind, sign * amount, distance)


def parse_preset(text: str) -> list:
    """Preset text -> [Segment]; ValueError names the preset and the offending part."""
    if not isinstance(text, str):
        raise ValueError(f"camera preset: expected a string, got {type(text).__name__}")
    cleaned = text.replace("，", ",").replace("；", ";").strip().lower()
    if not cleaned:
        raise _err(text, "empty; expected e.g. 'pan left 30 40f ease, dolly in 1 40f'")
    segments = []
    for part in re.split(r"[,;\n]", cleaned):
        words = part.split()
        if not words:
            raise _err(text, "empty segment (check the commas/semicolons)")
        frames, easing = None, "linear"
        while words and (_FRAMES.match(words[-1]) or words[-1] in EASINGS or words[-1] in EASING_ALIASES):
            last = words.pop()
            m = _FRAMES.match(last)
            if m:
                if frames is not None:
                    raise _err(text, f"segment {part.strip()!r} has two frame counts")
                frames = int(m.group(1))
                if frames < 1:
                    raise _err(text, f"segment {part.strip()!r}: frame count must be >= 1")
            else:
                easing = EASING_ALIASES.get(last, last)
        if not words:
            raise _err(text, f"segment {part.strip()!r} has no motion")
        groups = " ".join(words).replace("+", " + ").split(" + ")
        motions = tuple(_parse_motion(g.split(), text) for g in groups if g.strip())
        if not motions:
            raise _err(text, f"segment {part.strip()!r} has no motion")
        segments.append(Segment(motions, frames, easing))
    return segments


def _rot(axis, degrees: float) -> np.ndarray:
    from scipy.spatial.transform import Rotation

    return Rotation.from_rotvec(np.asarray(axis, dtype=np.float64) * math.radians(degrees)).as_matrix()


def _yaw(degrees: float) -> np.ndarray:
    """Rotation about the world's +y axis (down): positive turns the view from +z towards +x (right)."""
    return _rot([0.0, 1.0, 0.0], degrees)


def segment_pose(seg: Segment, R0: np.ndarray, c0: np.ndarray, zoom0: float, f: float, speed: float):
    """(R, c, log focal factor) after fraction f (already eased) of `seg`, from (R0, c0, zoom0)."""
    yaw = np.eye(3)
    centre = c0.copy()
    for m in seg.motions:  # orbits and pans: about vertical axes
        if m.kind == "orbit":
            turn = _yaw(m.amount * speed * f)
            target = c0 + m.distance * R0[:, 2]
            centre = target + turn @ (centre - target)
            yaw = turn @ yaw
        elif m.kind == "pan":
            yaw = _yaw(m.amount * speed * f) @ yaw
    R = yaw @ R0
    move_frame = R.copy()
    zoom = zoom0
    for m in seg.motions:
        a = m.amount * speed * f
        if m.kind == "tilt":
            R = R @ _rot([1.0, 0.0, 0.0], a)
        elif m.kind == "roll":
            R = R @ _rot([0.0, 0.0, 1.0], a)
        elif m.kind == "dolly":
            centre = centre + a * move_frame[:, 2]
        elif m.kind == "truck":
            centre = centre + a * move_frame[:, 0]
        elif m.kind == "pedestal":
            centre = centre + a * UP
        elif m.kind == "zoom":
            zoom = zoom0 + a
    return R, centre, zoom


def allot_frames(segments: list, frame_num: int | None, text: str = "") -> tuple[list, int, int]:
    """(steps per segment, frame_num, held steps at the end). frame_num None: 81 when a segment has no
    count, else the counts' total rounded up to 4n+1."""
    from .i2v import frame_num_issue

    fixed = sum(s.frames for s in segments if s.frames is not None)
    free = [i for i, s in enumerate(segments) if s.frames is None]
    if frame_num is None:
        frame_num = SampleConfig.frame_num if free else 4 * math.ceil(fixed / 4) + 1
    issue = frame_num_issue(frame_num) if isinstance(frame_num, int) else "frame_num must be an integer"
    if issue:
        raise _err(text, issue)
    if not 5 <= frame_num <= MAX_FRAMES:
        raise _err(text, f"frame_num: expected 5 to {MAX_FRAMES} frames, got {frame_num}")
    steps = frame_num - 1
    if fixed > steps:
        raise _err(
            text,
            f"the segments' frame counts add up to {fixed}, more than the {steps} steps of "
            f"{frame_num} frames; lower them or ask for more frames",
        )
    left = steps - fixed
    counts = [s.frames for s in segments]
    if free:
        if left < len(free):
            raise _err(text, f"{left} frames left for {len(free)} segment(s) without a frame count")
        for j, i in enumerate(free):
            counts[i] = left // len(free) + (1 if j < left % len(free) else 0)
        left = 0
    return counts, frame_num, left


def build_preset(
    text: str,
    frame_num: int | None = None,
    speed: float = 1.0,
    size: tuple = INTRINSICS_SIZE,
    hfov_deg: float = DEFAULT_HFOV_DEG,
) -> PresetPath:
    """Preset text -> PresetPath. `speed` scales every amount (degrees, units, zoom); `size` (H, W) is the
    frame the focal length is meant for (square pixels there), stored rescaled to 480x832 as upstream's
    intrinsics.npy; `hfov_deg` the horizontal field of view."""
    if (
        isinstance(speed, bool)
        or not isinstance(speed, (int, float))
        or not math.isfinite(speed)
        or speed < 0
    ):
        raise _err(text, f"speed: expected a finite number >= 0, got {speed!r}")
    issue = fov_issue(hfov_deg)
    if issue:
        raise _err(text, issue)
    h, w = (int(v) for v in size)
    if h < 16 or w < 16:
        raise _err(text, f"size must be at least 16x16 pixels, got {h}x{w}")
    segments = parse_preset(text)
    counts, frame_num, hold = allot_frames(segments, frame_num, text)
    R, c, zoom = np.eye(3), np.zeros(3), 0.0
    rots, centres, zooms = [R], [c], [zoom]
    for seg, n in zip(segments, counts, strict=True):
        ease = EASINGS[seg.easing]
        for k in range(1, n + 1):
            rots_k, c_k, z_k = segment_pose(seg, R, c, zoom, ease(k / n), speed)
            rots.append(rots_k)
            centres.append(c_k)
            zooms.append(z_k)
        R, c, zoom = rots[-1], centres[-1], zooms[-1]
    for _ in range(hold):
        rots.append(R), centres.append(c), zooms.append(zoom)
    poses = np.tile(np.eye(4), (len(rots), 1, 1))
    poses[:, :3, :3] = np.stack(rots)
    poses[:, :3, 3] = np.stack(centres)
    intrinsics = preset_intrinsics(np.exp(np.array(zooms)), (h, w), hfov_deg)
    return PresetPath(poses.astype(np.float32), intrinsics, frame_num, text.strip())


def fov_issue(hfov_deg) -> str | None:
    """None if `hfov_deg` is a usable horizontal field of view, else what is wrong with it."""
    if isinstance(hfov_deg, bool) or not isinstance(hfov_deg, (int, float)) or not 1.0 <= hfov_deg <= 170.0:
        return f"fov: expected a horizontal field of view in [1, 170] degrees, got {hfov_deg!r}"
    return None


def preset_intrinsics(
    focal_factor: np.ndarray, size: tuple, hfov_deg: float = DEFAULT_HFOV_DEG
) -> np.ndarray:
    """[N, 4] (fx, fy, cx, cy) at 480x832 for square pixels at `size` (H, W), principal point centred."""
    issue = fov_issue(hfov_deg)
    if issue:
        raise ValueError(issue)
    h, w = size
    ref_h, ref_w = INTRINSICS_SIZE
    focal = (w / 2) / math.tan(math.radians(hfov_deg) / 2) * np.asarray(focal_factor, dtype=np.float64)
    out = np.empty((len(focal), 4))
    out[:, 0] = focal * ref_w / w
    out[:, 1] = focal * ref_h / h
    out[:, 2] = ref_w / 2
    out[:, 3] = ref_h / 2
    return out.astype(np.float32)
