"""The shipped workflows without ComfyUI: every LingBot node in example_workflows/ saves one value per widget
in declaration order, every API workflow in workflows/ names exactly the pack nodes' inputs, and every
template has its thumbnail (`<name>.jpg`, which the Templates menu shows on the card). tests/test_comfyui.py
checks every node, core ones too, against a real server's /object_info."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_harness import widget_problems
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "example_workflows").glob("*.json"))
API_WORKFLOWS = sorted((ROOT / "workflows").rglob("*.json"))
THUMB_WIDTH, THUMB_MAX_BYTES = 512, 60_000


def test_pack_nodes_save_one_value_per_widget(fake_comfy, tmp_path):
    nodes = fake_comfy(tmp_path, tmp_path)
    problems, checked = [], 0
    for path in EXAMPLES:
        for node in json.loads(path.read_text(encoding="utf-8"))["nodes"]:
            cls = nodes.NODE_CLASS_MAPPINGS.get(node["type"])
            assert cls is not None or not node["type"].startswith("LingBot"), (path.name, node["type"])
            if cls is not None:
                problems += [f"{path.name}: {p}" for p in widget_problems(node, cls.INPUT_TYPES())]
                checked += 1
    assert checked > len(EXAMPLES) and not problems, "\n".join(problems)
    # the check sees a widget left out (the mode of a LoRA node saved before it existed) and a swapped pair
    lora = nodes.LingBotLoRA.INPUT_TYPES()
    node = {"id": 1, "type": "LingBotLoRA", "widgets_values": ["a.safetensors", 1.0, "high", False]}
    assert widget_problems(node, lora) == [
        "node 1 (LingBotLoRA): 4 widget values saved for 5 widgets "
        "['lora_name', 'strength', 'apply_to', 'allow_unmatched_keys', 'mode']"
    ]
    node["widgets_values"] = ["a.safetensors", 1.0, False, "high", "side path"]
    assert len(widget_problems(node, lora)) == 2


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=lambda p: p.stem)
def test_api_workflows_name_the_pack_nodes_inputs(fake_comfy, tmp_path, path):
    nodes = fake_comfy(tmp_path, tmp_path)
    prompt = json.loads(path.read_text(encoding="utf-8"))
    ours = {k: v for k, v in prompt.items() if v["class_type"] in nodes.NODE_CLASS_MAPPINGS}
    assert ours, path.name
    for node_id, node in ours.items():
        spec = nodes.NODE_CLASS_MAPPINGS[node["class_type"]].INPUT_TYPES()
        declared = {**spec["required"], **spec.get("optional", {})}
        assert set(spec["required"]) <= set(node["inputs"]) <= set(declared), (node_id, node["class_type"])


def test_every_template_has_its_thumbnail():
    """A 512 px wide JPEG beside each workflow, small enough for the menu (tests/test_packaging.py: in the wheel)."""
    assert EXAMPLES
    for workflow in EXAMPLES:
        thumb = workflow.with_suffix(".jpg")
        assert thumb.is_file(), f"{thumb.name} missing: python tools/workflow_thumbnails.py"
        with Image.open(thumb) as img:
            assert img.format == "JPEG" and img.width == THUMB_WIDTH, (thumb.name, img.format, img.size)
        assert thumb.stat().st_size < THUMB_MAX_BYTES, thumb.name
    stray = {p.stem for p in (ROOT / "example_workflows").glob("*.jpg")} - {p.stem for p in EXAMPLES}
    assert not stray, f"thumbnails without a workflow: {stray}"


def test_thumbnail_script_draws_every_template(tmp_path):
    """tools/workflow_thumbnails.py (which made the committed pictures) still runs, offline, for every
    workflow: a card of the start image over the camera path, the sizes the test above checks."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "workflow_thumbnails.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.stem for p in tmp_path.glob("*.jpg")) == [p.stem for p in EXAMPLES]
    for workflow in EXAMPLES:
        made = tmp_path / f"{workflow.stem}.jpg"
        assert made.stat().st_size < THUMB_MAX_BYTES
        with Image.open(made) as img, Image.open(workflow.with_suffix(".jpg")) as shipped:
            assert img.size == shipped.size
