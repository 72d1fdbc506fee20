"""Input -> camera: keys and mouse integrated into camera-to-world poses per latent frame, chunk by chunk.

One integrator serves live play (key/mouse events with timestamps) and the CLI's `fast --keys` lines (the keys
held through each chunk). The motion model is act2cam's (`wan.actions.CameraRig`, stepped once per video
frame, OpenCV axes, the world frame is the rollout's first camera):
- W/S forward/back, D/A right/left along the heading flattened to the ground plane, E/Q up/down (world -y/+y),
  each 0.05 per video frame (`MOVE_STEP`); Shift runs at `RUN` times that.
- Arrows look at act2cam's 2 deg per video frame (32 deg/s at 16 fps): left/right turn about the world's
  vertical, up/down pitch (stopping at +/-85 deg). The CLI's i j k l are up, left, down, right.
- Mouse drag looks: `MOUSE_DEG_PER_PX` per pixel (right turns right, up looks up), spread over the latent
  frame's video frames; arrows and mouse together turn at most the arrows' rate per video frame.
- Latent frame i of a rollout sits on the pose at video frame 4i: the first latent frame is the identity;
  each later one steps the rig 4 times with its slot's input. The camera tensor is framewise relative with
  translations in units of `KEY_STEP` (one walk key held for a latent frame is 1, as upstream's per-clip
  normalisation makes a walk), packed as base-cam rays (`wan.fast_camera.pack_camera`).

Timing of events (`Controls.slots`): the input gathered since the last chunk (the window from the previous
`slots` call to now) is split into the new chunk's latent frames in time order.
- `history`: each key edge lands in the latent frame in whose part of the window it happened; a key counts
  in a latent frame if it is down at the frame's end or was pressed within it (a tap counts once).
- `hold`: every key down when the chunk starts, or pressed during the window (a tap), acts from the chunk's
  first latent frame; taps only in that first frame, held keys in all.
Mouse motion lands like key edges in `history` and is spread evenly over the chunk in `hold`. Unknown key
names are ignored.
"""

import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..wan.actions import MOVE_STEP, ROTATE_STEP_DEG, CameraRig
from ..wan.camera import se3_inverse, validate_intrinsics
from ..wan.config import VAE_STRIDE
from ..wan.fast import CHUNK_FRAMES
from ..wan.fast_camera import KEY_STEP, chunk_key_rows, pack_camera, parse_keys_line

RUN = 2.0  # Shift: move this many times the walk step
LOOK_STEP = float(np.deg2rad(ROTATE_STEP_DEG))  # radians per video frame for an arrow key
MOUSE_DEG_PER_PX = 0.1
MODES = ("history", "hold")
KEYS = ("w", "a", "s", "d", "shift", "q", "e", "up", "down", "left", "right")
_ALIASES = {
    "arrowup": "up",
    "arrowdown": "down",
    "arrowleft": "left",
    "arrowright": "right",
    "shiftleft": "shift",
    "shiftright": "shift",
    "i": "up",
    "j": "left",
    "k": "down",
    "l": "right",
}


def key_name(name) -> str | None:
    """A browser's `KeyboardEvent.code` or `.key` ('KeyW', 'w', 'ArrowUp', 'ShiftLeft') or a CLI letter (i j k
    l) -> one of KEYS; None for anything else (ignored)."""
    if not isinstance(name, str):
        return None
    n = name.strip().lower()
    if n.startswith("key") and len(n) == 4:
        n = n[3]
    n = _ALIASES.get(n, n)
    return n if n in KEYS else None


@dataclass(frozen=True)
class Slot:
    """The input of one latent frame: keys that count in it and mouse pixels moved."""

    keys: frozenset = frozenset()
    dx: float = 0.0
    dy: float = 0.0


def _motion(slot: Slot, steps: int) -> tuple[float, float, float, float, float]:
    """(d_yaw, d_pitch, forward, right, up) per video frame for a slot stepped `steps` times."""
    k = slot.keys
    on = lambda name: 1.0 if name in k else 0.0  # noqa: E731
    mouse = np.deg2rad(MOUSE_DEG_PER_PX) / steps
    yaw = float(np.clip(LOOK_STEP * (on("right") - on("left")) + mouse * slot.dx, -LOOK_STEP, LOOK_STEP))
    pitch = float(np.clip(LOOK_STEP * (on("up") - on("down")) - mouse * slot.dy, -LOOK_STEP, LOOK_STEP))
    speed = RUN if "shift" in k else 1.0
    return yaw, pitch, speed * (on("w") - on("s")), speed * (on("d") - on("a")), speed * (on("e") - on("q"))


