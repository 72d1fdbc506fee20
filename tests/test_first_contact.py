"""What a new user meets first: `plan` before downloading anything, `doctor` on a machine without a GPU,
`--help` (instant, every flag explained), the SIGTERM handler's scope, and the README's claims about them."""

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
from lingbot_world.loaders.formats import expected_layout
from lingbot_world.session import doctor, fast_run
from lingbot_world.session import planner as mp
from lingbot_world.wan.config import A14B, CHUNKED_KINDS, SampleConfig
from lingbot_world.wan.fast import FastConfig, kv_cache_bytes_for

import lingbot

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def subcommands() -> dict:
    action = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


# --- plan without files -----------------------------------------------------------------------------


def test_nf4_bytes_from_the_architecture_match_a_written_nf4_expert(nf4_ckpt):
    """The bytes `plan --model` assumes are what an NF4 folder of that architecture stores: the demo's
    tiny experts, less bitsandbytes' per-layer quantization state (its two code tables and packed JSON,
    about 1.3 KB a layer: 0.5 MB of the A14B's 9.6 GB)."""
    files = resolve_checkpoint_dir(nf4_ckpt)
    linears = len(expected_layout(files.config)[1])
    predicted = fast_run.nf4_bytes(files.config)
    for source in files.sources.values():
        assert source.quantized and 0 <= source.nbytes - predicted <= linears * 1536
    # the A14B: the ~9.6 GB the README gives for the NF4 model
    assert 9.5e9 < fast_run.nf4_bytes(A14B) < 9.7e9


def test_plan_a_named_model_for_another_card(capsys):
    argv = ["plan", "--model", "base-cam", "--size", "720*1280", "--frame_num", "161", "--vram", "12"]
    assert cli.main(argv) == 2  # a 12 GiB card: not as asked, with the settings that would fit
    out, err = capsys.readouterr()
    assert "base-cam, from its architecture: two NF4 A14B experts" in out
    assert "161 frames at 720*1280" in out and "T5 on GPU" in out  # planned for a GPU this machine lacks
    assert "error: not enough memory: denoise_high needs" in err and "12.0 GiB free" in err
    assert "--swap_blocks 40" in err
    assert cli.main([*argv, "--swap_blocks", "40"]) == 0
    out = capsys.readouterr().out
    assert "swap_blocks 40" in out and "fits: 12.0 GiB of VRAM (--vram)" in out
    # the same request on a large card fits as asked
    assert cli.main([*argv[:-1], "80"]) == 0
    assert "fits: 80.0 GiB of VRAM (--vram)" in capsys.readouterr().out


def test_plan_a_named_model_equals_the_planner_on_its_bytes(capsys):
    assert cli.main(["plan", "--model", "base-cam", "--vram", "80", "--t5_overlap", "off"]) == 0
    out = capsys.readouterr().out
    nf4 = fast_run.nf4_bytes(A14B)
    request = mp.MemoryRequest({"high": nf4, "low": nf4}, {"high": 0, "low": 0}, vae_tile="auto")
    size = (58, 104, 464, 832)  # upstream's 480*832 rounding
    want = mp.check(mp.Planner(A14B, size, 81, request, (480, 832), 480 * 832), 80 * GIB)
    assert want.table() in out


@pytest.mark.parametrize(
    "size, image, shown",
    [("480*832", None, "464*832"), ("832*480", None, "832*480"), ("480*832", "image.jpg", "464*832")],
)
def test_plan_echoes_the_size_in_the_order_typed(size, image, shown, shipped_example, capsys):
    argv = ["plan", "--model", "base-cam", "--size", size, "--frame_num", "9", "--vram", "80"]
    if image:
        argv += ["--image", str(shipped_example / image)]
    assert cli.main(argv) == 0
    assert f"9 frames at {shown} (" in capsys.readouterr().out


def test_plan_from_files_needs_no_image_or_prompt(nf4_ckpt, capsys):
    argv = ["plan", "--ckpt_dir", str(nf4_ckpt), "--size", "48*112", "--frame_num", "9", "--device", "cpu"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "9 frames at 48*112 (" in out and "from its architecture" not in out


def test_plan_needs_files_or_a_model_and_checks_its_gib(capsys):
    assert cli.main(["plan"]) == 2
    assert "give --ckpt_dir DIR (the files) or --model NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "base-cam", "--vram", "-3"])
    assert "--vram: expected a positive number of GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model", "sd15"])
    assert "invalid choice" in capsys.readouterr().err


