"""The one preparation path: every check of a request in one place, made before any model loads, and
the CLI and the sampler node giving the same latent for the same request."""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import NODE_SIZE, args_for, node_inputs, tiny_lora
from lingbot_world import cli
from lingbot_world.loaders import checkpoints
from lingbot_world.loaders.camera_files import CameraInput
from lingbot_world.loaders.experts import ExpertSwitcher
from lingbot_world.loaders.lora import LoraSpec
from lingbot_world.session import generate, request
from lingbot_world.wan.config import DiTConfig, SampleConfig
from lingbot_world.wan.lora import LoraError, attached_loras
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
CAM = DiTConfig(text_dim=32)
PLAIN = replace(CAM, control_type=None)
DEFAULTS = SampleConfig()


pytestmark = pytest.mark.usefixtures("embedding_cache")


@pytest.fixture
def ckpt(nf4_ckpt):
    return nf4_ckpt


def plan(settings=DEFAULTS, **kw):
    kw = {"max_area": 64 * 112, **kw}
    return request.plan_request((480, 832), kw.pop("config", CAM), settings, **kw)


# ------------------------------------------------------------------ plan_request


@pytest.mark.parametrize(
    "change, param",
    [
        ({"sample_steps": 0}, "sample_steps"),
        ({"sample_steps": 1001}, "sample_steps"),
        ({"sample_steps": 2.5}, "sample_steps"),
        ({"sample_shift": 0.0}, "sample_shift"),
        ({"sample_shift": float("nan")}, "sample_shift"),
        ({"boundary": 1.5}, "boundary"),
        ({"guide_scale": (1.0, 2.0, 3.0)}, "guide_scale"),
        ({"guide_scale": (float("inf"), 5.0)}, "guide_scale"),
        ({"guide_scale": (-1.0, 5.0)}, "guide_scale"),
        ({"sample_fps": 0}, "sample_fps"),
        ({"solver": "dpm"}, "solver"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_settings_out_of_range_are_named(change, param):
    with pytest.raises(request.RequestError) as err:
        plan(replace(SampleConfig(), **change))
    assert err.value.param == param and str(err.value).startswith(param)


def test_frames_and_sizes_are_bounded_before_anything_is_built():
    with pytest.raises(request.RequestError, match="at most 1601") as err:
        plan(frame_num=100001)
    assert err.value.param == "frame_num"
    with pytest.raises(request.RequestError, match="4n\\+1"):
        plan(frame_num=8)
    with pytest.raises(request.RequestError, match="tokens") as err:
        plan(frame_num=1601, max_area=None, width=1280, height=1280)
    assert err.value.param == "size"
    with pytest.raises(request.RequestError, match="not both"):
        plan(width=832, height=480)
    with pytest.raises(request.RequestError, match="multiple of 16"):
        plan(max_area=None, width=830, height=480)


def test_action_string_is_bounded_and_sets_the_length(shipped_example):
    cam = CameraInput.from_dir(shipped_example, "w-100000")
    with pytest.raises(request.RequestError, match="at most 1601") as err:
        plan(camera=cam)
    assert err.value.param == "action_string"
    assert plan(camera=CameraInput.from_dir(shipped_example, "w-10,a-6")).frame_num == 17


def test_plan_caps_frames_at_the_pose_path_and_checks_the_experts(shipped_example):
    cam = CameraInput.from_dir(shipped_example)
    p = plan(camera=cam, frame_num=81)
    assert p.frame_num == p.settings.frame_num == min(81, (len(cam.poses) - 1) // 4 * 4 + 1)
    assert p.size == (8, 12, 64, 96) and p.tokens == 21 * 8 * 12 // 4  # upstream sizing of 480x832
    with pytest.raises(request.RequestError, match="no camera layers"):
        plan(camera=cam, config=PLAIN)
    with pytest.raises(request.RequestError, match="width 4096, the experts expect 32"):
        plan(text_dim=4096)


def test_inputs_pack_the_camera_and_check_the_text(shipped_example):
    p = plan(camera=CameraInput.from_dir(shipped_example), frame_num=9)
    image = torch.zeros(3, 480, 832)
    ctx = torch.zeros(5, 32)
    inputs = p.inputs(image, ctx, ctx, "cpu")
    assert inputs["cam"].shape == (1, 384, 3, 8, 12) and torch.isfinite(inputs["cam"]).all()
    assert inputs["frame_num"] == 9 and inputs["size"] == p.size and inputs["settings"] is p.settings
    with pytest.raises(request.RequestError, match="width 16"):
        p.inputs(image, torch.zeros(5, 16), ctx, "cpu")
    with pytest.raises(request.RequestError, match="context_null"):
        p.inputs(image, ctx, torch.zeros(5), "cpu")
    # guide scale 1 throughout runs no CFG: no negative embeddings needed; any CFG step needs them
    assert p.needs_negative and not plan(settings=replace(DEFAULTS, guide_scale=(1.0, 1.0))).needs_negative
    assert (
        plan(settings=replace(DEFAULTS, guide_scale=(1.0, 1.0))).inputs(image, ctx, None, "cpu")[
            "context_null"
        ]
        is None
    )
    with pytest.raises(request.RequestError, match="context_null: guide scale .* needs the negative"):
        plan(settings=replace(DEFAULTS, guide_scale=(1.0, 3.0))).inputs(image, ctx, None, "cpu")


@pytest.mark.parametrize("guide, encoded", [(["1"], 1), (["1", "2"], 2), (["5"], 2)])
def test_cli_encodes_the_negative_prompt_only_for_cfg(
    ckpt, shipped_example, tmp_path, monkeypatch, guide, encoded
):
    from lingbot_world.loaders import text_encode

    real, seen = text_encode.encode_prompts, []
    monkeypatch.setattr(
        text_encode,
        "encode_prompts",
        lambda path, prompts, **kw: (seen.append(list(prompts)), real(path, prompts, **kw))[1],
    )
    monkeypatch.setenv("LINGBOT_WORLD_CACHE", str(tmp_path / "cache"))
    args = args_for(ckpt, shipped_example, tmp_path / "o.mp4", "--t5_mode", "inprocess")
    assert cli.main([*args, "--guide_scale", *guide]) == 0
    assert len(seen) == 1 and len(seen[0]) == encoded and seen[0][0] == "a castle"


# ------------------------------------------------------------------ the CLI refuses before anything loads


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model load during the test fails it: the errors must come first."""

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the request was checked")

    for name in ("encode_prompts",):
        monkeypatch.setattr(cli.text_encode, name, loaded)
    monkeypatch.setattr(generate, "load_vae", loaded)
    monkeypatch.setattr(generate, "ExpertSwitcher", loaded)


def _set(args, flag, *values):
    if flag in args:
        i = args.index(flag)
        args[i + 1 : i + 2] = list(values)
    else:
        args += [flag, *values]
    return args


@pytest.mark.parametrize(
    "flag, values, needle",
    [
        ("--sampling_steps", ["0"], "--sampling_steps: expected an integer in [1, 1000]"),
        ("--seed", ["18446744073709551616"], "--seed: expected an integer"),
        ("--fps", ["0"], "--fps: expected an integer in [1, 240]"),
        ("--frame_num", ["100001"], "--frame_num: at most 1601"),
        ("--boundary", ["2"], "--boundary: expected a number in [0, 1]"),
        ("--device", ["mps"], "--device: only cpu and cuda"),
        ("--device", ["nonsense"], "--device: expected cpu, cuda or cuda:N"),
        ("--attention", ["sage"], "--attention: attention='sage' needs the `sageattention` package"),
    ],
)
def test_bad_values_exit_2_before_loading(
    ckpt, shipped_example, tmp_path, capsys, nothing_loads, flag, values, needle
):
    out = tmp_path / "o.mp4"
    assert cli.main(_set(args_for(ckpt, shipped_example, out), flag, *values)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err and not out.exists()


def test_action_string_too_long_exits_2_quickly(ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    t = time.perf_counter()
    args = args_for(ckpt, shipped_example, tmp_path / "o.mp4", "--action_string", "w-100000")
    i = args.index("--frame_num")
    del args[i : i + 2]  # the keys set the length
    assert cli.main(args) == 2
    assert "--action_string: drives 100001 frames" in capsys.readouterr().err
    assert time.perf_counter() - t < 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda(ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    assert cli.main(_set(args_for(ckpt, shipped_example, tmp_path / "o.mp4"), "--device", "cuda")) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_output_paths_are_checked_first(ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    assert cli.main(args_for(ckpt, shipped_example, tmp_path / "missing" / "o.mp4")) == 2
    assert "output folder" in capsys.readouterr().err and not (tmp_path / "missing").exists()
    folder = tmp_path / "a_folder"
    folder.mkdir()
    assert cli.main(args_for(ckpt, shipped_example, folder, "--overwrite")) == 2
    assert "is a folder" in capsys.readouterr().err and folder.is_dir()
    args = args_for(
        ckpt, shipped_example, tmp_path / "o.mp4", "--save_latent", str(tmp_path / "no" / "x.latent")
    )
    assert cli.main(args) == 2
    assert "output folder" in capsys.readouterr().err


def test_guide_scale_takes_one_or_two_values(ckpt, shipped_example, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_set(args_for(ckpt, shipped_example, tmp_path / "o.mp4"), "--guide_scale", "1", "2", "3"))
    assert exit_info.value.code == 2
    assert "error: argument --guide_scale: takes one or two values" in capsys.readouterr().err
    assert cli.guide_pair([3.0]) == (3.0, 3.0) and cli.guide_pair([1.0, 2.0]) == (1.0, 2.0)


def test_text_encoder_of_another_width_is_refused_before_encoding(
    ckpt, shipped_example, tmp_path, capsys, monkeypatch, nothing_loads
):
    monkeypatch.setattr(generate, "read_encoder_config", lambda path: {"dim": 4096})
    assert cli.main(args_for(ckpt, shipped_example, tmp_path / "o.mp4")) == 2
    assert "text encoder: embeddings have width 4096, the experts expect 32" in capsys.readouterr().err


def test_bad_vae_is_reported_before_encoding(ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    bad = tmp_path / "ckpt"
    bad.mkdir()
    for entry in ckpt.iterdir():
        (bad / entry.name).symlink_to(entry)
    (bad / "Wan2.1_VAE.pth").unlink()
    (bad / "Wan2.1_VAE.pth").symlink_to(ckpt / "models_t5_umt5-xxl-enc-bf16.pth")  # the wrong model
    assert cli.main(args_for(bad, shipped_example, tmp_path / "o.mp4")) == 2
    assert "not a Wan VAE checkpoint" in capsys.readouterr().err


def test_sigterm_ends_cleanly(ckpt, shipped_example, tmp_path):
    """SIGTERM mid-run: exit 143, no output or partial file, no child left (the T5 child included)."""
    out = tmp_path / "o.mp4"
    args = [sys.executable, str(ROOT / "lingbot.py"), *args_for(ckpt, shipped_example, out)]
    env = {**os.environ, "LINGBOT_WORLD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    head = ""
    while "\npeak " not in head:  # the memory plan's last line: text encoding starts next
        line = proc.stdout.readline()
        assert line, head[-2000:]
        head += line
    time.sleep(1)  # inside text encoding (the T5 child is running)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=60)
    log = head + log
    assert proc.returncode == 143, log[-2000:]
    assert "terminated" in log and "Traceback" not in log
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    assert children.strip() == ""


# ------------------------------------------------------------------ CLI and sampler node: one path


def test_switcher_attaches_the_plans_loras(ckpt, tmp_path):
    files = checkpoints.resolve_checkpoint_dir(ckpt)
    lora = tiny_lora(tmp_path / "l.safetensors", files.config)
    p = plan(config=files.config, loras=[LoraSpec(lora, 0.5, "low")])
    assert [len(p.loras[e]) for e in ("high", "low")] == [0, 1]
    switcher = ExpertSwitcher(files.experts, "cpu", loras=p.loras)
    assert attached_loras(switcher("high")) == []
    assert [h.lora.strength for h in attached_loras(switcher("low"))] == [0.5]
    switcher.close()
    with pytest.raises(LoraError, match="match"):
        plan(config=replace(files.config, num_layers=1), loras=[LoraSpec(lora)])  # blocks.1 does not exist


def test_cli_and_sampler_node_give_the_same_latent(ckpt, shipped_example, tmp_path, fake_comfy, capsys):
    """The same request (a LoRA on the low-noise expert included) through both front ends."""
    latent_file = tmp_path / "cli.latent"
    lora = tiny_lora(tmp_path / "style.safetensors", checkpoints.resolve_checkpoint_dir(ckpt).config)
    args = args_for(
        ckpt,
        shipped_example,
        tmp_path / "o.mp4",
        "--t5_mode",
        "inprocess",
        "--seed",
        "7",
        "--guide_scale",
        "4",
        "6",
        "--save_latent",
        str(latent_file),
        "--lora",
        f"{lora}:0.7:low",
        "--cache",
        "easycache",
        "--cache_threshold",
        "0.5",
        "2",
        "--cache_keep_first",
        "2",
        "--cache_keep_last",
        "0",
    )
    assert cli.main(_set(args, "--sampling_steps", "10")) == 0
    skipped = re.search(r"(\d+) skipped by the step cache", capsys.readouterr().out)
    assert skipped and int(skipped.group(1)) > 0  # the cache did work, so the node must match it
    saved = load_file(str(latent_file))
    assert set(saved) == {"latent_tensor", "latent_format_version_0"}

    nodes = fake_comfy(ckpt, tmp_path)
    (experts,) = nodes.LingBotExpertsLoader().load("", "", False, 0.0, ckpt_dir=str(ckpt))
    (experts,) = nodes.LingBotLoRA().apply(experts, lora.name, 0.7, "low", False)
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    (speed,) = nodes.LingBotSpeed().options("sdpa", False, "easycache", 0.0, 2, 0)
    speed = replace(speed, cache_threshold=(0.5, 2.0))  # the node's one threshold; the CLI's pair form
    (out,) = nodes.LingBotSampler().sample(
        experts,
        vae,
        image,
        *NODE_SIZE,
        9,
        10,
        10.0,
        0.947,
        4.0,
        6.0,
        7,
        "unipc",
        camera=camera,
        speed=speed,
        text=text,
    )
    assert out["samples"].shape == saved["latent_tensor"].shape == (1, 16, 3, 6, 14)
    assert torch.equal(out["samples"], saved["latent_tensor"])


def _node_latent(nodes, experts, example, guide=(4.0, 6.0)):
    """The sampler node's latent for the request `args_for` makes (2 steps, seed 7, 64*112, 9 frames)."""
    text, vae, camera, image = node_inputs(nodes, example)
    (out,) = nodes.LingBotSampler().sample(
        experts,
        vae,
        image,
        *NODE_SIZE,
        9,
        2,
        10.0,
        0.947,
        *guide,
        7,
        "unipc",
        camera=camera,
        text=text,
    )
    return out["samples"]


def test_sampler_node_asks_comfyui_for_the_planners_denoise_figure(
    nf4_ckpt, shipped_example, tmp_path, fake_comfy
):
    """Before loading each expert the sampler node asks ComfyUI's free_memory for the planner's denoise
    figure: the expert's swap-reduced weights (`expert_vram`) plus the activations, for any swap_blocks
    (swapping 24 or all 40 blocks asked too little, or a negative amount, when the whole expert was
    subtracted from a figure that counts only its resident part)."""
    import shutil

    from lingbot_world.loaders import synthetic
    from lingbot_world.session import planner as memplan
    from lingbot_world.wan import i2v

    config = replace(checkpoints.resolve_checkpoint_dir(nf4_ckpt).config, num_layers=40)
    ckpt = tmp_path / "deep"
    synthetic.write_nf4_expert(ckpt / "high_noise_model_bnb_nf4", config, seed=1)
    synthetic.write_nf4_expert(ckpt / "low_noise_model_bnb_nf4", config, seed=2)
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth", "tokenizer"):
        (shutil.copytree if (nf4_ckpt / name).is_dir() else shutil.copy)(nf4_ckpt / name, ckpt / name)
    nodes = fake_comfy(ckpt, tmp_path)
    calls = nodes.memory.mm.free_memory_calls
    act = memplan.activation_vram(i2v.seq_len(3, 6, 14), config)  # 9 frames at 64*112: a 3x6x14 latent
    asked = {}
    for swap in (0, 24, 40):
        (experts,) = nodes.LingBotExpertsLoader().load(
            "", "", False, 0.0, ckpt_dir=str(ckpt), swap_blocks=swap
        )
        calls.clear()
        assert _node_latent(nodes, experts, shipped_example).shape == (1, 16, 3, 6, 14)
        want = [
            (memplan.expert_vram(experts.nbytes[e], 40, swap) + act, torch.device("cpu"))
            for e in ("high", "low")
        ]
        assert calls == want, swap
        asked[swap] = calls[0][0]
    block = experts.nbytes["high"] // 40
    assert asked[0] - asked[24] == 22 * block  # 24 swapped, 2 of them in flight
    assert asked[40] == experts.nbytes["high"] - 38 * block + act > 0  # the other 38 in host RAM


def test_lora_node_merges_before_quantizing_as_the_cli_does(
    nf4_ckpt, shipped_example, tmp_path, fake_comfy, capsys
):
    """LingBot LoRA's 'merge before quantizing' on bf16 experts quantized while streaming gives exactly the
    CLI's --lora_merge latent; its default (side path) gives exactly the CLI's --lora latent; NF4 experts,
    or quantize off, are refused at node time naming the files and what is needed."""
    import shutil

    from lingbot_world.loaders import synthetic

    config = checkpoints.resolve_checkpoint_dir(nf4_ckpt).config
    ckpt = tmp_path / "bf16"
    synthetic.write_diffusers_expert(ckpt / "high_noise_model", config, seed=1)
    synthetic.write_diffusers_expert(ckpt / "low_noise_model", config, seed=2)
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        shutil.copy(nf4_ckpt / name, ckpt / name)
    shutil.copytree(nf4_ckpt / "tokenizer", ckpt / "google" / "umt5-xxl")
    lora = tiny_lora(tmp_path / "style.safetensors", config, seed=4)

    cli_latents = {}
    for mode, extra in (("merge", ["--lora_merge"]), ("side", [])):
        out = tmp_path / f"{mode}.latent"
        args = args_for(
            ckpt,
            shipped_example,
            tmp_path / f"{mode}.mp4",
            "--t5_mode",
            "inprocess",
            "--seed",
            "7",
            "--guide_scale",
            "4",
            "6",
            "--quantize",
            "--lora",
            f"{lora}:0.7",
            "--save_latent",
            str(out),
            *extra,
        )
        assert cli.main(args) == 0, capsys.readouterr().err
        cli_latents[mode] = load_file(str(out))["latent_tensor"]
    assert not torch.equal(cli_latents["merge"], cli_latents["side"])

    nodes = fake_comfy(ckpt, tmp_path)
    (loaded,) = nodes.LingBotExpertsLoader().load("", "", True, 0.0, ckpt_dir=str(ckpt))
    (merged,) = nodes.LingBotLoRA().apply(loaded, lora.name, 0.7, "both", False, "merge before quantizing")
    (side,) = nodes.LingBotLoRA().apply(
        loaded, lora.name, 0.7, "both", False
    )  # a workflow saved before the mode widget
    (explicit,) = nodes.LingBotLoRA().apply(loaded, lora.name, 0.7, "both", False, "side path")
    assert (merged.lora_merge, side.lora_merge, explicit.lora_merge) == ((True,), (False,), (False,))
    assert side == explicit and merged != side  # ComfyUI's cache sees the mode too
    got = _node_latent(nodes, merged, shipped_example)
    assert torch.equal(got, cli_latents["merge"])
    switcher = merged._switcher
    assert [len(switcher.merged[e]) for e in ("high", "low")] == [1, 1] and switcher.loras["low"] == []
    assert torch.equal(_node_latent(nodes, side, shipped_example), cli_latents["side"])
    assert side._switcher.merged == {} and len(side._switcher.loras["low"]) == 1  # today's side path

    # the handle's switcher is keyed on the LoRAs' modes: another mode loads the experts again
    remoded = replace(merged, lora_merge=(False,))
    assert remoded._switcher is switcher
    assert remoded.switcher(switcher.device, {"high": [], "low": []}) is not switcher

    with pytest.raises(
        ValueError,
        match="mode 'merge before quantizing': merging happens before quantization: "
        "it needs quantize_to_nf4 on the LingBot Experts Loader",
    ):
        nodes.LingBotLoRA().apply(
            nodes.LingBotExpertsLoader().load("", "", False, 0.0, ckpt_dir=str(ckpt))[0],
            lora.name,
            0.7,
            "both",
            False,
            "merge before quantizing",
        )
    (nf4,) = nodes.LingBotExpertsLoader().load("", "", True, 0.0, ckpt_dir=str(nf4_ckpt))
    with pytest.raises(ValueError, match="these experts are stored as NF4") as err:
        nodes.LingBotLoRA().apply(nf4, lora.name, 0.7, "low", False, "merge before quantizing")
    for path in nf4.paths.values():
        assert str(path) in str(err.value)
    assert "merging needs the original bf16/fp32 experts" in str(err.value)
    with pytest.raises(
        ValueError, match="mode: expected 'side path' or 'merge before quantizing', got 'fuse'"
    ):
        nodes.LingBotLoRA().apply(nf4, lora.name, 0.7, "low", False, "fuse")


def test_swap_blocks_is_checked_and_kept_on_the_plan():
    assert plan().swap_blocks == 0
    assert plan(swap_blocks=CAM.num_layers).swap_blocks == CAM.num_layers
    assert plan(swap_blocks="auto").swap_blocks == "auto" and plan(swap_blocks=" 1 ").swap_blocks == 1
    for bad in (CAM.num_layers + 1, -1, "many", 1.5):
        with pytest.raises(request.RequestError, match=r"in \[0, ") as err:
            plan(swap_blocks=bad)
        assert err.value.param == "swap_blocks"


def test_lora_merged_before_quantization(nf4_ckpt, tmp_path, capsys):
    """--lora_merge: the LoRA is added into an original bf16 expert's dense weights as they stream in (here
    kept dense, to compare exactly), and refused for NF4 experts, which cannot take a dense delta."""
    from lingbot_world.loaders import synthetic
    from lingbot_world.loaders.lora import read_lora
    from lingbot_world.loaders.stream import build_expert_meta, load_expert

    config = checkpoints.resolve_checkpoint_dir(nf4_ckpt).config
    expert = synthetic.write_diffusers_expert(tmp_path / "bf16", config, seed=3)
    lora = read_lora(
        LoraSpec(tiny_lora(tmp_path / "l.safetensors", config), 0.5), build_expert_meta(config, set())
    )
    plain = load_expert(tmp_path / "bf16", "cpu", quantize=False)
    merged = load_expert(tmp_path / "bf16", "cpu", quantize=False, merge_loras=[lora])
    p = lora.patches["blocks.0.self_attn.q"]
    want = (plain.blocks[0].self_attn.q.weight.float() + 0.5 * p.scale * (p.up.float() @ p.down.float())).to(
        plain.blocks[0].self_attn.q.weight.dtype
    )
    assert torch.equal(merged.blocks[0].self_attn.q.weight, want)
    assert torch.equal(merged.blocks[0].self_attn.k.weight, plain.blocks[0].self_attn.k.weight)  # untouched
    del expert
    with pytest.raises(ValueError, match="stored as NF4"):
        load_expert(nf4_ckpt / "high_noise_model_bnb_nf4", "cpu", merge_loras=[lora])
    args = args_for(
        nf4_ckpt, ROOT / "examples" / "00", tmp_path / "o.mp4", "--lora", str(tmp_path / "l.safetensors")
    )
    assert cli.main([*args, "--lora_merge"]) == 2
    assert "--lora_merge: merging happens before quantization: it needs --quantize" in capsys.readouterr().err
    assert cli.main([*args, "--lora_merge", "--quantize"]) == 2
    assert "--lora_merge: these experts are stored as NF4" in capsys.readouterr().err