class PoseTrack:
    """A rollout's latent-frame poses, grown one chunk of slots at a time (absolute c2w float64)."""

    def __init__(self):
        self.rig = CameraRig()
        self.poses: list[np.ndarray] = []
        self.video: list[np.ndarray] = []  # every video frame's pose (poses are every 4th)

    def advance(self, slots) -> np.ndarray:
        """Latent frames for `slots` (the first latent frame of a rollout takes none: give one slot fewer for
        the first chunk); returns the chunk's absolute poses [n, 4, 4], n = len(slots) (+1 at the start)."""
        new = []
        if not self.poses:
            new.append(self.rig.pose())
            self.video.append(new[0])
        for slot in slots:
            steps = VAE_STRIDE[0]
            motion = _motion(slot, steps)
            for _ in range(steps):
                pose = self.rig.step(*motion)
                self.video.append(pose)
            new.append(pose)
        self.poses.extend(new)
        return np.stack(new)

    def relative(self, start: int, end: int) -> torch.Tensor:
        """Framewise relative c2w float32 [end - start, 4, 4] of latent frames start..end-1 (the rollout's first
        is the identity), translations in KEY_STEP units."""
        poses = torch.from_numpy(np.stack(self.poses)).float()
        rel = []
        for i in range(start, end):  # each frame from its own two poses: a prefix never changes
            if i == 0:
                rel.append(torch.eye(4))
            else:
                rel.append(torch.matmul(se3_inverse(poses[i - 1 : i]), poses[i : i + 1])[0])
        c2w = torch.stack(rel)
        c2w[:, :3, 3] /= KEY_STEP
        return c2w


class Controls:
    """Live input (thread-safe): `key(name, down, t)` and `look(dx, dy, t)` with t on one clock (seconds or a
    frame index); `slots(t, n)` turns what arrived since the last call into n latent-frame slots."""

    def __init__(self, mode: str = "history", t0: float = 0.0):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._events: list = []  # (t, 'down'|'up'|'look', key or (dx, dy))
        self._t0 = t0
        self.landed: list[tuple[float, int]] = []  # (event time, slot) of the events the last `slots` took

    def key(self, name, down: bool, t: float) -> bool:
        """A key edge; False (and nothing recorded) for a key that drives nothing."""
        k = key_name(name)
        if k is None:
            return False
        with self._lock:
            self._events.append((float(t), "down" if down else "up", k))
        return True

    def look(self, dx: float, dy: float, t: float) -> None:
        """Mouse drag by (dx, dy) pixels."""
        dx, dy = float(dx), float(dy)
        if np.isfinite(dx) and np.isfinite(dy):
            with self._lock:
                self._events.append((float(t), "look", (dx, dy)))

    def release_all(self) -> None:
        with self._lock:
            self._held.clear()
            self._events.clear()

    def slots(self, t: float, n: int) -> list[Slot]:
        """The input from the previous call's t to `t` as n latent-frame slots (events after t wait)."""
        with self._lock:
            events = sorted((e for e in self._events if e[0] <= t), key=lambda e: e[0])
            self._events = [e for e in self._events if e[0] > t]
            t0, self._t0 = self._t0, t
        self.landed = []
        if n <= 0:
            return []
        span = max(t - t0, 1e-12)
        held = self._held
        if self.mode == "hold":
            self.landed = [(e[0], 0) for e in events]
            tapped, dx, dy = _apply(events, held)
            first = Slot(frozenset(held | tapped), dx / n, dy / n)
            return [first] + [Slot(frozenset(held), dx / n, dy / n)] * (n - 1)
        out = []
        i = 0
        for s in range(n):
            end = t0 + span * (s + 1) / n
            j = i
            while j < len(events) and (events[j][0] <= end or s == n - 1):
                j += 1
            pressed, dx, dy = _apply(events[i:j], held)
            self.landed += [(e[0], s) for e in events[i:j]]
            i = j
            out.append(Slot(frozenset(held | pressed), dx, dy))
        return out


