"""LingBot-World 2.0 (14B and 1.3B causal-fast) on the chunked path: upstream parity through golden data
from v2's own chunk loop (tests/golden/v2.safetensors, made by tests/golden/make_golden.py), the kinds'
settings and frame rule, the released checkpoint layouts (detection, assets folder, gaps), quantize,
and the front ends (the `fast` command, the Fast nodes)."""

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    check_torchrun_cli_equals_one_process,
    fast_args,
    fast_sample,
    node_inputs,
    record_forwards,
)
from lingbot_world import cli
from lingbot_world.loaders import fast_checkpoint as FC
from lingbot_world.loaders import formats as F
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.camera_files import CameraInput
from lingbot_world.loaders.stream import load_expert
from lingbot_world.loaders.text_encode import encode_prompts
from lingbot_world.loaders.vae import load_vae
from lingbot_world.loaders.video import read_mp4_info
from lingbot_world.session import doctor, fast_run
from lingbot_world.session.controls import KeySteering, keys_camera
from lingbot_world.wan import i2v
from lingbot_world.wan.actions import actions_to_poses
from lingbot_world.wan.camera_presets import preset_intrinsics
from lingbot_world.wan.config import CHUNKED_KINDS, V2_1_3B
from lingbot_world.wan.dit import WanModel
from lingbot_world.wan.fast import FastConfig, FastSession, fast_frame_num, fast_latent_frames, generate_fast
from lingbot_world.wan.fast_camera import chunk_key_rows, parse_keys_line
from lingbot_world.wan.vae import to_comfy_latent
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parent / "golden" / "v2.safetensors"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "00"
# Upstream in fp32 vs ours in fp32: only accumulation order differs (as for v1 Fast's golden file).
TOL = dict(rtol=5e-6, atol=5e-6)
KIND = {"14b": "v2-14b", "1.3b": "v2-1.3b"}
SIZE = (6, 14, 48, 112)  # examples/00's 1280x720 image at 64*112


@functools.cache
def golden():
    with safe_open(GOLDEN, "pt") as f:
        return json.loads(f.metadata()["golden"]), {k: f.get_tensor(k) for k in f.keys()}


def golden_model() -> WanModel:
    """The tiny model upstream ran: its weights are the v1 Fast golden file's (not stored twice)."""
    meta, _ = golden()
    with safe_open(GOLDEN.parent / meta["weights"], "pt") as f:
        weights = {
            k.removeprefix("weights/"): f.get_tensor(k).float() for k in f.keys() if k.startswith("weights/")
        }
    model = WanModel(control_type="cam", **meta["config"]).eval()
    model.load_state_dict(weights, strict=True)
    model.compute_dtype = torch.float32  # upstream ran in fp32 (its attention too)
    return model


def run_spec(run: str) -> dict:
    meta, _ = golden()
    (spec,) = [r for r in meta["runs"] if r["key"] == run]
    return spec


@functools.cache
def our_camera(run: str) -> torch.Tensor:
    """Our Fast camera for examples/00 at the golden run's size and length, with 4-frame chunks."""
    meta, _ = golden()
    spec = run_spec(run)
    h, w = meta["image_hw"]
    size = i2v.latent_size(h, w, h * w)
    assert size[:2] == (spec["lat_h"], spec["lat_w"])
    cam, frames = fast_run.camera_tensor(
        CameraInput.from_dir(EXAMPLE), "cam", spec["frame_num"], size, "cpu", 4
    )
    assert frames == spec["frame_num"] == (spec["lat_f"] - 1) * 4 + 1
    return cam


# --- parity with upstream v2 ----------------------------------------------------------------------