def test_plan_checks_host_ram_given(capsys):
    assert cli.main(["plan", "--model", "base-cam", "--vram", "80", "--ram", "4"]) == 2
    assert "GiB of RAM, 4.0 GiB free" in capsys.readouterr().err


def test_plan_per_rank_names_rank_one(capsys):
    assert cli.main(["plan", "--model", "base-cam", "--ulysses_size", "2", "--vram", "80"]) == 0
    out = capsys.readouterr().out
    assert "\nrank 1: " in out and "ranks 1-1" not in out


@pytest.mark.parametrize("name", list(CHUNKED_KINDS))
def test_plan_a_chunked_model(name, capsys):
    kind = CHUNKED_KINDS[name]
    assert cli.main(["plan", "--model", name, "--frame_num", "161", "--vram", "80"]) == 0
    out = capsys.readouterr().out
    lat_f = 41 - 41 % kind.chunk_frames  # 161 frames: 41 latent frames, cut to whole chunks
    assert f"{(lat_f - 1) * 4 + 1} frames (161 asked: whole chunks) at 464*832" in out
    assert f"{lat_f // kind.chunk_frames} chunks of {kind.chunk_frames} latent frames" in out
    window = "all" if kind.local_attn_size == -1 else f"{kind.local_attn_size}, sink {kind.sink_size}"
    assert f"attention window {window}," in out  # the kind's documented window by default
    config = FastConfig(local_attn_size=kind.local_attn_size, sink_size=kind.sink_size)
    caches = kv_cache_bytes_for(kind.dit, (lat_f, 58, 104), config)
    assert f"attention caches {caches / GIB:.2f} + " in out
    assert f"model {fast_run.nf4_bytes(kind.dit) / GIB:.2f} + " in out
    assert "fits: 80.0 GiB of VRAM (--vram)" in out


def test_plan_a_chunked_model_per_rank_of_sequence_parallel(capsys):
    """Each of N ranks holds 1/N of the self-attention cache; a size that does not split the 1.3B's 12 heads
    is refused naming the ones that do."""
    kind = CHUNKED_KINDS["v2-14b"]
    config = FastConfig(local_attn_size=kind.local_attn_size, sink_size=kind.sink_size)
    assert cli.main(["plan", "--model", "v2-14b", "--ulysses_size", "2", "--vram", "80"]) == 0
    out = capsys.readouterr().out
    caches = kv_cache_bytes_for(kind.dit, (20, 58, 104), config, ranks=2)
    assert caches < kv_cache_bytes_for(kind.dit, (20, 58, 104), config)
    assert "per GPU of 2 (sequence parallel)" in out and f"attention caches {caches / GIB:.2f} + " in out
    assert cli.main(["plan", "--model", "v2-1.3b", "--ulysses_size", "5"]) == 2
    assert (
        "--ulysses_size 5 must divide the model's 12 attention heads (1, 2, 3, 4, 6, 12)"
        in capsys.readouterr().err
    )


def test_plan_a_chunked_model_that_does_not_fit_names_what_would(capsys):
    assert cli.main(["plan", "--model", "fast", "--vram", "24"]) == 2
    err = capsys.readouterr().err
    assert "error: memory: predicted peak" in err and "more than the 24.0 GiB free" in err
    assert "--local_attn_size" in err or "--kv_dtype fp8" in err
    # a window smaller than the kind's chunk after its sink is refused, naming the flag
    assert cli.main(["plan", "--model", "v2-14b", "--local_attn_size", "9", "--sink_size", "6"]) == 2
    assert "--local_attn_size: must leave room for a 4-frame chunk" in capsys.readouterr().err
    # the text encoder runs on the card before the model: too small a card for it says --t5_cpu
    small = ["plan", "--model", "v2-1.3b", "--frame_num", "17", "--vram", "10"]
    assert cli.main(small) == 2
    assert "error: memory: text_encode needs 10.9 GiB, more than 10.0 GiB free; add --t5_cpu" in (
        capsys.readouterr().err
    )
    assert cli.main([*small, "--t5_cpu"]) == 0