def _apply(events, held: set) -> tuple[set, float, float]:
    """Input events (time, "down"|"up"|"look", key or (dx, dy)) applied in order to the `held` keys: (the
    keys pressed among them, the looks' summed dx, dy)."""
    pressed, dx, dy = set(), 0.0, 0.0
    for _, kind, what in events:
        if kind == "down":
            held.add(what)
            pressed.add(what)
        elif kind == "up":
            held.discard(what)
        else:
            dx, dy = dx + what[0], dy + what[1]
    return pressed, dx, dy


class ChunkCamera:
    """A rollout's camera, chunk by chunk: `next(slots)` -> (the chunk's packed camera [1, 384, chunk, lat_h,
    lat_w], its absolute latent poses). size: (lat_h, lat_w, h, w); intrinsics: [N, 4] at 480x832."""

    def __init__(self, size, intrinsics, chunk: int, dtype=torch.bfloat16, device="cpu"):
        self.size, self.chunk, self.dtype, self.device = size, chunk, dtype, device
        self.intrinsics = validate_intrinsics(intrinsics)
        self.track = PoseTrack()

    @property
    def chunks(self) -> int:
        return len(self.track.poses) // self.chunk

    def slots_needed(self) -> int:
        """Slots the next chunk takes: chunk - 1 for a rollout's first (its first frame is the image)."""
        return self.chunk - 1 if not self.track.poses else self.chunk

    def next(self, slots) -> tuple[torch.Tensor, np.ndarray]:
        k = self.chunks
        poses = self.track.advance(slots)
        return self.camera(k), poses

    def camera(self, k: int) -> torch.Tensor:
        if not 0 <= k < self.chunks:
            raise ValueError(f"chunk {k}: input is known for chunks 0..{self.chunks - 1}")
        return self._pack(k * self.chunk, (k + 1) * self.chunk)

    def _pack(self, start: int, end: int) -> torch.Tensor:
        c2w = self.track.relative(start, end)
        return pack_camera(c2w, self.intrinsics, self.size, "cam", None, self.dtype, self.device)

    def full_camera(self) -> torch.Tensor:
        """The whole path so far at once: [1, 384, chunk * chunks, lat_h, lat_w]."""
        return self._pack(0, self.chunks * self.chunk)

    def latent_poses(self) -> torch.Tensor:
        """Absolute c2w float32 [chunk * chunks, 4, 4] of the path so far."""
        return torch.from_numpy(np.stack(self.track.poses)).float()


def row_slot(row) -> Slot:
    """A keys line's [8] row (w a s d i j k l, parse_keys_line) -> the slot it holds."""
    row = np.asarray(row, dtype=np.float32).reshape(8)
    names = ("w", "a", "s", "d", "up", "left", "down", "right")
    return Slot(frozenset(n for n, v in zip(names, row, strict=True) if v > 0.5))


class KeySteering(ChunkCamera):
    """The CLI's `--keys` lines: one line's keys held through a whole chunk; `add(row)` then `camera(k)`."""

    def __init__(self, size, intrinsics, dtype=torch.bfloat16, device="cpu", chunk: int = CHUNK_FRAMES):
        super().__init__(size, intrinsics, chunk, dtype, device)
        self.keys: list[np.ndarray] = []

    def add(self, keys) -> None:
        """The keys (parse_keys_line's [8] row) held through the next chunk."""
        keys = np.asarray(keys, dtype=np.float32).reshape(8)
        self.keys.append(keys)
        slot = row_slot(keys)
        self.track.advance([slot] * (chunk_key_rows(len(self.keys) - 1, self.chunk) // VAE_STRIDE[0]))


def keys_camera(
    lines, size, intrinsics, dtype=torch.bfloat16, device="cpu", chunk: int = CHUNK_FRAMES
) -> torch.Tensor:
    """Offline: all key lines (one per chunk) -> the packed camera of the whole clip."""
    steering = KeySteering(size, intrinsics, dtype, device, chunk)
    for n, line in enumerate(lines, start=1):
        steering.add(parse_keys_line(line, f"keys line {n}"))
    return steering.full_camera()


__all__ = ["Controls", "ChunkCamera", "KeySteering", "keys_camera", "key_name", "MODES", "MOVE_STEP"]