@pytest.mark.parametrize("run", ["14b", "1.3b"])
def test_matches_upstream_v2_chunk_loop(run):
    """Every forward's flow (4 steps + the commit per chunk) and the final latent of v2's own loop, with
    our session on the kind's config and the golden run's scaled-down window."""
    meta, g = golden()
    spec = run_spec(run)
    kind = CHUNKED_KINDS[KIND[run]]
    config = FastConfig.for_kind(
        kind, seed=meta["seed"], local_attn_size=spec["local_attn_size"], sink_size=spec["sink_size"]
    )
    assert config.shift == spec["shift"] and config.chunk_frames == meta["chunk"] == 4
    assert list(config.timestep_index) == meta["timesteps_index"]
    lat = (spec["lat_f"], spec["lat_h"], spec["lat_w"])
    session = FastSession(golden_model(), g["context"], g["y"][:, : lat[0]], lat, config, "cpu")
    flows = record_forwards(session)
    cam = our_camera(run).float()  # upstream's (test_camera_matches_upstream_v2)
    want_latent = g[f"{run}/latent"]
    assert session.num_chunks == spec["lat_f"] // 4 >= 3
    for k in range(session.num_chunks):
        chunk = session.next_chunk(cam[:, :, 4 * k : 4 * k + 4])
        assert chunk.shape == (16, 4, lat[1], lat[2])
        torch.testing.assert_close(chunk, want_latent[:, 4 * k : 4 * k + 4], **TOL)
    want_flows = g[f"{run}/flows"]
    assert len(flows) == len(want_flows) == 5 * session.num_chunks
    for i, (ours, want) in enumerate(zip(flows, want_flows, strict=True)):
        torch.testing.assert_close(ours, want, **TOL, msg=lambda m, i=i: f"forward {i}: {m}")
    torch.testing.assert_close(session.latent(), want_latent, **TOL)
    assert want_latent.abs().max() > 1  # a real signal


def test_golden_runs_are_the_two_schedules_with_a_rolling_window():
    meta, g = golden()
    # the timesteps v2's loop fed: 14B shift 10 and 1.3B shift 5 on indices 0, 250, 500, 750, then the commit
    assert g["14b/t"][:5].tolist() == [999, 967, 908, 768, 0]
    assert g["1.3b/t"][:5].tolist() == [999, 937, 833, 624, 0]
    for run in ("14b", "1.3b"):
        spec = run_spec(run)
        chunks = spec["lat_f"] // meta["chunk"]
        assert chunks >= 3 and spec["lat_f"] > spec["local_attn_size"] > spec["sink_size"] > 0
        # absolute token offsets: chunk k starts at k * 4 frames
        frame_seqlen = spec["lat_h"] * spec["lat_w"] // 4
        assert g[f"{run}/start"][::5].tolist() == [4 * k * frame_seqlen for k in range(chunks)]
    assert not torch.equal(g["14b/latent"][:, :12], g["1.3b/latent"])


@pytest.mark.parametrize("run", ["14b", "1.3b"])
def test_camera_matches_upstream_v2(run):
    """Our Fast camera for examples/00 with 4-frame chunks is the one v2's loop built (bf16): every
    sampled element equal, the per-frame and per-channel sums within float64 rounding."""
    _, g = golden()
    cam = our_camera(run)
    assert cam.dtype == torch.bfloat16
    idx = g[f"{run}/cam_index"]
    assert len(idx) > 900 and torch.equal(cam.flatten()[idx], g[f"{run}/cam_values"])
    for name, dims in {"frame": (0, 1, 3, 4), "channel": (0, 2, 3, 4)}.items():
        torch.testing.assert_close(cam.sum(dim=dims, dtype=torch.float64), g[f"{run}/cam_{name}_sums"])


# --- kinds, frames ---------------------------------------------------------------------------------


