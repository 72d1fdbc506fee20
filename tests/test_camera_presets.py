"""Camera presets (math, packing, files), the trajectory preview, the `camera` CLI, CONDITIONING stripping
and the shipped workflows' template metadata."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders import demo_assets
from lingbot_world.loaders.camera_authoring import camera_path_arrays, preset_camera, save_camera_dir
from lingbot_world.loaders.camera_files import CameraInput
from lingbot_world.loaders.camera_preview import render_path
from lingbot_world.wan import i2v
from lingbot_world.wan.camera_presets import build_preset, parse_preset
from lingbot_world.wan.config import INTRINSICS_SIZE
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return demo_assets.ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def centres(path):
    return path.poses[:, :3, 3].astype(np.float64)


def rots(path):
    return path.poses[:, :3, :3].astype(np.float64)


def test_pure_pan_keeps_the_centre_and_turns_right():
    p = build_preset("pan right 30 40f")
    assert p.frame_num == 41 and p.poses.shape == (41, 4, 4) and p.intrinsics.shape == (41, 4)
    assert np.abs(centres(p)).max() == 0
    forward = rots(p)[-1][:, 2]
    np.testing.assert_allclose(
        forward, [math.sin(math.radians(30)), 0, math.cos(math.radians(30))], atol=1e-6
    )
    left = build_preset("pan left 30 40f")
    assert rots(left)[-1][0, 2] < 0  # towards -x
    np.testing.assert_allclose(p.poses[0], np.eye(4))


def test_tilt_up_looks_towards_minus_y_and_roll_keeps_the_view_axis():
    forward = rots(build_preset("tilt up 20 8f"))[-1][:, 2]
    np.testing.assert_allclose(
        forward, [0, -math.sin(math.radians(20)), math.cos(math.radians(20))], atol=1e-6
    )
    roll = build_preset("roll right 15 8f")
    np.testing.assert_allclose(rots(roll)[-1][:, 2], [0, 0, 1], atol=1e-6)
    assert rots(roll)[-1][0, 1] < 0  # the camera's down axis swings to -x: its top to +x, clockwise


def test_dolly_truck_pedestal_keep_the_rotation():
    for text, end in (
        ("dolly in 2 8f", [0, 0, 2]),
        ("truck right 1 8f", [1, 0, 0]),
        ("pedestal up 0.5 8f", [0, -0.5, 0]),
    ):
        p = build_preset(text)
        np.testing.assert_allclose(rots(p), np.broadcast_to(np.eye(3), rots(p).shape), atol=1e-7)
        np.testing.assert_allclose(centres(p)[-1], end, atol=1e-6)


def test_orbit_keeps_the_distance_to_its_centre_and_faces_it():
    p = build_preset("orbit left 90 around 2 40f ease")
    target = np.array([0.0, 0.0, 2.0])
    dist = np.linalg.norm(centres(p) - target, axis=1)
    np.testing.assert_allclose(dist, 2.0, atol=1e-5)
    np.testing.assert_allclose(centres(p)[-1], [-2, 0, 2], atol=1e-5)  # moved to its left
    to_target = (target - centres(p)) / dist[:, None]
    np.testing.assert_allclose(
        np.einsum("nij,nj->ni", rots(p).transpose(0, 2, 1), to_target)[:, 2], 1, atol=1e-5
    )


def test_segments_chain_ease_scale_and_hold():
    p = build_preset("pan right 20 8f ease-in-out, dolly in 1 4f")
    assert p.frame_num == 13  # 12 steps -> 13 frames (4n+1)
    yaw = np.degrees(np.arctan2(rots(p)[:, 0, 2], rots(p)[:, 2, 2]))
    np.testing.assert_allclose(yaw[8:], 20, atol=1e-4)  # the dolly starts from the panned pose
    assert yaw[1] < 20 / 8 / 2  # eased: slow start
    np.testing.assert_allclose(yaw[4], 10, atol=1e-4)  # ease-in-out: halfway at mid-segment
    np.testing.assert_allclose(np.linalg.norm(centres(p)[-1] - centres(p)[8]), 1, atol=1e-6)

    held = build_preset("pan right 20 5f")  # 5 steps -> 9 frames, last 3 held
    assert held.frame_num == 9
    np.testing.assert_array_equal(held.poses[5], held.poses[8])
    fast = build_preset("pan right 20 5f", speed=2.0)
    np.testing.assert_allclose(
        np.degrees(np.arctan2(fast.poses[-1, 0, 2], fast.poses[-1, 2, 2])), 40, atol=1e-4
    )

    shared = build_preset("pan right 10, static, tilt up 5", frame_num=25)
    assert shared.frame_num == 25  # 24 steps shared 8/8/8
    np.testing.assert_array_equal(shared.poses[8], shared.poses[16])


def test_zoom_changes_the_focal_length_and_size_sets_square_pixels():
    p = build_preset("zoom in 2 8f", size=(720, 1280))
    fx, fy = p.intrinsics[:, 0], p.intrinsics[:, 1]
    np.testing.assert_allclose(fx[-1] / fx[0], 2.0, rtol=1e-6)
    # stored at 480x832 as upstream; at 720x1280 fx == fy (square pixels)
    h, w = 720, 1280
    np.testing.assert_allclose(fx * w / INTRINSICS_SIZE[1], fy * h / INTRINSICS_SIZE[0], rtol=1e-6)
    np.testing.assert_allclose(p.intrinsics[0, 2:], [416, 240])


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("jump 3", "unknown motion 'jump'"),
        ("pan up 3", "unknown direction 'up'"),
        ("orbit left 30 around", "positive distance"),
        ("zoom in 0", "focal factor > 0"),
        ("pan right 10 3f 4f", "two frame counts"),
    ],
)
def test_bad_presets_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        build_preset(text)


def test_bad_frame_count_is_refused():
    with pytest.raises(ValueError, match="4n\\+1"):
        build_preset("pan right 10", frame_num=80)
    with pytest.raises(ValueError, match="add up to 90, more than the 80 steps"):
        build_preset("pan right 10 80f, tilt up 5 10f", frame_num=81)
    assert [s.easing for s in parse_preset("pan left 5 ease; static linear")] == ["ease-in-out", "linear"]


@pytest.mark.parametrize("size", [(480, 832), (720, 1280)])
@pytest.mark.parametrize(
    "text", ["static", "pan left 30", "orbit right 40 around 3 + dolly in 1 ease", "zoom in 1.5"]
)
def test_presets_pack_to_the_dit_camera_tensor(text, size):
    cam, path = preset_camera(text, frame_num=17, size=size)
    lat_h, lat_w, h, w = i2v.latent_size(size[0], size[1], size[0] * size[1])
    tensor, frames = cam.pack("cam", 17, (lat_h, lat_w, h, w), "cpu")
    assert frames == 17 == path.frame_num
    assert tensor.shape == (1, 384, 5, lat_h, lat_w)
    assert torch.isfinite(tensor.float()).all()


def test_saved_folder_reads_back_as_the_same_camera(tmp_path):
    cam, path = preset_camera("orbit left 30 + pedestal up 0.2 20f ease, pan right 10 12f")
    save_camera_dir(tmp_path / "cam", path.poses, path.intrinsics)
    back = CameraInput.from_dir(tmp_path / "cam")
    np.testing.assert_array_equal(back.poses, path.poses)
    np.testing.assert_array_equal(back.intrinsics, path.intrinsics)
    size = (30, 52, 240, 416)
    assert torch.equal(cam.pack("cam", 33, size, "cpu")[0], back.pack("cam", 33, size, "cpu")[0])
    with pytest.raises(FileExistsError, match="poses.npy"):
        save_camera_dir(tmp_path / "cam", path.poses, path.intrinsics)
    with pytest.raises(ValueError, match="poses"):
        save_camera_dir(tmp_path / "bad", np.zeros((9, 4, 4)), path.intrinsics)


def test_preview_draws_the_path(shipped_example):
    pan = render_path(*camera_path_arrays(preset_camera("pan left 40")[0]), title="pan")
    dolly = render_path(*camera_path_arrays(preset_camera("dolly in 1")[0]), title="pan")
    assert pan.shape == dolly.shape == (576, 1024, 3) and pan.dtype == np.uint8
    assert (pan != dolly).any(axis=-1).mean() > 0.01  # the path changes the picture
    # the ramp's colours are on the path: first frame dark purple, last yellow
    for img in (pan, dolly):
        assert (np.abs(img.astype(int) - [253, 231, 37]).sum(-1) < 40).any()
        assert (np.abs(img.astype(int) - [68, 1, 84]).sum(-1) < 40).any()
    keys = CameraInput.from_dir(shipped_example, "w-10,l-10")
    poses, _ = camera_path_arrays(keys, 81)  # an action string keeps its own length
    assert len(poses) == 22
    folder = camera_path_arrays(CameraInput.from_dir(shipped_example), 33)[0]
    assert len(folder) == 33
    assert render_path(folder, CameraInput.from_dir(shipped_example).intrinsics).std() > 10


def test_camera_cli_saves_and_previews(tmp_path, shipped_example, capsys):
    out, png = tmp_path / "cam", tmp_path / "p.png"
    argv = [
        "camera",
        "--preset",
        "orbit left 30 around 2 + dolly in 0.5 16f ease",
        "--save",
        str(out),
        "--preview",
        str(png),
        "--size",
        "720*1280",
    ]
    assert cli.main(argv) == 0
    assert "17 poses" in capsys.readouterr().out
    assert np.load(out / "poses.npy").shape == (17, 4, 4)
    with Image.open(png) as img:
        assert img.size == (1024, 576)
    assert cli.main(argv) == 2  # exists: needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite"]) == 0
    assert cli.main(["camera", "--action_path", str(out), "--preview", str(tmp_path / "b.png")]) == 0
    keys = ["camera", "--action_path", str(shipped_example), "--action_string", "w-4,l-4"]
    assert cli.main([*keys, "--preview", str(tmp_path / "k.png")]) == 0
    assert cli.main(["camera", "--preset", "pan sideways"]) == 2
    assert "unknown direction 'sideways'" in capsys.readouterr().err


def test_generate_refuses_a_preset_with_a_pose_folder(tmp_path, shipped_example, capsys):
    argv = [
        "generate",
        "--ckpt_dir",
        str(tmp_path),
        "--image",
        str(shipped_example / "image.jpg"),
        "--prompt",
        "x",
        "--camera_preset",
        "pan left 10",
        "--action_path",
        str(shipped_example),
    ]

    class Args:
        camera_preset, action_path, action_string, allow_act2cam = "pan left 10", shipped_example, None, False

    with pytest.raises(ValueError, match="--camera_preset replaces"):
        cli.camera_input(Args())
    parsed = cli.build_parser().parse_args(argv)
    parsed.action_path, parsed.frame_num = None, 9
    cam = cli.camera_input(parsed, (720, 1280))
    assert cam.frames() == 9 and cam.poses.shape == (9, 4, 4)


def comfy_conditioning(rows: torch.Tensor, pad_to: int = 512, mask: bool = False):
    """What ComfyUI's Wan CLIP Text Encode gives: [1, 512, dim] fp32, zeros after the end token."""
    out = torch.zeros(1, pad_to, rows.shape[1])
    out[0, : len(rows)] = rows
    extra = {"pooled_output": None}
    if mask:
        extra["attention_mask"] = (torch.arange(pad_to) < len(rows)).long()[None]
    return [[out, extra]]


