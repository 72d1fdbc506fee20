"""The generation flow end to end on tiny random checkpoints: CLI, layouts, determinism, memory, errors."""

import gc
import shutil
import sys
import weakref

import numpy as np
import pytest
import torch
from helpers import fake_module
from lingbot_world import cli
from lingbot_world.loaders import checkpoints, synthetic
from lingbot_world.loaders.experts import ExpertSwitcher
from lingbot_world.loaders.text_encode import encode_prompts
from lingbot_world.loaders.vae import load_vae
from lingbot_world.loaders.video import read_mp4_info
from lingbot_world.wan import i2v, pipeline, schedulers
from lingbot_world.wan.config import SampleConfig
from lingbot_world.wan.speed import SpeedOptions, SpeedStats
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("embedding_cache")


@pytest.fixture(scope="session")
def upstream_ckpt(tmp_path_factory, nf4_ckpt):
    """Upstream's layout: diffusers bf16 experts (one sharded) + the same T5, tokenizer and VAE."""
    root = tmp_path_factory.mktemp("upstream")
    cfg = synthetic.tiny_config("cam", text_dim=32, text_len=512)
    synthetic.write_diffusers_expert(root / "high_noise_model", cfg, seed=1, shards=2)
    synthetic.write_diffusers_expert(root / "low_noise_model", cfg, seed=2)
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        shutil.copy(nf4_ckpt / name, root / name)
    shutil.copytree(nf4_ckpt / "tokenizer", root / "google" / "umt5-xxl")
    return root


def generate_args(ckpt, example, out, *extra):
    return [
        "generate",
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(example / "image.jpg"),
        "--prompt",
        "a castle in the jungle",
        "--action_path",
        str(example),
        "--size",
        "64*112",
        "--frame_num",
        "9",
        "--sampling_steps",
        "6",
        "--device",
        "cpu",
        "--output",
        str(out),
        *extra,
    ]


def test_cli_generate_nf4_layout_writes_expected_mp4(nf4_ckpt, shipped_example, tmp_path, capsys):
    out = tmp_path / "out.mp4"
    assert cli.main(generate_args(nf4_ckpt, shipped_example, out, "--report", str(tmp_path / "r.json"))) == 0
    info = read_mp4_info(out)
    assert info == {"frames": 9, "width": 112, "height": 48, "fps": 16.0}
    printed = capsys.readouterr().out
    for phase in ("text_encode", "camera", "vae_encode", "denoise_high", "denoise_low", "vae_decode"):
        assert phase in printed
    assert "denoise_high" in (tmp_path / "r.json").read_text()


@pytest.mark.parametrize("extra", [[], ["--quantize"]], ids=["bf16", "quantize-while-loading"])
def test_cli_generate_upstream_layout(upstream_ckpt, shipped_example, tmp_path, extra):
    out = tmp_path / "up.mp4"
    assert cli.main(generate_args(upstream_ckpt, shipped_example, out, "--t5_mode", "inprocess", *extra)) == 0
    assert read_mp4_info(out)["frames"] == 9


def test_action_string_drives_the_cam_model(nf4_ckpt, shipped_example, tmp_path):
    out = tmp_path / "keys.mp4"
    args = generate_args(
        nf4_ckpt, shipped_example, out, "--action_string", "w-3,l-2", "--t5_mode", "inprocess"
    )
    args[args.index("--frame_num") : args.index("--frame_num") + 2] = []  # frames come from the string
    assert cli.main(args) == 0
    assert read_mp4_info(out)["frames"] == 5  # 5 key frames, already 4n+1


class Parts:
    """The pieces the CLI assembles, loaded once for the library-level tests."""

    def __init__(self, ckpt, example):
        self.files = checkpoints.resolve_checkpoint_dir(ckpt)
        from PIL import Image

        self.image = i2v.image_to_tensor(Image.open(example / "image.jpg"))
        self.context, self.context_null = encode_prompts(
            self.files.text_encoder,
            ["a castle", "blurry"],
            tokenizer_path=self.files.tokenizer,
            mode="inprocess",
        )
        self.vae = load_vae(self.files.vae)
        self.size = i2v.latent_size(self.image.shape[1], self.image.shape[2], 64 * 112)

    def sample(self, switcher, seed=42, hooks=None, steps=6, **speed):
        settings = SampleConfig(sample_steps=steps, seed=seed)
        return pipeline.sample(
            image=self.image,
            context=self.context,
            context_null=self.context_null,
            vae=self.vae,
            experts=switcher,
            release_experts=switcher.release,
            size=self.size,
            frame_num=9,
            settings=settings,
            hooks=hooks,
            **speed,
        )