def test_kinds_settings():
    fast, big, small = (FastConfig.for_kind(CHUNKED_KINDS[n]) for n in ("fast", "v2-14b", "v2-1.3b"))
    assert fast == FastConfig()  # v1 Fast: upstream's CLI defaults, unchanged
    assert (big.chunk_frames, big.timestep_index, big.shift) == (4, (0, 250, 500, 750), 10.0)
    assert (big.local_attn_size, big.sink_size) == (18, 6)  # the documented run, not the CLI's -1 / 0
    assert (small.chunk_frames, small.shift, small.local_attn_size, small.sink_size) == (4, 5.0, 18, 6)
    # explicit settings win; None keeps the kind's
    mine = FastConfig.for_kind(CHUNKED_KINDS["v2-1.3b"], shift=7.0, local_attn_size=None, sink_size=2)
    assert (mine.shift, mine.local_attn_size, mine.sink_size) == (7.0, 18, 2)
    with pytest.raises(ValueError, match="local_attn_size: must leave room for a 4-frame chunk"):
        FastConfig.for_kind(CHUNKED_KINDS["v2-14b"], local_attn_size=9).validate()


@pytest.mark.parametrize(
    ("frame_num", "lat_f", "frames"),
    [(13, 4, 13), (17, 4, 13), (33, 8, 29), (65, 16, 61), (81, 20, 77), (361, 88, 349)],
)
def test_v2_frame_rule(frame_num, lat_f, frames):
    """Whole chunks of 4 latent frames: 13 frames for the first chunk, 16 for each later one."""
    assert fast_latent_frames(frame_num, 4) == lat_f and fast_frame_num(frame_num, 4) == frames


@pytest.mark.parametrize("frame_num", [5, 9, 12])
def test_v2_frame_rule_refuses_no_chunk(frame_num):
    with pytest.raises(ValueError, match="frame_num: Fast needs at least 13 frames"):
        fast_latent_frames(frame_num, 4)


# --- checkpoints -----------------------------------------------------------------------------------

CFG = S.tiny_config(dim=256, num_heads=2, ffn_dim=256, text_len=512)  # no config: num_heads = dim / 128
ASSETS = {"models_t5_umt5-xxl-enc-bf16.pth": None, "google/umt5-xxl": "tokenizer", "Wan2.1_VAE.pth": None}


def v2_14b_repo(root: Path, nf4_ckpt: Path, seed=3) -> Path:
    """robbyant/lingbot-world-v2-14b-causal-fast's layout: assets at the root, the DiT in transformers/."""
    root.mkdir(parents=True)
    for name, src in ASSETS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(nf4_ckpt / (src or name), root / name)
    S.write_v2_14b_dit(root, CFG, seed=seed)
    return root


@pytest.fixture(scope="module")
def repo14(tmp_path_factory, nf4_ckpt):
    return v2_14b_repo(tmp_path_factory.mktemp("v2") / "lingbot-world-v2-14b-causal-fast", nf4_ckpt)


@pytest.fixture(scope="module")
def repo13(tmp_path_factory):
    return S.write_v2_1_3b(tmp_path_factory.mktemp("v2") / "lingbot-world-v2-1.3b-causal-fast", CFG, seed=4)


def test_v2_14b_repo_resolves(repo14):
    files = FC.resolve_fast_dir(repo14)
    assert files.model == repo14 / FC.V2_DIR and files.kind.name == "v2-14b"
    assert files.config == CFG and files.source.config["_class_name"] == "WanModelFast"
    assert (files.text_encoder, files.vae) == (
        repo14 / "models_t5_umt5-xxl-enc-bf16.pth",
        repo14 / "Wan2.1_VAE.pth",
    )
    assert files.tokenizer is not None and files.tokenizer.parent == repo14 / "google" / "umt5-xxl"
    assert len(files.source.files) == 8 and {r.dtype for r in files.source.tensors.values()} == {
        torch.float32
    }
    inner = FC.resolve_fast_dir(repo14 / FC.V2_DIR)  # the DiT folder itself: assets from its parent
    assert (inner.model, inner.kind, inner.vae) == (files.model, files.kind, files.vae)