def test_parser_defaults_equal_the_model_codes():
    """The parser is built without torch, so a few defaults are written there; they equal the code's."""
    args = cli.build_parser().parse_args(["fast", "--ckpt_dir", "c", "--image", "i", "--prompt", "p"])
    assert args.seed == FastConfig.seed and args.sample_shift is None  # None: the model kind's shift
    assert cli.KV_DTYPES == list(fast_run.KV_DTYPES)
    assert cli.DEFAULT_SIZE == SampleConfig.max_area and cli.DEFAULT_SIZE.hw == (480, 832)
    opts = cli.speed_options(cli.build_parser().parse_args(["plan", "--model", "base-cam"]))
    assert opts == cli.SpeedOptions()


# --- doctor -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cuda_build", [None, "12.8"])
def test_doctor_tells_a_cpu_build_from_a_hidden_gpu(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check = doctor.check_gpu()
    assert not check.ok
    if cuda_build is None:
        assert "is a CPU-only build; install a CUDA build" in check.detail
        assert "sees no GPU" not in check.detail
    else:
        assert "is a GPU build (CUDA 12.8) but sees no GPU" in check.detail
        assert "CUDA_VISIBLE_DEVICES (now '')" in check.detail and "--gpus" in check.detail
        assert "install a CUDA build" not in check.detail
    with pytest.raises(ValueError, match="--device cuda: CUDA is not available: PyTorch") as err:
        cli.resolve_device("cuda")
    assert doctor.no_gpu_reason() in str(err.value)


# --- --help -----------------------------------------------------------------------------------------


def test_help_imports_no_torch():
    """`--help` and every subcommand's `--help` answer without importing torch or scipy.spatial."""
    code = f"""
import contextlib, io, sys
sys.path.insert(0, {str(ROOT)!r})
import lingbot
lingbot.load_pack()
from lingbot_world.cli import build_parser
names = build_parser()._subparsers._group_actions[0].choices
for argv in [["--help"], *[[name, "--help"] for name in names]]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            lingbot.main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    assert "usage:" in out.getvalue(), argv
    print(argv[0], len(names), sorted(m for m in ("torch", "scipy.spatial") if m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 1 + len(subcommands()) == 9, out
    assert all(line.endswith(" 8 []") for line in lines), out


def test_every_flag_of_every_subcommand_has_help():
    for name, sub in subcommands().items():
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.option_strings)
    demo = subcommands()["demo"].format_help()
    assert "tiny checkpoints are written once" in demo and "replace --output" in demo


# --- SIGTERM ----------------------------------------------------------------------------------------


def test_sigterm_handler_only_in_the_commands_own_entry(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def run_plan(args):
        seen.append(signal.getsignal(signal.SIGTERM))
        return 0

    monkeypatch.setattr(cli, "run_plan", run_plan)
    assert cli.main(["plan", "--model", "base-cam"]) == 0  # as a library: the caller's handler stays
    assert lingbot.main(["plan", "--model", "base-cam"]) == 0  # the command: SIGTERM ends like Ctrl-C
    assert seen == [before, cli._on_sigterm]
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("entry, rc", [("lingbot.main", 143), ("cli.main", -signal.SIGTERM)])
def test_sigterm_during_a_run(entry, rc):
    """SIGTERM in the command ends it like Ctrl-C (exit 143); in `cli.main` called as a library (a test
    suite) it does what the caller's process does with SIGTERM: here, end it."""
    code = f"""
import os, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
import lingbot
lingbot.load_pack()
from lingbot_world import cli

def run_plan(args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    return 0

cli.run_plan = run_plan
sys.exit({entry}(["plan", "--model", "base-cam"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc, proc.stderr[-2000:]
    assert ("terminated: models released" in proc.stderr) == (rc == 143)


# --- README -----------------------------------------------------------------------------------------


def test_readme_lists_every_subcommand_and_workflow():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"`lingbot-world` command \(([^)]*)\)", readme).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(subcommands())
    for workflow in sorted((ROOT / "example_workflows").glob("*.json")):
        assert f"| `{workflow.name}` |" in readme, workflow.name
    assert "https://download.pytorch.org/whl/cpu" in readme  # the CPU-only install
