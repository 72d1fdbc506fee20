"""Bad input whose error did not name what the user typed (issue 23, items 15-17, 19): each case ends in
exit code 2 with one error naming the flag or file, before any model loads, with nothing written."""

import pickle
from pathlib import Path

import pytest
import torch
from helpers import EXPERT, RunsCode, args_for, fast_args, link_copy, tiny_lora
from lingbot_world import cli
from lingbot_world.loaders import tensor_file
from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
from lingbot_world.loaders.lora import LoraSpec
from lingbot_world.loaders.synthetic_text import TINY, upstream_state_dict
from lingbot_world.session.request import read_expert_loras
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "00"
T5 = "models_t5_umt5-xxl-enc-bf16.pth"
pytestmark = pytest.mark.usefixtures("embedding_cache")


def exits_2(capsys, args, *needles, absent=()) -> str:
    """cli.main(args) exits with 2 (returned, or argparse's SystemExit) and one error naming `needles`."""
    try:
        code = cli.main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "error:" in line]) == 1, err
    for needle in needles:
        assert str(needle) in err, (needle, err)
    for word in absent:
        assert word not in err, (word, err)
    return err


def nothing_written(tmp_path: Path, *kept) -> None:
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in {"cache", *kept})
    assert left == [], left


# ------------------------------------------------------------------------------------------ item 15


@pytest.mark.parametrize("frames", ["0", "-7", "10000001"])
@pytest.mark.parametrize("source", ["preset", "folder"])
def test_camera_frames_name_the_flag(frames, source, tmp_path, capsys):
    where = ["--preset", "pan left 30 40f", "--save", str(tmp_path / "cam")]
    if source == "folder":
        where = ["--action_path", str(EXAMPLE)]
    args = ["camera", *where, "--frames", frames, "--preview", str(tmp_path / "p.png")]
    exits_2(capsys, args, "--frames", absent=["frame_num"])
    nothing_written(tmp_path)


@pytest.mark.parametrize("shift", ["0", "nan", "-3"])
def test_fast_sample_shift_names_the_flag(shift, fast_ckpt, tmp_path, capsys, nothing_loads):
    out = tmp_path / "o.mp4"
    exits_2(capsys, fast_args(fast_ckpt, EXAMPLE, out, "--sample_shift", shift), "--sample_shift: ")
    nothing_written(tmp_path)


@pytest.mark.parametrize(
    "flag, value", [("--camera_fov", "0"), ("--camera_fov", "200"), ("--camera_speed", "nan")]
)
@pytest.mark.parametrize("command", ["camera", "generate", "fast"])
def test_camera_fov_and_speed_name_the_flag(
    command,
    flag,
    value,
    nf4_ckpt,
    fast_ckpt,
    tmp_path,
    capsys,
    nothing_loads,
):
    out = tmp_path / "o.mp4"
    preset = "pan left 30 40f"
    if command == "camera":
        args = ["camera", "--preset", preset, "--save", str(tmp_path / "cam")]
    elif command == "generate":
        args = [a for a in args_for(nf4_ckpt, EXAMPLE, out) if a not in ("--action_path", str(EXAMPLE))]
        args += ["--camera_preset", preset]
    elif flag == "--camera_fov":  # keys steering: the field of view of its pinhole camera
        keys = tmp_path / "keys.txt"
        keys.write_text("w\n")
        args = fast_args(fast_ckpt, EXAMPLE, out, "--keys", str(keys))
    else:
        args = fast_args(fast_ckpt, EXAMPLE, out, "--camera_preset", preset)
    exits_2(capsys, [*args, flag, value], f"{flag}: ")
    nothing_written(tmp_path, "keys.txt")


def test_binary_keys_file_is_named(fast_ckpt, tmp_path, capsys, nothing_loads):
    keys = tmp_path / "keys.bin"
    keys.write_bytes(bytes(range(256)))
    out = tmp_path / "o.mp4"
    exits_2(
        capsys, fast_args(fast_ckpt, EXAMPLE, out, "--keys", str(keys)), "--keys", keys, "not a text file"
    )
    nothing_written(tmp_path, "keys.bin")