def test_v2_1_3b_resolves_with_assets_dir(repo13, repo14):
    files = FC.resolve_fast_dir(repo13, assets_dir=repo14)
    assert files.model == repo13 and files.kind.name == "v2-1.3b" and files.config == CFG
    assert files.source.config == {} and not (repo13 / F.CONFIG).exists()
    assert files.vae == repo14 / "Wan2.1_VAE.pth" and files.text_encoder.parent == repo14
    # the kind can be named; a named kind wins over the layout
    assert FC.resolve_fast_dir(repo13, "v2-14b", repo14).kind.name == "v2-14b"


def test_v2_1_3b_without_assets_is_one_error(repo13):
    with pytest.raises(FileNotFoundError) as err:
        FC.resolve_fast_dir(repo13)
    msg = str(err.value)
    assert "--assets_dir" in msg and "only the DiT" in msg and FC.KINDS["v2-14b"].repo in msg
    assert len(msg.splitlines()) == 1


def test_missing_shard_is_named(tmp_path, repo14):
    folder = S.write_v2_1_3b(tmp_path / "small", CFG, seed=4)
    (folder / "model-00003-of-00006.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        FC.resolve_fast_dir(folder, assets_dir=repo14)
    msg = str(err.value)
    assert str(folder / "model-00003-of-00006.safetensors") in msg and len(msg.splitlines()) == 1
    assert "LingBot-World 2.0 1.3B causal-fast" in msg


def test_released_sizes_refuse_the_wrong_named_kind(repo13):
    source = F.detect_expert_format(repo13, require_config=False)
    small = dataclasses.replace(source, dit_config=V2_1_3B)  # what the real 1.3B's headers give
    assert FC.detect_kind(small).name == "v2-1.3b"
    with pytest.raises(F.CheckpointError, match="holds a 1.3B DiT .*not LingBot-World 2.0 14B causal-fast"):
        FC.detect_kind(small, "v2-14b")
    big = dataclasses.replace(source, dit_config=CHUNKED_KINDS["v2-14b"].dit, path=source.path.parent)
    assert FC.detect_kind(big).name == "fast"  # an A14B DiT whose files name no kind: v1 Fast
    with pytest.raises(F.CheckpointError, match="holds a 14B DiT"):
        FC.detect_kind(big, "v2-1.3b")
    assert FC.detect_kind(big, "v2-14b").name == "v2-14b"
    with pytest.raises(ValueError, match="model: expected one of auto, fast, v2-14b, v2-1.3b"):
        FC.detect_kind(source, "v3")


def test_diffusers_repack_config_names_the_chunk(tmp_path):
    folder = S.write_diffusers_expert(
        tmp_path / "transformer",
        CFG,
        shards=2,
        config={"_class_name": "CausalLingBotWorldTransformer3DModel"},
    )
    for per_block, kind in ((3, "fast"), (4, "v2-14b")):
        config = {"_class_name": "CausalLingBotWorldTransformer3DModel", "num_frames_per_block": per_block}
        (folder / F.CONFIG).write_text(json.dumps(config))
        assert FC.detect_kind(F.detect_expert_format(folder, require_config=False)).name == kind


def test_quantize_writes_v2_nf4_folders_that_keep_their_kind(tmp_path, nf4_ckpt, capsys):
    """`lingbot.py quantize` on the v2 layouts: the 14B folder's transformers/ -> transformers_nf4/ (then
    preferred by the 14B folder), the 1.3B folder -> an NF4 folder that still says it is the 1.3B."""
    repo = v2_14b_repo(tmp_path / "v2-14b", nf4_ckpt)
    assert cli.main(["quantize", str(repo), str(repo / FC.V2_NF4_DIR), "--device", "cpu"]) == 0
    meta = json.loads((repo / FC.V2_NF4_DIR / F.NF4_META).read_text())
    assert meta[FC.KIND_KEY] == "v2-14b" and meta["source"]["subfolder"] == FC.V2_DIR
    files = FC.resolve_fast_dir(repo)
    assert files.model == repo / FC.V2_NF4_DIR and files.quantized and files.kind.name == "v2-14b"
    small, dst = S.write_v2_1_3b(tmp_path / "v2-1.3b", CFG, seed=4), tmp_path / "v2-1.3b-nf4"
    assert cli.main(["quantize", str(small), str(dst), "--device", "cpu"]) == 0
    files = FC.resolve_fast_dir(dst, assets_dir=repo)
    assert files.quantized and files.kind.name == "v2-1.3b" and files.config == CFG
    # without the recorded kind an NF4 folder of a tiny model is v1 Fast's; the name still picks it
    (dst / F.NF4_META).unlink()
    assert FC.resolve_fast_dir(dst, assets_dir=repo).kind.name == "fast"
    assert FC.resolve_fast_dir(dst, "v2-1.3b", repo).kind.name == "v2-1.3b"


# --- front ends ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("embedding_cache")
def test_fast_command_and_nodes_run_the_1_3b(repo13, repo14, shipped_example, tmp_path, capsys, fake_comfy):
    """`fast --ckpt_dir <1.3B> --assets_dir <14B>` -> an MP4 of whole 4-frame chunks (13 + 16 frames), its
    latent generate_fast's with the 1.3B's settings (shift 5, window 18 / 6, steps 0/250/500/750); the
    Fast nodes on the same folder with their model defaults give the same latent."""
    out, saved = tmp_path / "o.mp4", tmp_path / "o.latent"
    extra = ["--assets_dir", str(repo14), "--action_path", str(shipped_example), "--frame_num", "33"]
    assert cli.main(fast_args(repo13, shipped_example, out, *extra, "--save_latent", str(saved))) == 0
    printed = capsys.readouterr().out
    assert (
        "LingBot-World 2.0 1.3B causal-fast: 2 chunks, 29 frames at 48*112, window 18 / sink 6, shift 5"
        in printed
    )
    assert "frames: 33 asked, 29 made (8 latent frames, whole chunks of 4)" in printed
    assert read_mp4_info(out) == {"frames": 29, "width": 112, "height": 48, "fps": 16.0}
    got = load_file(str(saved))["latent_tensor"]

    files = FC.resolve_fast_dir(repo13, assets_dir=repo14)
    with Image.open(shipped_example / "image.jpg") as img:
        image = i2v.image_to_tensor(img)
    (context,) = encode_prompts(
        files.text_encoder, ["a castle"], tokenizer_path=files.tokenizer, mode="inprocess"
    )
    y = fast_run.condition(image, load_vae(files.vae).encode, 29, SIZE, "cpu")
    cam, _ = fast_run.camera_tensor(CameraInput.from_dir(shipped_example), "cam", 33, SIZE, "cpu", 4)
    config = FastConfig.for_kind(CHUNKED_KINDS["v2-1.3b"])
    want = generate_fast(load_expert(files.source, "cpu"), context, y, cam, (8, *SIZE[:2]), config, "cpu")
    assert torch.equal(got, to_comfy_latent(want))
    # v1 Fast's settings on the same model give another latent: the kind's settings are what ran
    v1 = FastConfig.for_kind(CHUNKED_KINDS["v2-1.3b"], shift=10.0, timestep_index=FastConfig.timestep_index)
    other = generate_fast(load_expert(files.source, "cpu"), context, y, cam, (8, *SIZE[:2]), v1, "cpu")
    assert not torch.equal(other, want)

    nodes = fake_comfy(repo14, tmp_path)
    (model,) = nodes.LingBotFastLoader().load("-", False, 0.0, ckpt_dir=str(repo13))
    assert model.kind.name == "v2-1.3b"
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    sampler = nodes.LingBotFastSampler()
    defaults = {k: v[1]["default"] for k, v in sampler.INPUT_TYPES()["required"].items() if k in SETTINGS}
    assert sampler.VALIDATE_INPUTS(
        local_attn_size=defaults["local_attn_size"], sink_size=defaults["sink_size"]
    )
    (latent,) = fast_sample(nodes, model, vae, image, 33, 42, *defaults.values(), camera=camera, text=text)
    assert torch.equal(latent["samples"], got)
    (model,) = nodes.LingBotFastLoader().load("-", False, 0.0, ckpt_dir=str(repo14))
    assert model.kind.name == "v2-14b" and model.source.path == repo14 / FC.V2_DIR


SETTINGS = ("shift", "local_attn_size", "sink_size")


def test_fast_command_steers_the_14b_folder_with_keys(repo14, shipped_example, tmp_path, capsys):
    """The 14B folder with a keys file: 2 lines -> 2 chunks of 4 latent frames (13 + 16 frames), the
    documented window with an explicit sink."""
    keys = tmp_path / "keys.txt"
    keys.write_text("w\nwj\n")
    out = tmp_path / "big.mp4"
    assert cli.main(fast_args(repo14, shipped_example, out, "--keys", str(keys), "--sink_size", "2")) == 0
    printed = capsys.readouterr().out
    assert (
        "LingBot-World 2.0 14B causal-fast: 2 chunks, 29 frames at 48*112, window 18 / sink 2, shift 10"
        in printed
    )
    assert read_mp4_info(out)["frames"] == 29


def test_keys_steering_takes_4_frame_chunks():
    """Chunk k's camera from the keys of chunks 0..k, 4 latent frames a chunk: 12 key rows for chunk 0
    (13 frames), then 16; latent frame i sits on act2cam's pose at video frame 4i."""
    intr = preset_intrinsics(np.ones(1), SIZE[2:])
    lines = ["w", "wj", "none"]
    full = keys_camera(lines, SIZE, intr, chunk=4)
    assert full.shape[2] == 12
    steering = KeySteering(SIZE, intr, chunk=4)
    for k, line in enumerate(lines):
        steering.add(parse_keys_line(line))
        assert torch.equal(steering.camera(k), full[:, :, 4 * k : 4 * k + 4])
    assert [chunk_key_rows(k, 4) for k in range(3)] == [12, 16, 16]
    rows = np.repeat(
        np.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0], [0] * 8], np.float32), [12, 16, 16], 0
    )
    poses = actions_to_poses(rows[:, :4], rows[:, 4:])
    np.testing.assert_allclose(steering.latent_poses().numpy(), poses[::4], atol=1e-6)


