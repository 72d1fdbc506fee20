"""Camera tensors for LingBot-World-Fast: a whole pose path up front, or act2cam keys chunk by chunk
(the keys' integrator is `session.controls`; the packing and the key lines' rules are here).

Whole path (upstream's Fast rule, `pose_camera`): the poses the request uses (a pose file cut to the
requested 4n+1 frames, or act2cam's F+1 synthetic poses) are interpolated to exactly `lat_f` latent poses
spread over their whole span, where lat_f is already rounded down to whole chunks; so 161 requested
frames from 161 poses give 39 latent poses spaced 160/38 frames apart, not the first 153 frames' poses.
Then framewise relative poses, translations divided by the path's largest step, rays packed as base-cam.

Steering (`session.controls.KeySteering`): the path grows one chunk of keys at a time, so nothing may depend
on keys that have not arrived. Two upstream act2cam rules look at the whole path and are replaced:
- upstream spreads its latent poses over the whole key sequence; here latent frame i takes the act2cam
  pose at video frame 4i exactly (after key rows 0..4i-1), no interpolation;
- upstream divides the translations by the largest latent step of the whole path; here they are divided
  by `KEY_STEP`, the step of one movement key held for a latent frame's 4 video frames. A path whose
  fastest step is a single held key (w, a, s or d) gets the same scale either way (its steps are 1);
  a diagonal step (w+d) is sqrt(2) here, where upstream would instead shrink every other step.
So chunk k's camera depends only on the keys of chunks 0..k, and building it while the keys arrive gives
bit for bit the tensor built afterwards from all of them.

One key line holds the keys for one chunk's video frames: chunk 0 decodes to 4*(CHUNK-1)+1 frames and
takes 4*(CHUNK-1) key rows (v1 Fast, 3 latent frames a chunk: 9 frames, poses 1..8), every later chunk
4*CHUNK frames and rows (12; v2's 4-frame chunks: 13, then 16).
"""

import numpy as np
import torch

from .actions import IJKL, MOVE_STEP, WASD, parse_action_string
from .camera import (
    interpolate_poses,
    pack_pixels,
    pixel_directions,
    ray_field,
    relative_poses,
    scale_intrinsics,
    validate_actions,
    validate_intrinsics,
    validate_poses,
)
from .config import CONTROL_CHANNELS, VAE_STRIDE
from .fast import CHUNK_FRAMES

# One movement key held for one latent frame (4 video frames): act2cam's flattened step, 4 times.
KEY_STEP = VAE_STRIDE[0] * MOVE_STEP / (1 + 1e-6)


def pack_camera(c2w: torch.Tensor, intrinsics, size, control_type: str, wasd, dtype, device) -> torch.Tensor:
    """Relative c2w [n, 4, 4] (+ Act's W, A, S, D rows [n, 4]) -> [1, C, n, lat_h, lat_w], one frame at a time."""
    lat_h, lat_w, h, w = size
    Ks = torch.from_numpy(np.ascontiguousarray(validate_intrinsics(intrinsics))).float()
    dirs = pixel_directions(scale_intrinsics(Ks, h, w)[0].to(device), h, w)
    c2w = c2w.to(device)
    out = torch.empty(1, CONTROL_CHANNELS[control_type], len(c2w), lat_h, lat_w, dtype=dtype, device=device)
    for i in range(len(c2w)):
        field = ray_field(c2w[i : i + 1], dirs, h, w, only_rays_d=control_type == "act")
        if control_type == "act":
            field = torch.cat([field, wasd[i].to(device).expand(1, h, w, 4)], dim=-1)
        out[:, :, i : i + 1] = pack_pixels(field, lat_h, lat_w).to(dtype)
    return out


def pose_camera(
    poses,
    intrinsics,
    lat_f: int,
    size: tuple,
    control_type: str = "cam",
    actions=None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
) -> torch.Tensor:
    """Upstream Fast's camera for a whole path: [1, C, lat_f, lat_h, lat_w].

    poses: [N, 4, 4] c2w already cut to the frames the request covers (all of act2cam's F+1 poses);
    intrinsics: [N, 4] at 480x832 (row 0 used); size: (lat_h, lat_w, h, w); lat_f: latent frames after
    rounding down to whole chunks. Act: `actions` [N, 4] (W, A, S, D), every 4th row, the first lat_f.
    """
    if control_type not in CONTROL_CHANNELS:
        raise ValueError(f"control_type: expected one of {sorted(CONTROL_CHANNELS)}, got {control_type!r}")
    poses = validate_poses(poses)
    wasd = None
    if control_type == "act":
        if actions is None:
            raise ValueError("actions: control_type 'act' needs the [N, 4] W, A, S, D array (action.npy)")
        rows = validate_actions(actions, "actions")[: len(poses)][::4]
        if len(rows) < lat_f:
            raise ValueError(f"actions: expected at least {lat_f} rows every 4th frame, got {len(rows)}")
        wasd = torch.from_numpy(np.ascontiguousarray(rows[:lat_f])).float()
    c2w = relative_poses(interpolate_poses(poses, lat_f), framewise=True)
    return pack_camera(c2w, intrinsics, size, control_type, wasd, dtype, device)


# ------------------------------------------------------------------------------------------ steering


def chunk_key_rows(k: int, chunk: int = CHUNK_FRAMES) -> int:
    """Key rows (video frames) chunk k adds: 4*(chunk-1) for chunk 0 (the first frame needs none), then
    4*chunk (v1 Fast: 8, then 12)."""
    return VAE_STRIDE[0] * (chunk - 1 if k == 0 else chunk)


def parse_keys_line(line: str, where: str = "keys") -> np.ndarray:
    """One line of keys held through a chunk -> [8] float32 0/1 (w a s d i j k l).

    A line holds keys only: any of w a s d i j k l (e.g. `w`, `wj`, `sl`), or `none`/blank for no keys."""
    text = "".join(str(line).split()).lower()
    if not text:
        text = "none"
    if "-" in text or "," in text:
        bad = True
    else:
        try:
            wasd, ijkl = parse_action_string(f"{text}-1")
            bad = False
        except ValueError:
            bad = True
    if bad:
        raise ValueError(
            f"{where}: {line.strip()!r} is not a keys line; expected keys from {' '.join(WASD + IJKL)} held "
            "through the chunk (e.g. 'w', 'wj', 'sl') or 'none'"
        )
    return np.concatenate([wasd[0], ijkl[0]])
