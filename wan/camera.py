"""Camera conditioning: c2w poses + intrinsics -> the packed ray tensor the DiT's camera layers read.

Follows upstream `WanI2V.generate` and `wan/utils/cam_utils.py` step for step, with the same dtypes:
poses go through scipy interpolation in float64 and come out as torch float32; intrinsics, relative
poses and rays are torch float32; only the packed result is cast (bf16 by default).

Conventions (upstream's): poses are camera-to-world in OpenCV axes (x right, y down, z forward);
intrinsics rows are (fx, fy, cx, cy) in pixels of a 480x832 frame (`INTRINSICS_SIZE`), and only
row 0 is used. The "Plücker" field is [rays_o, rays_d], not the moment o x d.
"""

import numpy as np
import torch
from einops import rearrange
from scipy.interpolate import interp1d
from scipy.spatial.transform import Rotation, Slerp

from .config import CONTROL_CHANNELS, INTRINSICS_SIZE, PATCH_SIZE, VAE_STRIDE
from .i2v import latent_frames

MIN_POSE_FRAMES = 5  # one latent step needs frames 0..4
RIGID_TOL = 1e-3  # max |R^T R - I| and |det R - 1| accepted for a pose's rotation block


# ---------------------------------------------------------------------------------------------
# Input validation. `name` is what the error calls the array (a file path when a loader calls).


def _numeric(a, name: str, expected: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.kind not in "iuf":
        raise ValueError(f"{name}: expected a real numeric array {expected}, got dtype {arr.dtype}")
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: expected finite values {expected}, found NaN or inf")
    return arr


def validate_poses(poses, name: str = "poses") -> np.ndarray:
    """[N, 4, 4] rigid camera-to-world matrices, N >= 5; returned unchanged (dtype kept)."""
    expected = "of shape [N, 4, 4] (camera-to-world, OpenCV axes)"
    arr = np.asarray(poses)
    if arr.ndim != 3 or arr.shape[1:] != (4, 4):
        raise ValueError(f"{name}: expected {expected}, got shape {list(arr.shape)}")
    arr = _numeric(arr, name, expected)
    if arr.shape[0] < MIN_POSE_FRAMES:
        raise ValueError(f"{name}: expected at least {MIN_POSE_FRAMES} poses, got {arr.shape[0]}")
    bottom = np.abs(arr[:, 3, :] - np.array([0.0, 0.0, 0.0, 1.0])).max(axis=1)
    if (bottom > RIGID_TOL).any():
        i = int(np.argmax(bottom > RIGID_TOL))
        raise ValueError(f"{name}: expected bottom row [0, 0, 0, 1], pose {i} has {arr[i, 3].tolist()}")
    rot = arr[:, :3, :3].astype(np.float64)
    ortho = np.abs(rot.transpose(0, 2, 1) @ rot - np.eye(3)).max(axis=(1, 2))
    det = np.linalg.det(rot)
    bad = (ortho > RIGID_TOL) | (np.abs(det - 1.0) > RIGID_TOL)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"{name}: expected rotation blocks with R^T R = I and det R = +1 (tolerance {RIGID_TOL}); "
            f"pose {i} has max|R^T R - I| = {ortho[i]:.3g}, det = {det[i]:.6g}"
        )
    return arr


def validate_intrinsics(intrinsics, name: str = "intrinsics") -> np.ndarray:
    """[N, 4] rows (fx, fy, cx, cy) at 480x832 pixels, N >= 1, positive focal lengths."""
    expected = f"of shape [N, 4] (fx, fy, cx, cy at {INTRINSICS_SIZE[0]}x{INTRINSICS_SIZE[1]} pixels)"
    arr = np.asarray(intrinsics)
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"{name}: expected {expected}, got shape {list(arr.shape)}")
    if arr.shape[0] < 1:
        raise ValueError(f"{name}: expected at least 1 row {expected}, got 0 rows")
    arr = _numeric(arr, name, expected)
    if (arr[:, :2] <= 0).any():
        i = int(np.argmax((arr[:, :2] <= 0).any(axis=1)))
        raise ValueError(f"{name}: expected focal lengths fx, fy > 0, row {i} has {arr[i, :2].tolist()}")
    return arr


def check_intrinsics_rows(rows: int, pose_rows: int, name: str = "intrinsics", poses: str = "poses") -> None:
    """Intrinsics that go with a pose path: at least one row per pose (extra rows unused, as upstream), or a
    single row for every frame. `name`/`poses`: what the error calls the two arrays (file paths from a loader)."""
    if rows != 1 and rows < pose_rows:
        raise ValueError(
            f"{name} has {rows} rows but {poses} has {pose_rows}: expected one intrinsics row per pose "
            "(or a single row for every frame)"
        )