def test_fast_nodes_list_v2_folders(repo14, tmp_path, monkeypatch, fake_comfy):
    nodes = fake_comfy(repo14, tmp_path)
    rel = [
        "lingbot-world-v2-14b-causal-fast/transformers/model-00001-of-00008.safetensors",
        "lingbot-world-v2-1.3b-causal-fast/model-00006-of-00006.safetensors",
        "lingbot_world_fast/diffusion_pytorch_model-00001-of-00016.safetensors",
        "loras/style.safetensors",
    ]
    monkeypatch.setattr(sys.modules["folder_paths"], "get_filename_list", lambda kind: rel)
    assert sys.modules["lingbot_world.nodes.fast"].fast_choices() == [
        "lingbot-world-v2-1.3b-causal-fast",
        "lingbot-world-v2-14b-causal-fast/transformers",
        "lingbot_world_fast",
    ]
    assert "v2-1.3b" in nodes.LingBotFastLoader.INPUT_TYPES()["optional"]["model_kind"][0]


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing-shard", "missing or unusable: {folder}/model-00002-of-00006.safetensors"),
        ("no-assets", "holds only the DiT; give the text encoder"),
        ("short", "--frame_num: Fast needs at least 13 frames (one chunk of 4 latent frames), got 9"),
    ],
)
def test_bad_v2_input_exits_2_with_one_line(case, needle, repo14, shipped_example, tmp_path, capsys):
    folder = S.write_v2_1_3b(tmp_path / "small", CFG, seed=4)
    extra = ["--assets_dir", str(repo14)]
    if case == "missing-shard":
        (folder / "model-00002-of-00006.safetensors").unlink()
    elif case == "no-assets":
        extra = []
    else:
        extra += ["--frame_num", "9"]
    out = tmp_path / "never.mp4"
    assert cli.main(fast_args(folder, shipped_example, out, *extra)) == 2
    err = capsys.readouterr().err
    assert needle.format(folder=folder) in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_unbounded_cache_asked_for_takes_no_sink():
    """`--local_attn_size -1` on a v2 model (documented sink 6) means all frames and no sink, not an error
    about a sink the user never typed; an explicit sink with it is still refused."""
    kind = CHUNKED_KINDS["v2-1.3b"]
    config = fast_run.fast_config(None, 42, -1, None, "bf16", kind)
    assert (config.local_attn_size, config.sink_size, config.chunk_frames) == (-1, 0, 4)
    with pytest.raises(ValueError, match="sink_size"):
        fast_run.fast_config(None, 42, -1, 6, "bf16", kind)


