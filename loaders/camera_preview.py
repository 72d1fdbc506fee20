"""A picture of a camera path before any GPU time is spent on it (numpy + Pillow only).

Two panels: top-down (world x to the right, z forward = up the page) and side view (z forward to the
right, the world's up = -y up the page), both in the first camera's frame with one scale. Camera
centres are joined by a line coloured by time (dark purple = first frame, yellow = last), with a dot
on every 4th frame (one latent frame each) and frustum glyphs, labelled with their frame index, at
regular frames. A colour bar at the bottom maps colour to frame.
"""

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..wan.config import INTRINSICS_SIZE

WIDTH, HEIGHT = 1024, 576
TITLE_H, BAR_H, MARGIN = 30, 50, 36
BACKGROUND, PANEL, INK, FAINT = (250, 250, 247), (255, 255, 255), (40, 40, 40), (200, 200, 200)
# a viridis-like ramp: time 0 -> 1
RAMP = np.array([(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)], dtype=np.float64)
GLYPHS = 9  # frustum glyphs per path (first and last included)


def time_colour(t: float) -> tuple:
    x = float(np.clip(t, 0.0, 1.0)) * (len(RAMP) - 1)
    i = min(int(x), len(RAMP) - 2)
    c = RAMP[i] + (RAMP[i + 1] - RAMP[i]) * (x - i)
    return tuple(int(round(v)) for v in c)


def _frustum_dirs(K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Camera-space directions (z = 1) of the left/right and top/bottom image edges, from fx, fy, cx, cy
    at 480x832."""
    fx, fy, cx, cy = (float(v) for v in K)
    h, w = INTRINSICS_SIZE
    horizontal = np.array([[-cx / fx, 0.0, 1.0], [(w - cx) / fx, 0.0, 1.0]])
    vertical = np.array([[0.0, -cy / fy, 1.0], [0.0, (h - cy) / fy, 1.0]])
    return horizontal, vertical


def _project(points: np.ndarray, view: str) -> np.ndarray:
    """World points [..., 3] -> panel plane [..., 2] (right, up)."""
    if view == "top":
        return np.stack([points[..., 0], points[..., 2]], axis=-1)
    return np.stack([points[..., 2], -points[..., 1]], axis=-1)


def _glyph_frames(n: int) -> list:
    if n <= GLYPHS:
        return list(range(n))
    return sorted({int(round(i * (n - 1) / (GLYPHS - 1))) for i in range(GLYPHS)})


def render_path(poses, intrinsics, title: str = "", size: tuple = (WIDTH, HEIGHT)) -> np.ndarray:
    """[N, 4, 4] c2w poses (OpenCV) + [N or 1, 4] intrinsics -> RGB uint8 [H, W, 3] preview."""
    poses = np.asarray(poses, dtype=np.float64)
    Ks = np.asarray(intrinsics, dtype=np.float64)
    if poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) < 1:
        raise ValueError(f"preview: expected poses [N, 4, 4], got shape {list(poses.shape)}")
    if Ks.ndim != 2 or Ks.shape[1] != 4 or len(Ks) < 1:
        raise ValueError(f"preview: expected intrinsics [N, 4], got shape {list(Ks.shape)}")
    # in the first camera's frame, as the model sees the path
    first_inv = np.linalg.inv(poses[0])
    poses = first_inv[None] @ poses
    n = len(poses)
    centres, rots = poses[:, :3, 3], poses[:, :3, :3]
    extent = float(np.ptp(centres, axis=0).max()) if n > 1 else 0.0
    glyph_len = 0.18 * extent if extent > 1e-9 else 1.0
    glyph_at = _glyph_frames(n)
    glyphs = {}
    for i in glyph_at:
        K = Ks[min(i, len(Ks) - 1)]
        horizontal, vertical = _frustum_dirs(K)
        glyphs[i] = {
            view: centres[i] + glyph_len * (dirs / np.linalg.norm(dirs, axis=1, keepdims=True)) @ rots[i].T
            for view, dirs in (("top", horizontal), ("side", vertical))
        }

    width, height = size
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    draw.text((10, 8), (title or "camera path") + f"  ({n} frames)", fill=INK, font=font)
    panel_w = (width - 3 * 10) // 2
    panel_h = height - TITLE_H - BAR_H
    boxes = {"top": (10, TITLE_H), "side": (20 + panel_w, TITLE_H)}
    labels = {"top": "top-down: x right, z forward (up the page)", "side": "side: z forward, up = -y"}
    # one scale for both panels, so distances compare
    spans = []
    for view in boxes:
        pts = np.concatenate([_project(centres, view)] + [_project(g[view], view) for g in glyphs.values()])
        lo, hi = pts.min(axis=0), pts.max(axis=0)
        spans.append((lo, hi, pts))
    scale = min(
        min(
            (panel_w - 2 * MARGIN) / max(hi[0] - lo[0], 1e-9),
            (panel_h - 2 * MARGIN) / max(hi[1] - lo[1], 1e-9),
        )
        for lo, hi, _ in spans
    )
    for (view, (x0, y0)), (lo, hi, _) in zip(boxes.items(), spans, strict=True):
        draw.rectangle([x0, y0, x0 + panel_w, y0 + panel_h], fill=PANEL, outline=FAINT)
        draw.text((x0 + 6, y0 + 4), labels[view], fill=INK, font=font)
        mid = (lo + hi) / 2

        def to_px(p, x0=x0, y0=y0, mid=mid):
            p = np.asarray(p)
            return (
                x0 + panel_w / 2 + (p[..., 0] - mid[0]) * scale,
                y0 + panel_h / 2 - (p[..., 1] - mid[1]) * scale,
            )

        ox, oy = to_px(np.zeros(2))
        draw.line([ox - 6, oy, ox + 6, oy], fill=FAINT)
        draw.line([ox, oy - 6, ox, oy + 6], fill=FAINT)
        xs, ys = to_px(_project(centres, view))
        for i in range(n - 1):
            draw.line([xs[i], ys[i], xs[i + 1], ys[i + 1]], fill=time_colour(i / max(n - 1, 1)), width=3)
        for i in range(0, n, 4):  # one tick per latent frame
            r = 2.5
            draw.ellipse(
                [xs[i] - r, ys[i] - r, xs[i] + r, ys[i] + r], fill=time_colour(i / max(n - 1, 1)), outline=INK
            )
        for i, g in glyphs.items():
            colour = time_colour(i / max(n - 1, 1))
            gx, gy = to_px(_project(g[view], view))
            draw.polygon([(xs[i], ys[i]), (gx[0], gy[0]), (gx[1], gy[1])], outline=colour, width=2)
            draw.line([gx[0], gy[0], gx[1], gy[1]], fill=INK, width=1)
            draw.text((xs[i] + 5, ys[i] + 3), str(i), fill=INK, font=font)
    # colour bar: frame 0 .. n-1
    bx0, bx1, by = 60, width - 60, height - BAR_H + 14
    for x in range(bx0, bx1):
        draw.line([x, by, x, by + 12], fill=time_colour((x - bx0) / (bx1 - bx0)))
    for k in range(5):
        x = bx0 + k * (bx1 - bx0) / 4
        draw.line([x, by + 12, x, by + 16], fill=INK)
        draw.text((x - 8, by + 18), str(round(k * (n - 1) / 4)), fill=INK, font=font)
    draw.text((10, by), "frame", fill=INK, font=font)
    return np.array(img, dtype=np.uint8)


def save_png(image: np.ndarray, path) -> None:
    Image.fromarray(image).save(path, format="PNG")
