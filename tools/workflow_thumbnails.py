"""Template-card thumbnails: `<name>.jpg` beside each workflow in example_workflows/ (ComfyUI's Templates
menu shows it on the workflow's card).

Each picture is what the workflow starts from and where it moves the camera: the shipped start image
(examples/00/image.jpg, which every template loads) captioned with the workflow's name (`extra.info.name`),
above the workflow's camera path drawn by the pack's own preview (loaders/camera_preview.py), from its
LingBot Camera Path or LingBot Camera Preset node as saved. 512x512 JPEG, offline, no model.

    python tools/workflow_thumbnails.py                  # rewrite example_workflows/*.jpg
    python tools/workflow_thumbnails.py --out /tmp/thumbs
"""

import argparse
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders.camera_authoring import camera_path_arrays, preset_camera  # noqa: E402
from lingbot_world.loaders.camera_files import CameraInput  # noqa: E402
from lingbot_world.loaders.camera_preview import render_path  # noqa: E402

WIDTH, PHOTO_H, PATH_H = 512, 288, 224  # a 16:9 photo over the path panel: a square card
START_IMAGE = ROOT / "examples" / "00" / "image.jpg"
QUALITY = 80


def workflow_camera(ui: dict):
    """(poses, intrinsics, label) of the workflow's camera node as saved, or None without one. Widget
    positions as the nodes declare them (tests/test_workflows.py checks the saved widgets against them)."""
    for node in ui["nodes"]:
        w = node.get("widgets_values") or []
        if node["type"] == "LingBotCameraPreset":
            text, frames, speed, fov, width, height = w[:6]
            cam, path = preset_camera(text, frames or None, speed, (height, width), fov)
            return *camera_path_arrays(cam), f"preset: {text}"
        if node["type"] == "LingBotCamera":
            folder, actions, act2cam = w[:3]
            cam = CameraInput.from_dir(ROOT / folder, actions.strip() or None, act2cam)
            return *camera_path_arrays(cam), f"camera path: {folder}" + (
                f", keys {actions}" if actions else ""
            )
    return None


def _wrap(text: str, font, width: int) -> list:
    """`text` in lines no wider than `width` pixels in `font` (words kept whole)."""
    lines = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines


def thumbnail(workflow: Path) -> Image.Image:
    ui = json.loads(workflow.read_text(encoding="utf-8"))
    name = ui.get("extra", {}).get("info", {}).get("name") or workflow.stem
    card = Image.new("RGB", (WIDTH, PHOTO_H + PATH_H), (250, 250, 247))
    with Image.open(START_IMAGE) as photo:
        card.paste(photo.convert("RGB").resize((WIDTH, PHOTO_H), Image.LANCZOS))
    font = ImageFont.load_default(size=19)
    lines = _wrap(name, font, WIDTH - 20)[:2]
    strip = Image.new("RGBA", (WIDTH, 12 + 24 * len(lines)), (0, 0, 0, 160))
    for i, line in enumerate(lines):
        ImageDraw.Draw(strip).text((10, 6 + 24 * i), line, fill=(255, 255, 255), font=font)
    card.paste(strip, (0, PHOTO_H - strip.height), strip)
    camera = workflow_camera(ui)
    if camera is not None:  # drawn at twice the size, then halved: the path stays crisp, the labels small
        poses, intrinsics, label = camera
        panel = Image.fromarray(render_path(poses, intrinsics, title=label, size=(2 * WIDTH, 2 * PATH_H)))
        card.paste(panel.resize((WIDTH, PATH_H), Image.LANCZOS), (0, PHOTO_H))
    else:
        text = ui.get("extra", {}).get("info", {}).get("description", "")
        small = ImageFont.load_default(size=14)
        for i, line in enumerate(_wrap(text, small, WIDTH - 20)[:12]):
            ImageDraw.Draw(card).text((10, PHOTO_H + 8 + 17 * i), line, fill=(40, 40, 40), font=small)
    return card


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "example_workflows", help="folder for the .jpg files"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for workflow in sorted((ROOT / "example_workflows").glob("*.json")):
        target = args.out / f"{workflow.stem}.jpg"
        thumbnail(workflow).save(target, format="JPEG", quality=QUALITY, optimize=True)
        print(f"{target}: {target.stat().st_size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