def test_output_never_replaces_an_assets_file(repo13, repo14, shipped_example, tmp_path, capsys):
    """The 1.3B reads its VAE from --assets_dir: --output (with --overwrite) onto it is refused."""
    vae = next(p for p in repo14.iterdir() if p.name.startswith("Wan2.1_VAE"))
    before = vae.read_bytes()
    args = fast_args(repo13, shipped_example, vae, "--assets_dir", str(repo14), "--overwrite")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--assets_dir" in err and "Traceback" not in err
    assert vae.read_bytes() == before


def test_doctor_checks_v2_folders(repo13, repo14, capsys):
    """doctor on a v2 14B folder checks its DiT, text encoder and VAE without asking for base-cam experts;
    the 1.3B's assets come from --assets_dir."""
    checks = {c.name: c for c in doctor.check_checkpoints(repo14)}
    assert "checkpoints" not in checks and checks["Fast model"].ok and "v2-14b" in checks["Fast model"].detail
    assert checks["text encoder"].ok and checks["VAE"].ok
    checks = {c.name: c for c in doctor.check_checkpoints(repo13, repo14)}
    assert checks["Fast model"].ok and "v2-1.3b" in checks["Fast model"].detail and checks["VAE"].ok
    (bad,) = [c for c in doctor.check_checkpoints(repo13) if not c.ok]
    assert "--assets_dir" in bad.detail