def test_conditioning_is_cut_to_the_prompts_tokens(fake_comfy, ckpt, tmp_path):
    nodes = fake_comfy(ckpt, tmp_path)
    from lingbot_world.nodes.text import TextEmbeds, conditioning_to_context, sampler_text

    rows = torch.randn(14, 32)
    rows[5] = 0  # an all-zero row inside the prompt survives
    for mask in (False, True):
        got = conditioning_to_context(comfy_conditioning(rows, mask=mask), "positive")
        assert got.dtype == torch.bfloat16 and got.shape == (14, 32)
        assert torch.equal(got, rows.to(torch.bfloat16))
    long = conditioning_to_context(comfy_conditioning(torch.randn(600, 8), pad_to=600), "positive")
    assert long.shape == (512, 8)  # upstream's text_len
    with pytest.raises(ValueError, match="negative: expected one conditioning entry"):
        conditioning_to_context(comfy_conditioning(rows) * 2, "negative")
    with pytest.raises(ValueError, match="all zeros"):
        conditioning_to_context(comfy_conditioning(torch.zeros(3, 8)), "positive")
    text = TextEmbeds(rows, rows)
    assert sampler_text(text, None, None) is text
    both = sampler_text(None, comfy_conditioning(rows), comfy_conditioning(rows[:3]))
    assert both.context.shape == (14, 32) and both.context_null.shape == (3, 32)
    with pytest.raises(ValueError, match="negative: positive and negative"):
        sampler_text(None, comfy_conditioning(rows), None)
    with pytest.raises(ValueError, match="either 'text' or positive/negative"):
        sampler_text(text, comfy_conditioning(rows), comfy_conditioning(rows))
    with pytest.raises(ValueError, match="connect LingBot Text Encode"):
        sampler_text(None, None, None)
    assert "LingBotCameraPreset" in nodes.NODE_CLASS_MAPPINGS


