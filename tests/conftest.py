import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingbot import load_pack  # noqa: E402

load_pack()  # tests import the pack as `lingbot_world`, as the CLI does
from lingbot_world import cli  # noqa: E402

cli.import_runtime()  # tests call the CLI's functions directly (`cli.main` imports this after parsing)
from helpers import install_fake_comfy  # noqa: E402  (imports the pack)


def _find_examples() -> Path | None:
    for cand in (ROOT / "examples", ROOT.parent / "shared" / "fixtures" / "lingbot-examples"):
        if (cand / "00" / "poses.npy").is_file():
            return cand
    return None


@pytest.fixture(autouse=True)
def _torch_seeded():
    """Each test starts from the same global torch generator: data drawn without a generator of its own must not
    depend on which tests ran before it (or were skipped on this machine)."""
    import torch

    torch.manual_seed(0)


@pytest.fixture
def embedding_cache(tmp_path, monkeypatch):
    """A fresh text-embedding cache per test, so no test reads another's encodings."""
    monkeypatch.setenv("LINGBOT_WORLD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def fake_comfy(monkeypatch):
    """`fake_comfy(ckpt, input_dir)`: the pack's nodes over CPU stand-ins of ComfyUI's runtime modules, whose
    model folders are `ckpt` and loras/input folder `input_dir` (tests/helpers.py `install_fake_comfy`)."""
    return lambda ckpt, input_dir: install_fake_comfy(monkeypatch, ckpt, input_dir)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any text-encoder, VAE, expert or chunked-model load fails the test: a bad request's error must come
    first (files that also guard other loads define their own `nothing_loads`)."""
    from lingbot_world.session import chunked, fast_run, generate

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the request was checked")

    monkeypatch.setattr(cli.text_encode, "encode_prompts", loaded)
    monkeypatch.setattr(chunked, "load_vae", loaded)
    monkeypatch.setattr(generate, "load_vae", loaded)
    monkeypatch.setattr(generate, "ExpertSwitcher", loaded)
    monkeypatch.setattr(fast_run.ExpertSwitcher, "__call__", loaded)


@pytest.fixture
def traced_chunk_blocks(monkeypatch):
    """The chunk loop's compiled runners (fixed shapes, growing chunks) with a backend that records each graph and
    runs it as traced (no inductor build); yields the graphs."""
    import torch
    from lingbot_world.wan import speed

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(speed, "compiler_missing", lambda device: None)
    runner = speed.CompiledBlocks(backend=backend, fn=speed.run_chunk_block)
    monkeypatch.setitem(speed._shared_runners, speed.run_chunk_block, runner)
    growing = speed.CompiledBlocks(backend=backend, fn=speed.run_growing_chunk_block, dynamic=True)
    monkeypatch.setitem(speed._shared_runners, speed.run_growing_chunk_block, growing)
    yield graphs
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def fast_ckpt(nf4_ckpt, tmp_path_factory):
    """A base-cam folder (the tiny demo checkpoint's files) holding lingbot_world_fast/: one tiny cam DiT
    as fp32 diffusers shards with their index, as the Fast release ships it."""
    import torch
    from lingbot_world.loaders import synthetic
    from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
    from lingbot_world.loaders.fast_checkpoint import FAST_DIR

    root = tmp_path_factory.mktemp("fast_base_cam")
    for entry in nf4_ckpt.iterdir():
        (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    cfg = resolve_checkpoint_dir(nf4_ckpt).config
    synthetic.write_diffusers_expert(root / FAST_DIR, cfg, seed=11, dtype=torch.float32, shards=2)
    return root


@pytest.fixture(scope="session")
def nf4_ckpt(tmp_path_factory) -> Path:
    """The demo's tiny NF4 checkpoint folder (experts, umT5, tokenizer, VAE), built once per session."""
    from lingbot_world.loaders.demo_assets import ensure_demo_checkpoint

    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def shipped_example() -> Path:
    """examples/00 shipped in the repo (image, prompt, poses, intrinsics, action files)."""
    return ROOT / "examples" / "00"


@pytest.fixture(scope="session")
def all_examples() -> list[Path]:
    """Every upstream example: ../shared/fixtures/lingbot-examples when present, else the shipped one."""
    shared = ROOT.parent / "shared" / "fixtures" / "lingbot-examples"
    if shared.is_dir():
        return sorted(p for p in shared.iterdir() if (p / "poses.npy").is_file())
    return [ROOT / "examples" / "00"]


# The default run (`addopts` in pyproject.toml) leaves out tests marked slow or gpu; say which, so
# nothing goes unrun silently.
_LEFT_OUT: list = []
_HOW = {
    "slow": "python -m pytest -q -m slow (CI runs them)",
    "gpu": "python -m pytest -q -m gpu on a CUDA machine",
}


def pytest_deselected(items):
    for item in items:  # those left out by a -m naming their marker (not by -k)
        markexpr = item.config.option.markexpr or ""
        if any(item.get_closest_marker(m) and m in markexpr for m in _HOW):
            _LEFT_OUT.append(item)


def pytest_terminal_summary(terminalreporter):
    if not _LEFT_OUT:
        return
    by_marker: dict[str, dict[str, list[str]]] = {}
    for item in _LEFT_OUT:
        marker = next(m for m in _HOW if item.get_closest_marker(m))
        path, _, name = item.nodeid.partition("::")
        by_marker.setdefault(marker, {}).setdefault(path, []).append(name)
    tr = terminalreporter
    tr.section("not run in this session (deselected by -m)")
    for marker, files in by_marker.items():
        count = sum(len(v) for v in files.values())
        tr.write_line(f"{count} {marker} test(s); to run them: {_HOW[marker]}")
        for path, names in files.items():
            tr.write_line(f"  {path}: {', '.join(names)}")


@pytest.fixture(scope="session")
def interpreted_kernels():
    """What tests/interpreted_kernels_worker.py measured of the Triton kernels (`wan.fp8_gelu`, `wan.qk_rope`,
    `wan.fp8_inputs`, `wan.tap_conv`) run through Triton's interpreter on CPU tensors, in a process of its own
    (TRITON_INTERPRET=1 must precede Triton's import)."""
    pytest.importorskip(
        "triton", reason="Triton is not installed (Linux: pip install triton; torch's CPU wheels lack it)"
    )
    worker = Path(__file__).with_name("interpreted_kernels_worker.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