@pytest.mark.usefixtures("nothing_loads")
def test_a_degree_that_does_not_split_the_heads_exits_2_before_loading(
    repo14, shipped_example, tmp_path, capsys
):
    """The tiny v2 DiT has 2 heads: --ulysses_size 3 is refused naming the degrees that work, before torchrun's
    world is even checked and before anything loads."""
    out = tmp_path / "never.mp4"
    assert cli.main(fast_args(repo14, shipped_example, out, "--ulysses_size", "3")) == 2
    err = capsys.readouterr().err
    assert "--ulysses_size 3 must divide the model's 2 attention heads (1, 2)" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert cli.main(fast_args(repo14, shipped_example, out, "--ulysses_size", "2")) == 2  # not under torchrun
    assert "torchrun --nproc_per_node 2 lingbot.py fast" in capsys.readouterr().err  # fast's own launch line


@pytest.mark.slow
@pytest.mark.usefixtures("embedding_cache")
def test_fast_under_torchrun_two_ranks_equals_one_process(repo13, repo14, shipped_example, tmp_path):
    """`torchrun --nproc_per_node 2 lingbot.py fast ... --parallel auto` on the 1.3B layout: rank 0 alone
    writes the MP4, whose latent is the one-process run's."""

    def args(name):
        extra = ["--assets_dir", str(repo14), "--action_path", str(shipped_example), "--frame_num", "29"]
        return fast_args(
            repo13,
            shipped_example,
            tmp_path / f"{name}.mp4",
            *extra,
            "--save_latent",
            str(tmp_path / f"{name}.latent"),
        )

    check_torchrun_cli_equals_one_process(args, tmp_path, 29)