@pytest.fixture(scope="module")
def parts(nf4_ckpt, shipped_example, tmp_path_factory):
    import os

    os.environ.setdefault("LINGBOT_WORLD_CACHE", str(tmp_path_factory.mktemp("cache")))
    return Parts(nf4_ckpt, shipped_example)


def test_same_seed_same_latent_other_seed_differs(parts):
    switcher = ExpertSwitcher(parts.files.experts, "cpu")
    a = parts.sample(switcher, seed=7)
    b = parts.sample(switcher, seed=7)
    c = parts.sample(switcher, seed=8)
    assert a.shape == (16, 3, 6, 14)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_speed_options_through_sample(parts, monkeypatch):
    switcher = ExpertSwitcher(parts.files.experts, "cpu")
    plain = parts.sample(switcher)
    assert torch.equal(parts.sample(switcher, speed=SpeedOptions()), plain)
    stats = SpeedStats()
    options = SpeedOptions(cache="easycache", cache_threshold=1e6, cache_keep_first=0, cache_keep_last=0)
    cached = parts.sample(switcher, speed=options, stats=stats)
    # 3 steps per expert: two computed to get a transformation rate, the third reuses both branches
    assert stats.skipped == {"high": 2, "low": 2} and stats.forwards == {"high": 4, "low": 4}
    assert cached.shape == plain.shape and not torch.equal(cached, plain)

    encoded = []
    monkeypatch.setattr(parts.vae, "encode", lambda video: encoded.append(video))
    fake_module(monkeypatch, "sageattention", None)
    with pytest.raises(RuntimeError, match="sageattention"):
        parts.sample(switcher, speed=SpeedOptions(attention="sage"))
    assert encoded == []  # failed before any work


def test_one_expert_resident_and_all_released_after(parts):
    alive = {}
    seen_when_loading = []

    def on_load(name, model):
        gc.collect()
        seen_when_loading.append((name, sorted(k for k, ref in alive.items() if ref() is not None)))
        alive[name] = weakref.ref(model)

    switcher = ExpertSwitcher(parts.files.experts, "cpu", on_load=on_load)
    steps = []
    parts.sample(switcher, hooks=pipeline.Hooks(progress=lambda i, n, x: steps.append(switcher.resident)))
    # 6 steps at shift 10: three high-noise steps, then three low-noise ones
    assert steps == ["high"] * 3 + ["low"] * 3
    assert seen_when_loading == [("high", []), ("low", [])]  # high was gone before low loaded
    gc.collect()
    assert switcher.resident is None and all(ref() is None for ref in alive.values())


def test_ram_budget_parks_the_expert_instead_of_reloading(parts):
    switcher = ExpertSwitcher(parts.files.experts, "cpu", ram_budget=1 << 30)
    parts.sample(switcher)
    parts.sample(switcher)
    assert switcher.loads == 2  # each expert streamed once, then parked
    switcher.close()
    dropping = ExpertSwitcher(parts.files.experts, "cpu")
    parts.sample(dropping)
    parts.sample(dropping)
    assert dropping.loads == 4


def test_interrupt_releases_experts(parts):
    switcher = ExpertSwitcher(parts.files.experts, "cpu")
    calls = {"n": 0}

    def interrupted():
        calls["n"] += 1
        return calls["n"] > 4

    with pytest.raises(pipeline.Interrupted):
        parts.sample(switcher, hooks=pipeline.Hooks(interrupted=interrupted))
    assert switcher.resident is None