@pytest.mark.parametrize("flag", ["--prompt", "--n_prompt", "fast --prompt"])
def test_prompt_that_is_not_utf8_names_the_flag(flag, nf4_ckpt, fast_ckpt, tmp_path, capsys):
    """Bytes that are not UTF-8 on a POSIX command line reach Python as lone surrogates (surrogateescape)."""
    out, text = tmp_path / "o.mp4", "a castle \udcff\udcfe"
    if flag == "--n_prompt":
        args = args_for(nf4_ckpt, EXAMPLE, out, flag, text)
    else:
        args = (
            fast_args(fast_ckpt, EXAMPLE, out)
            if flag.startswith("fast")
            else args_for(nf4_ckpt, EXAMPLE, out)
        )
        args[args.index("--prompt") + 1] = text
    exits_2(capsys, args, f"argument {flag.split()[-1]}: ", "expected UTF-8 text", absent=["codec"])
    nothing_written(tmp_path)


def test_truncated_image_is_named(nf4_ckpt, tmp_path, capsys, nothing_loads):
    image = tmp_path / "truncated.jpg"
    image.write_bytes((EXAMPLE / "image.jpg").read_bytes()[:20000])
    out = tmp_path / "o.mp4"
    args = args_for(nf4_ckpt, EXAMPLE, out)
    args[args.index("--image") + 1] = str(image)
    exits_2(capsys, args, f"--image: {image} cannot be decoded")
    nothing_written(tmp_path, image.name)


def _other_width_t5(ckpt: Path) -> Path:
    path = ckpt / T5
    path.unlink()
    torch.save(upstream_state_dict({**TINY, "dim": 48, "dim_attn": 48}, seed=3), path)
    return path


def test_text_encoder_width_names_the_files(nf4_ckpt, fast_ckpt, tmp_path, capsys, nothing_loads):
    ckpt = link_copy(nf4_ckpt, tmp_path / "ckpt")
    t5 = _other_width_t5(ckpt)
    out = tmp_path / "o.mp4"
    experts = [ckpt / "high_noise_model_bnb_nf4", ckpt / "low_noise_model_bnb_nf4"]
    exits_2(capsys, args_for(ckpt, EXAMPLE, out), "width 48, the experts expect 32", t5, *experts)
    fast = link_copy(fast_ckpt, tmp_path / "fast")
    t5 = _other_width_t5(fast)
    exits_2(capsys, fast_args(fast, EXAMPLE, out), "width 48", t5, fast / "lingbot_world_fast")
    nothing_written(tmp_path, "ckpt", "fast")


# ------------------------------------------------------------------------------------------ item 16


def _nan_lora(path: Path, config) -> str:
    tiny_lora(path, config)
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if k.endswith("lora_up.weight"))[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))
    return key


def test_lora_with_nan_values_is_refused_naming_file_and_tensor(nf4_ckpt, tmp_path, capsys, nothing_loads):
    from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir

    config = resolve_checkpoint_dir(nf4_ckpt).config
    lora = tmp_path / "nan.safetensors"
    key = _nan_lora(lora, config)
    out = tmp_path / "o.mp4"
    exits_2(capsys, args_for(nf4_ckpt, EXAMPLE, out, "--lora", str(lora)), lora, repr(key), "NaN or Inf")
    nothing_written(tmp_path, lora.name)
    # the sampler node reads its LoRA specs through the same function
    with pytest.raises(ValueError, match="NaN or Inf") as err:
        read_expert_loras([LoraSpec(lora)], config)
    assert str(lora) in str(err.value) and key in str(err.value)


@pytest.mark.parametrize("strength", ["1e30", "-11", "inf"])
def test_lora_strength_is_bounded(strength, nf4_ckpt, tmp_path, capsys, nothing_loads):
    lora = tmp_path / "l.safetensors"
    out = tmp_path / "o.mp4"
    args = args_for(nf4_ckpt, EXAMPLE, out, "--lora", f"{lora}:{strength}")
    exits_2(capsys, args, "argument --lora: ", "strength")
    nothing_written(tmp_path)