def validate_actions(actions, name: str = "actions", min_rows: int = 0) -> np.ndarray:
    """[N, 4] key columns (w, a, s, d or i, j, k, l), N >= min_rows."""
    expected = "of shape [N, 4] (one column per key)"
    arr = np.asarray(actions)
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"{name}: expected {expected}, got shape {list(arr.shape)}")
    if arr.shape[0] < min_rows:
        raise ValueError(
            f"{name}: expected at least {min_rows} rows (one per video frame), got {arr.shape[0]}"
        )
    return _numeric(arr, name, expected)


def _validate_sizes(frame_num, height, width, lat_h, lat_w):
    latent_frames(frame_num)  # raises unless 4n+1
    sh, sw = VAE_STRIDE[1], VAE_STRIDE[2]
    ph, pw = PATCH_SIZE[1], PATCH_SIZE[2]
    if lat_h < 1 or lat_w < 1 or lat_h % ph or lat_w % pw or height != sh * lat_h or width != sw * lat_w:
        raise ValueError(
            f"height/width: expected height = {sh}*lat_h and width = {sw}*lat_w with lat_h, lat_w "
            f"positive multiples of {ph} (pixel sizes multiples of {sh * ph}), got height={height}, "
            f"width={width}, lat_h={lat_h}, lat_w={lat_w}"
        )


# ---------------------------------------------------------------------------------------------
# The math, one function per upstream step.