def test_ctrl_c_in_cli_leaves_no_output(nf4_ckpt, shipped_example, tmp_path, monkeypatch):
    real_step = schedulers.FlowUniPCScheduler.step
    count = {"n": 0}

    def step(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(schedulers.FlowUniPCScheduler, "step", step)
    out = tmp_path / "never.mp4"
    assert cli.main(generate_args(nf4_ckpt, shipped_example, out, "--t5_mode", "inprocess")) == 130
    assert list(tmp_path.glob("*.mp4")) == [] and not list(tmp_path.glob(".*partial*"))


def test_missing_files_are_listed_at_once(tmp_path, shipped_example, capsys):
    (tmp_path / "ckpt").mkdir()
    assert cli.main(generate_args(tmp_path / "ckpt", shipped_example, tmp_path / "o.mp4")) == 2
    err = capsys.readouterr().err
    for needle in (
        "high_noise_model",
        "low_noise_model",
        "models_t5_umt5-xxl-enc-bf16.pth",
        "Wan2.1_VAE.pth",
    ):
        assert needle in err


def test_frame_count_errors_and_truncation(nf4_ckpt, shipped_example, tmp_path, capsys, caplog):
    args = generate_args(nf4_ckpt, shipped_example, tmp_path / "o.mp4")
    bad = list(args)
    bad[bad.index("--frame_num") + 1] = "8"
    assert cli.main(bad) == 2
    assert "4n+1" in capsys.readouterr().err

    short = tmp_path / "short_path"
    short.mkdir()
    np.save(short / "poses.npy", np.load(shipped_example / "poses.npy")[:6])  # 6 poses -> 5 frames
    np.save(short / "intrinsics.npy", np.load(shipped_example / "intrinsics.npy")[:6])
    args = generate_args(nf4_ckpt, short, tmp_path / "short.mp4", "--t5_mode", "inprocess")
    args[args.index("--image") + 1] = str(shipped_example / "image.jpg")
    assert cli.main(args) == 0
    assert "generating 5 frames" in caplog.text
    assert read_mp4_info(tmp_path / "short.mp4")["frames"] == 5


def test_existing_output_is_never_overwritten(nf4_ckpt, shipped_example, tmp_path, capsys):
    out = tmp_path / "keep.mp4"
    out.write_bytes(b"precious")
    assert cli.main(generate_args(nf4_ckpt, shipped_example, out)) == 2
    assert out.read_bytes() == b"precious"
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--size", "480x"), ("--guide_scale", "1 2 3"), ("--solver", "dpm")])
def test_bad_arguments(nf4_ckpt, shipped_example, tmp_path, flag, value):
    args = generate_args(nf4_ckpt, shipped_example, tmp_path / "o.mp4")
    if flag in args:
        i = args.index(flag)
        args[i + 1 : i + 2] = value.split()
    else:
        args += [flag, *value.split()]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code not in (0, None)


def test_cli_swap_blocks_gives_the_same_latent(nf4_ckpt, shipped_example, tmp_path):
    from safetensors.torch import load_file

    latents = {}
    for swap in ("0", "2", "auto"):
        out, lat = tmp_path / f"s{swap}.mp4", tmp_path / f"s{swap}.latent"
        args = generate_args(nf4_ckpt, shipped_example, out, "--t5_mode", "inprocess", "--swap_blocks", swap)
        assert cli.main([*args, "--save_latent", str(lat)]) == 0
        latents[swap] = load_file(lat)
    assert latents["0"].keys() == latents["2"].keys() == latents["auto"].keys()
    for k, v in latents["0"].items():
        assert torch.equal(v, latents["2"][k]) and torch.equal(v, latents["auto"][k]), k
    args = generate_args(nf4_ckpt, shipped_example, tmp_path / "x.mp4", "--swap_blocks", "99")
    assert cli.main(args) != 0


def test_cli_t5_overlap_gives_the_same_latent(nf4_ckpt, shipped_example, tmp_path, capsys):
    """The text encoded in the background (its child beside the first-frame encode and the first expert's
    load) gives the latent of the encode-first order; the report marks the background phase."""
    import json

    latents, reports = {}, {}
    for mode in ("on", "off"):  # 'on' first: its child encodes (a miss); 'off' then reads the same cache
        out, lat, rep = (tmp_path / f"{mode}.{x}" for x in ("mp4", "latent", "json"))
        args = generate_args(nf4_ckpt, shipped_example, out, "--t5_overlap", mode)
        assert cli.main([*args, "--save_latent", str(lat), "--report", str(rep)]) == 0
        latents[mode], reports[mode] = load_file(lat)["latent_tensor"], json.loads(rep.read_text())
        printed = capsys.readouterr().out
        assert ("in the background; the run waited" in printed) == (mode == "on")
    assert torch.equal(latents["on"], latents["off"])
    text = reports["on"][0]  # it ran from the start, beside the phases listed after it
    assert (
        text == {"phase": "text_encode", "seconds": text["seconds"], "background": True}
        and text["seconds"] > 0
    )
    assert [r["phase"] for r in reports["on"]].count("text_encode") == 1
    assert [r["phase"] for r in reports["off"]][0] == "text_encode" and "background" not in reports["off"][0]
    # the auto choice on the CPU (no VRAM budget to plan both against) keeps the encode-first order
    args = generate_args(nf4_ckpt, shipped_example, tmp_path / "auto.mp4")
    assert cli.main(args) == 0 and "in the background" not in capsys.readouterr().out


def test_sample_takes_either_embeddings_or_a_pending_encode():
    def pending():
        raise AssertionError("never waited for")

    args = dict(
        image=None,
        vae=None,
        experts=None,
        release_experts=lambda: None,
        size=(4, 4, 32, 32),
        frame_num=5,
        settings=SampleConfig(),
        text=pending,
    )
    with pytest.raises(ValueError, match="stands for context"):
        pipeline.sample(context=torch.zeros(3, 8), context_null=None, **args)
    with pytest.raises(ValueError, match="not under parallel"):
        pipeline.sample(context=None, context_null=None, parallel=object(), **args)


def test_cli_t5_overlap_child_failure_ends_the_run_cleanly(
    nf4_ckpt, shipped_example, tmp_path, capsys, monkeypatch
):
    import threading

    from lingbot_world.loaders import text_encode

    code = "import sys; print('encoder broke'); sys.exit(3)"
    monkeypatch.setattr(
        text_encode, "_child_command", lambda request: [sys.executable, "-c", code, str(request)]
    )
    out = tmp_path / "x.mp4"
    args = generate_args(
        nf4_ckpt, shipped_example, out, "--t5_overlap", "on", "--prompt", "a prompt no cache has"
    )
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "exited with status 3" in err and "encoder broke" in err and "Traceback" not in err
    assert not out.exists() and not any(t.name == "text-encode" for t in threading.enumerate())


def test_cli_t5_overlap_refuses_an_in_process_encoder(nf4_ckpt, shipped_example, tmp_path, capsys):
    args = generate_args(
        nf4_ckpt, shipped_example, tmp_path / "x.mp4", "--t5_overlap", "on", "--t5_mode", "inprocess"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert (
        exit_info.value.code == 2 and "--t5_overlap on: needs --t5_mode subprocess" in capsys.readouterr().err
    )


def test_cli_merges_a_lora_into_bf16_experts_while_quantizing(
    upstream_ckpt, shipped_example, tmp_path, capsys
):
    """--quantize --lora_merge on upstream's bf16 experts: runs, and changes the result like the side path does."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    dim = checkpoints.resolve_checkpoint_dir(upstream_ckpt).config.dim
    lora = tmp_path / "l.safetensors"
    save_file(
        {
            "lora_unet_blocks_0_self_attn_q.lora_down.weight": torch.randn(2, dim, generator=g),
            "lora_unet_blocks_0_self_attn_q.lora_up.weight": torch.randn(dim, 2, generator=g),
        },
        str(lora),
    )
    latents = {}
    for name, extra in (("plain", []), ("merged", ["--lora", str(lora), "--lora_merge"])):
        out = tmp_path / f"{name}.latent"
        args = generate_args(
            upstream_ckpt,
            shipped_example,
            tmp_path / f"{name}.mp4",
            "--quantize",
            "--t5_mode",
            "inprocess",
            "--save_latent",
            str(out),
            *extra,
        )
        assert cli.main(args) == 0, capsys.readouterr().err
        latents[name] = load_file(str(out))["latent_tensor"]
    assert not torch.equal(latents["plain"], latents["merged"])