def test_lora_node_takes_the_same_bound(nf4_ckpt, tmp_path, fake_comfy):
    nodes = fake_comfy(nf4_ckpt, tmp_path)
    tiny_lora(tmp_path / "l.safetensors", resolve_checkpoint_dir(nf4_ckpt).config)
    (experts,) = nodes.LingBotExpertsLoader().load("", "", False, 0.0, ckpt_dir=str(nf4_ckpt))
    with pytest.raises(ValueError, match=r"strength must be a number in \[-10, 10\], got 1e\+30"):
        nodes.LingBotLoRA().apply(experts, "l.safetensors", 1e30, "both", False)
    (ok,) = nodes.LingBotLoRA().apply(experts, "l.safetensors", -10.0, "both", False)
    assert ok.loras[-1].strength == -10.0


# ------------------------------------------------------------------------------------------ item 17


@pytest.mark.parametrize("rel", [T5, EXPERT.replace("model.safetensors", "model.pt")])
def test_pickle_that_runs_code_is_refused_naming_the_file(rel, nf4_ckpt, tmp_path, capsys, nothing_loads):
    """A plain pickle (not torch's zip format) as the text encoder or an expert: refused as the VAE is."""
    ckpt = link_copy(nf4_ckpt, tmp_path / "ckpt")
    path = ckpt / rel
    if rel == T5:
        path.unlink()
    else:
        (ckpt / EXPERT).unlink()
    path.write_bytes(pickle.dumps(RunsCode()))
    out = tmp_path / "o.mp4"
    exits_2(capsys, args_for(ckpt, EXAMPLE, out), path, "would run code", absent=["mmap can only"])
    nothing_written(tmp_path, "ckpt")


def test_legacy_torch_file_is_read_when_small_and_refused_when_large(tmp_path, monkeypatch):
    state = upstream_state_dict(TINY, seed=3)
    path = tmp_path / T5
    torch.save(state, path, _use_new_zipfile_serialization=False)
    read = tensor_file.load_torch_state(path, "text encoder file", "a .pth")
    assert read.keys() == state.keys() and all(torch.equal(read[k], v) for k, v in state.items())
    monkeypatch.setattr(tensor_file, "UNMAPPED_BYTES", path.stat().st_size - 1)
    with pytest.raises(
        tensor_file.CheckpointError, match="refused: a legacy \\(non-zip\\) torch file"
    ) as err:
        tensor_file.load_torch_state(path, "text encoder file", "a .pth")
    assert str(err.value).startswith(f"{path}: ")


# ------------------------------------------------------------------------------------------ item 19


def test_comfyui_timeout_clears_the_queue(monkeypatch):
    """A prompt past its (scaled) limit: the harness clears the queue and interrupts the running prompt
    before it raises, so the next test starts on an idle server."""
    import comfyui_harness as harness

    class Server(harness.Server):
        def __init__(self):
            self.calls, self.running = [], True
            self.proc = type("Proc", (), {"poll": lambda self: None})()

        def log(self, lines=60):
            return "server log"

        def request(self, path, body=None):
            self.calls.append((path, body))
            if path == "/interrupt":
                self.running = False
            if path == "/queue" and body is None:
                return {"queue_running": [[0, "p1"]] if self.running else [], "queue_pending": []}
            return {} if body is None else None

    monkeypatch.setattr(harness, "TIMEOUT_SCALE", 0.001)
    monkeypatch.setattr(harness.time, "sleep", lambda s: None)
    assert harness.scaled(150) == pytest.approx(0.15)
    server = Server()
    with pytest.raises(TimeoutError, match="the queue was cleared"):
        server.wait_history("p1", timeout=150)
    posted = [c for c in server.calls if c[1] is not None]
    assert posted[:2] == [("/queue", {"clear": True}), ("/interrupt", {})] and not server.running