def test_preset_and_preview_nodes(fake_comfy, ckpt, tmp_path):
    nodes = fake_comfy(ckpt, tmp_path)
    preset = nodes.LingBotCameraPreset()
    assert nodes.LingBotCameraPreset.VALIDATE_INPUTS("pan sideways", 0).startswith("camera preset")
    assert "add up to" in nodes.LingBotCameraPreset.VALIDATE_INPUTS("pan left 10 20f", 9)
    cam, frames = preset.build("pan left 10 8f", 0, 1.0, 80.0, 832, 480, save_folder="my_path")
    assert frames == 9 and (tmp_path / "my_path" / "poses.npy").is_file()
    back, back_frames = nodes.LingBotCamera().load("my_path")  # the camera-path node reads it back
    np.testing.assert_array_equal(back.poses, cam.poses)
    assert back_frames == 9
    (image,) = nodes.LingBotCameraPreview().render(cam, 81)
    assert image.shape == (1, 576, 1024, 3) and 0 <= image.min() and image.max() <= 1


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflows_carry_models_and_fit_a_1600x1000_window(path):
    wf = json.loads(path.read_text())
    listed = {m["name"]: m for m in wf["models"]}
    for node in wf["nodes"]:
        files = [
            v for v in node.get("widgets_values") or [] if isinstance(v, str) and v.endswith(".safetensors")
        ]
        for name in files:
            entries = {m["name"]: m for m in node["properties"].get("models", [])}
            assert name in entries and name in listed, (path.name, node["type"], name)
            m = entries[name]
            assert m["url"].startswith("https://huggingface.co/") and m["url"].endswith("/" + name)
            assert m["directory"] in ("text_encoders", "vae", "diffusion_models", "loras")
    description = wf["extra"]["info"]["description"]
    # each workflow names where its DiT comes from: the base-cam NF4 repack (v1 Fast lives in base-cam's
    # folder too) or the LingBot-World 2.0 repo of the kind its Fast loader names
    kinds = [n["widgets_values"][5] for n in wf["nodes"] if n["type"] == "LingBotFastLoader"]
    for kind in kinds:
        repo = (
            f"robbyant/lingbot-world-{kind}-causal-fast"
            if kind.startswith("v2")
            else "robbyant/lingbot-world-fast"
        )
        assert repo in description, (path.name, repo)
    if not kinds or any(k == "fast" or k == "auto" for k in kinds):
        assert "cahlen/lingbot-world-base-cam-nf4" in description
    # visible area of a 1600x1000 window: minus the side bar (~50 px) and the menu/tabs (~90 px)
    scale, (ox, oy) = wf["extra"]["ds"]["scale"], wf["extra"]["ds"]["offset"]
    right = max(n["pos"][0] + n["size"][0] for n in wf["nodes"])
    bottom = max(n["pos"][1] + n["size"][1] for n in wf["nodes"])
    top = min(n["pos"][1] for n in wf["nodes"]) - 30  # title bars sit above pos
    assert (right + ox) * scale <= 1550 and (bottom + oy) * scale <= 910, (path.name, right, bottom, scale)
    assert (top + oy) * scale >= 0 and min(n["pos"][0] for n in wf["nodes"]) + ox >= 0