def usable_frames(num_poses: int) -> int:
    """Longest 4n+1 prefix of a pose sequence: the most video frames it can drive."""
    return ((num_poses - 1) // 4) * 4 + 1


def used_frame_count(num_poses: int, frame_num: int) -> int:
    """Frames actually generated: the requested count, capped at `usable_frames(num_poses)`."""
    return min(frame_num, usable_frames(num_poses))


def scale_intrinsics(Ks: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Rescale [N, 4] intrinsics from 480x832 to height x width (upstream's crop offset is always 0)."""
    h0, w0 = INTRINSICS_SIZE
    sx, sy = width / w0, height / h0
    return torch.stack([Ks[:, 0] * sx, Ks[:, 1] * sy, Ks[:, 2] * sx, Ks[:, 3] * sy], dim=1)


def interpolate_poses(poses: np.ndarray, num_out: int) -> torch.Tensor:
    """Resample [N, 4, 4] poses at linspace(0, N-1, num_out) -> float32 [num_out, 4, 4].

    Translation: linear (extrapolation allowed); rotation: quaternion Slerp after flipping signs
    so consecutive quaternions have non-negative dot products. Computed in float64 by scipy.
    """
    n = len(poses)
    src = np.linspace(0, n - 1, n)
    tgt = np.linspace(0, n - 1, num_out)
    trans = interp1d(
        src, poses[:, :3, 3], axis=0, kind="linear", bounds_error=False, fill_value="extrapolate"
    )
    quats = Rotation.from_matrix(poses[:, :3, :3]).as_quat().copy()
    for i in range(1, n):
        if np.dot(quats[i], quats[i - 1]) < 0:
            quats[i] = -quats[i]
    rot = Slerp(src, Rotation.from_quat(quats))(tgt)
    out = np.zeros((num_out, 4, 4))
    out[:, :3, :3] = rot.as_matrix()
    out[:, :3, 3] = trans(tgt)
    out[:, 3, 3] = 1.0
    return torch.from_numpy(out).float()


def se3_inverse(T: torch.Tensor) -> torch.Tensor:
    """Inverse of [B, 4, 4] rigid transforms: [R^T | -R^T t]."""
    r_inv = T[:, :3, :3].transpose(-1, -2)
    out = torch.eye(4, dtype=T.dtype, device=T.device).repeat(T.shape[0], 1, 1)
    out[:, :3, :3] = r_inv
    out[:, :3, 3:] = -torch.bmm(r_inv, T[:, :3, 3:])
    return out


def relative_poses(c2w: torch.Tensor, framewise: bool = True, normalize_trans: bool = True) -> torch.Tensor:
    """Poses relative to frame 0 (frame 0 = I); framewise: each one relative to its predecessor.

    Translations are then divided by the largest translation norm when it is > 0 (CameraCtrl2's
    scaling), so the fastest step has length 1 and absolute speed is lost, as upstream.
    """
    rel = torch.matmul(se3_inverse(c2w[0:1]), c2w)
    rel[0] = torch.eye(4, dtype=c2w.dtype, device=c2w.device)
    if framewise:
        rel[1:] = torch.bmm(se3_inverse(rel[:-1]), rel[1:])
    if normalize_trans:
        trans = rel[:, :3, 3]
        max_norm = torch.norm(trans, dim=-1).max()
        if max_norm > 0:
            rel[:, :3, 3] = trans / max_norm
    return rel


def pixel_directions(K: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Unit camera-space ray directions [height * width, 3] (row-major pixels) for K = (fx, fy, cx, cy).

    Pixel centres (x + 0.5, y + 0.5); d = normalize((u - cx) / fx, (v - cy) / fy, 1). In K's dtype.
    """
    xs = torch.arange(width, dtype=K.dtype, device=K.device)
    ys = torch.arange(height, dtype=K.dtype, device=K.device)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    u = grid_x.reshape(-1) + 0.5
    v = grid_y.reshape(-1) + 0.5
    fx, fy, cx, cy = K
    dirs = torch.stack([(u - cx) / fx, (v - cy) / fy, torch.ones_like(u)], dim=-1)
    return dirs / dirs.norm(dim=-1, keepdim=True)


def ray_field(c2w: torch.Tensor, dirs: torch.Tensor, height: int, width: int, only_rays_d: bool = False):
    """Per-pixel rays [F, height, width, 6] = (rays_o, rays_d), or rays_d only [F, height, width, 3].

    rays_d = R @ d for the `pixel_directions` d; rays_o = camera position t at every pixel.
    """
    n = c2w.shape[0]
    rays_d = dirs[None] @ c2w[:, :3, :3].transpose(-1, -2)  # [F, hw, 3]
    if only_rays_d:
        return rays_d.view(n, height, width, 3)
    rays_o = c2w[:, None, :3, 3].expand_as(rays_d)
    return torch.cat([rays_o, rays_d], dim=-1).view(n, height, width, 6)


def pack_pixels(field: torch.Tensor, lat_h: int, lat_w: int) -> torch.Tensor:
    """[F, H, W, c] -> [1, c * (H/lat_h) * (W/lat_w), F, lat_h, lat_w], channels ordered (c, row, col)."""
    c1, c2 = field.shape[1] // lat_h, field.shape[2] // lat_w
    return rearrange(field, "f (h c1) (w c2) c -> 1 (c c1 c2) f h w", c1=c1, c2=c2)


# ---------------------------------------------------------------------------------------------


def camera_conditioning(
    poses,
    intrinsics,
    frame_num: int,
    height: int,
    width: int,
    lat_h: int,
    lat_w: int,
    control_type: str = "cam",
    actions=None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    act2cam: bool = False,
) -> tuple[torch.Tensor, int]:
    """The DiT's camera input [1, C, lat_f, lat_h, lat_w] and the frame count F the video must have.

    poses: [N, 4, 4] c2w (OpenCV); intrinsics: [N, 4] at 480x832 (row 0 used); height x width: video
    pixels (8*lat_h x 8*lat_w). Cam: C = 384 = [rays_o, rays_d] x 8x8. Act: C = 448 = rays_d x 8x8
    followed by the W, A, S, D values of every 4th frame (`actions` [N, 4], action.npy) x 8x8;
    the pose translations then have no effect. `actions` is ignored for 'cam', as upstream's Cam
    model ignores the action.npy next to its poses.
    act2cam: poses are the F+1 synthetic poses of `wan.actions` (F = frame_num); upstream feeds all
    of them to the interpolation (no 4n+1 truncation), so latent poses sit at fractional frames.
    """
    if control_type not in CONTROL_CHANNELS:
        raise ValueError(f"control_type: expected one of {sorted(CONTROL_CHANNELS)}, got {control_type!r}")
    _validate_sizes(frame_num, height, width, lat_h, lat_w)
    poses = validate_poses(poses)
    Ks = validate_intrinsics(intrinsics)
    if act2cam:
        if control_type != "cam":
            raise ValueError(f"control_type: act2cam poses drive the 'cam' model only, got {control_type!r}")
        if len(poses) != frame_num + 1:
            raise ValueError(
                f"poses: act2cam expects frame_num + 1 = {frame_num + 1} poses, got {len(poses)}"
            )
        F = frame_num
    else:
        check_intrinsics_rows(len(Ks), len(poses))
        F = used_frame_count(len(poses), frame_num)
        poses = poses[:F]
    lat_f = latent_frames(F)
    if control_type == "act":
        if actions is None:
            raise ValueError("actions: control_type 'act' needs the [N, 4] W, A, S, D array (action.npy)")
        actions = validate_actions(actions, "actions", min_rows=F)

    # Upstream repeats row 0 for every latent frame; one set of pixel directions serves them all.
    K = scale_intrinsics(torch.from_numpy(np.ascontiguousarray(Ks)).float(), height, width)[0]
    dirs = pixel_directions(K.to(device), height, width)
    c2w = relative_poses(interpolate_poses(poses, (len(poses) - 1) // 4 + 1), framewise=True).to(device)
    if control_type == "act":
        wasd = torch.from_numpy(np.ascontiguousarray(actions[:F][::4])).float().to(device)  # [lat_f, 4]

    # One latent frame at a time keeps the float32 transient to one frame (~0.1 GB at 720p).
    out = torch.empty(1, CONTROL_CHANNELS[control_type], lat_f, lat_h, lat_w, dtype=dtype, device=device)
    for i in range(lat_f):
        field = ray_field(c2w[i : i + 1], dirs, height, width, only_rays_d=control_type == "act")
        if control_type == "act":
            field = torch.cat([field, wasd[i].expand(1, height, width, 4)], dim=-1)
        out[:, :, i : i + 1] = pack_pixels(field, lat_h, lat_w).to(dtype)
    return out, F
