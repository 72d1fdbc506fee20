"""LingBot-World-Fast checkpoint side: resolve_fast_dir's layouts and gaps, fp32 shards streamed and
quantized from their bf16 cast, and `lingbot.py quantize` (output format, equality, bad input, no
partial folder)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders import fast_checkpoint as FC
from lingbot_world.loaders import formats as F
from lingbot_world.loaders import quantize as Q
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.stream import load_expert, release

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# no config.json: num_heads is dim / 128, as for A14B (5120 / 128 = 40)
CFG = S.tiny_config(dim=256, num_heads=2, ffn_dim=256, text_len=512)
SEED = 5
ASSETS = ("models_t5_umt5-xxl-enc-bf16.pth", "tokenizer", "Wan2.1_VAE.pth")


def fast_folder(folder: Path, cfg=CFG, dtype=torch.float32, shards=3) -> Path:
    """The Fast model as released: diffusers shards + index, no config.json."""
    S.write_diffusers_expert(folder, cfg, seed=SEED, dtype=dtype, shards=shards)
    (folder / F.CONFIG).unlink()
    return folder


def base_cam(root: Path, nf4_ckpt: Path) -> Path:
    """A base-cam folder: the demo checkpoint's text encoder, tokenizer and VAE + lingbot_world_fast/."""
    root.mkdir(parents=True)
    for name in ASSETS:
        os.symlink(nf4_ckpt / name, root / name)
    fast_folder(root / FC.FAST_DIR)
    return root


@pytest.fixture(scope="module")
def base(tmp_path_factory, nf4_ckpt):
    return base_cam(tmp_path_factory.mktemp("fast") / "lingbot-world-base-cam", nf4_ckpt)


def nf4_equal(a, b) -> None:
    sa, sb = Q.nf4_state(a), Q.nf4_state(b)
    assert sa.keys() == sb.keys()
    different = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
    assert not different, different[:5]


def forward(model, cfg=CFG):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 4, 4, generator=g), torch.randn(20, 3, 4, 4, generator=g)
    ctx = torch.randn(7, cfg.text_dim, generator=g)
    cam = torch.randn(1, 384, 3, 4, 4, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor([947.0]), ctx, y=y, cam=cam)


# --- resolve_fast_dir ------------------------------------------------------------------------------


def test_base_cam_folder_and_fast_folder_resolve_alike(base):
    files = FC.resolve_fast_dir(base)
    assert files.model == base / FC.FAST_DIR
    assert (files.text_encoder, files.vae) == (base / ASSETS[0], base / ASSETS[2])
    assert files.tokenizer is not None and files.tokenizer.parent == base / "tokenizer"
    assert files.config == CFG and files.control_type == "cam" and not files.quantized
    src = files.source
    assert src.kind == "diffusers_folder" and len(src.files) == 3
    assert {r.dtype for r in src.tensors.values()} == {torch.float32}
    # the Fast folder itself: text encoder and VAE come from its parent
    inner = FC.resolve_fast_dir(base / FC.FAST_DIR)
    assert (inner.model, inner.text_encoder, inner.vae, inner.config) == (
        files.model,
        files.text_encoder,
        files.vae,
        files.config,
    )


def test_architecture_from_headers_without_config(tmp_path, nf4_ckpt):
    # the camera embedding's width decides cam (6 x 64 channels) vs act (7 x 64)
    root = tmp_path / "act"
    root.mkdir()
    for name in ASSETS:
        os.symlink(nf4_ckpt / name, root / name)
    act = S.tiny_config("act", dim=256, num_heads=2, ffn_dim=256, text_len=512)
    fast_folder(root / FC.FAST_DIR, act, dtype=torch.bfloat16, shards=1)
    files = FC.resolve_fast_dir(root)
    assert files.control_type == "act" and files.config == act
    assert files.config.text_len == 512 and files.config.eps == 1e-6  # A14B's, not stated anywhere
    # without config.json the head count must follow from 128-wide heads
    odd = tmp_path / "odd"
    fast_folder(odd, S.tiny_config(dim=192, num_heads=2, ffn_dim=256), shards=1)
    with pytest.raises(F.CheckpointError, match="num_heads is not stated and dim 192 is no multiple of 128"):
        F.detect_expert_format(odd, require_config=False)
    # the two-expert flow still demands config.json
    with pytest.raises(FileNotFoundError, match="config.json"):
        F.detect_expert_format(root / FC.FAST_DIR)


def test_every_gap_listed_at_once(tmp_path, nf4_ckpt):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        FC.resolve_fast_dir(empty)
    msg = str(err.value)
    assert "incomplete LingBot-World-Fast checkpoint" in msg
    for needle in (
        "lingbot_world_fast/ (the Fast model",
        "models_t5_umt5-xxl-enc-bf16.pth (text encoder)",
        "Wan2.1_VAE.pth (VAE)",
        "huggingface-cli download robbyant/lingbot-world-fast",
    ):
        assert needle in msg, msg
    # a missing shard and a missing VAE, both named
    root = tmp_path / "base"
    root.mkdir()
    os.symlink(nf4_ckpt / ASSETS[0], root / ASSETS[0])
    os.symlink(nf4_ckpt / ASSETS[1], root / ASSETS[1])
    model = fast_folder(root / FC.FAST_DIR)
    (model / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        FC.resolve_fast_dir(model)
    msg = str(err.value)
    assert "diffusion_pytorch_model-00002-of-00003.safetensors" in msg and "Wan2.1_VAE.pth (VAE)" in msg
    assert "text encoder" not in msg
    # a base expert's folder is refused by name: same tensors, different model
    with pytest.raises(F.CheckpointError, match="one expert of the two-expert base model"):
        FC.resolve_fast_dir(nf4_ckpt / "high_noise_model_bnb_nf4")


# --- fp32 sources: streamed, cast to bf16, then quantized ----------------------------------------------


def test_fp32_shards_load_as_their_bf16_cast(tmp_path):
    fp32 = F.detect_expert_format(fast_folder(tmp_path / "fp32"), require_config=False)
    bf16 = S.write_single_safetensors(tmp_path / "bf16.safetensors", CFG, seed=SEED, dtype=torch.bfloat16)
    assert {r.dtype for r in fp32.tensors.values()} == {torch.float32}
    a, b = load_expert(fp32, "cpu", quantize=True), load_expert(bf16, "cpu", quantize=True)
    nf4_equal(a, b)
    assert all(p.quant_state.dtype == torch.bfloat16 for p in a.parameters() if hasattr(p, "quant_state"))
    assert torch.equal(forward(a), forward(b))
    release(a), release(b)
    a, b = load_expert(fp32, "cpu"), load_expert(bf16, "cpu")  # dense: every tensor the bf16 cast
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(pa[k].dtype == torch.bfloat16 and torch.equal(pa[k], pb[k]) for k in pb)


# --- lingbot.py quantize ---------------------------------------------------------------------------


def test_quantize_writes_an_nf4_folder_equal_to_streaming_quantization(base, tmp_path, capsys):
    dst = tmp_path / "lingbot_world_fast_nf4"
    assert cli.main(["quantize", str(base), str(dst), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {dst}" in out and "peak RSS" in out and " s on cpu" in out
    assert sorted(p.name for p in dst.iterdir()) == [F.CONFIG, F.NF4_WEIGHTS, F.NF4_META]
    assert not list(tmp_path.glob(".*"))
    meta = json.loads((dst / F.NF4_META).read_text())
    assert meta["quant"]["format"] == "bnb_nf4" and meta["source"]["dtypes"] == ["float32"]
    written = F.detect_expert_format(dst)
    assert written.kind == "nf4_folder" and written.dit_config == CFG
    assert len(written.quant_layers) == len(F.expected_layout(CFG)[1])
    got = load_expert(dst, "cpu")
    direct = load_expert(
        F.detect_expert_format(base / FC.FAST_DIR, require_config=False), "cpu", quantize=True
    )
    nf4_equal(got, direct)
    assert torch.equal(forward(got), forward(direct))
    release(got), release(direct)

    # resolve_fast_dir takes the NF4 folder itself (assets from its parent), with or without config.json
    moved = base.parent / "nf4_copy" / FC.FAST_NF4_DIR
    moved.parent.mkdir()
    shutil.copytree(dst, moved)
    for name in ASSETS:
        os.symlink(base / name, moved.parent / name)
    (moved / F.CONFIG).unlink()
    (moved / F.NF4_META).unlink()
    files = FC.resolve_fast_dir(moved)
    assert files.quantized and files.config == CFG and files.vae == moved.parent / ASSETS[2]
    # and a base-cam folder prefers its complete NF4 folder
    shutil.copytree(dst, base / FC.FAST_NF4_DIR)
    try:
        assert FC.resolve_fast_dir(base).model == base / FC.FAST_NF4_DIR
    finally:
        shutil.rmtree(base / FC.FAST_NF4_DIR)


def test_quantize_an_upstream_expert_folder(tmp_path, capsys):
    src = S.write_diffusers_expert(tmp_path / "high_noise_model", S.tiny_config(), seed=1, shards=2)
    dst = tmp_path / "high_noise_model_bnb_nf4"
    assert cli.main(["quantize", str(src), str(dst), "--device", "cpu"]) == 0
    got, direct = load_expert(dst, "cpu"), load_expert(src, "cpu", quantize=True)
    nf4_equal(got, direct)
    # --overwrite replaces an NF4 folder
    assert cli.main(["quantize", str(src), str(dst), "--device", "cpu", "--overwrite"]) == 0
    assert F.detect_expert_format(dst).quantized and not list(tmp_path.glob(".*"))


def expect_error(capsys, argv, *needles) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if not x.startswith("WARNING")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def test_quantize_bad_input(base, tmp_path, capsys, nf4_ckpt):
    src = str(base / FC.FAST_DIR)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    expect_error(capsys, ["quantize", src, str(taken), "--device", "cpu"], "exists; pass --overwrite")
    expect_error(
        capsys, ["quantize", src, str(taken), "--device", "cpu", "--overwrite"], "is not an NF4 expert folder"
    )
    assert (taken / "notes.txt").read_text() == "mine"
    expect_error(capsys, ["quantize", src, src, "--device", "cpu", "--overwrite"], "would replace the source")
    expect_error(
        capsys,
        ["quantize", str(base), str(base), "--device", "cpu", "--overwrite"],
        "would replace the source",
    )
    expect_error(
        capsys,
        ["quantize", str(nf4_ckpt / "low_noise_model_bnb_nf4"), str(tmp_path / "x"), "--device", "cpu"],
        "already quantized",
    )
    expect_error(
        capsys,
        ["quantize", str(tmp_path / "nope"), str(tmp_path / "x"), "--device", "cpu"],
        "nope: checkpoint file or folder not found",
    )
    expect_error(
        capsys,
        ["quantize", src, str(tmp_path / "no" / "x"), "--device", "cpu"],
        "parent folder does not exist",
    )
    expect_error(capsys, ["quantize", src, str(tmp_path / "x"), "--device", "tpu"], "--device")
    broken = fast_folder(tmp_path / "broken", shards=2)
    (broken / "diffusion_pytorch_model-00001-of-00002.safetensors").unlink()
    expect_error(
        capsys,
        ["quantize", str(broken), str(tmp_path / "x"), "--device", "cpu"],
        "missing shard files",
        "00001-of-00002",
    )
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x*"))


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_quantize_failure_leaves_nothing(base, tmp_path, monkeypatch, capsys, fault):
    real = Q.write_safetensors

    def failing(path, specs, fill, metadata=None):
        def late_fill(k):
            if k.startswith("blocks.1."):
                raise fault("injected failure")
            return fill(k)

        return real(path, specs, late_fill, metadata)

    monkeypatch.setattr(Q, "write_safetensors", failing)
    dst = tmp_path / "out"
    argv = ["quantize", str(base / FC.FAST_DIR), str(dst), "--device", "cpu"]
    if fault is KeyboardInterrupt:
        assert cli.main(argv) == 130
    else:
        with pytest.raises(RuntimeError, match="injected"):
            cli.main(argv)
    assert not dst.exists() and not list(tmp_path.iterdir())
    # with --overwrite a failure keeps the folder that was there
    dst.mkdir()
    (dst / F.NF4_WEIGHTS).write_bytes(b"old")
    if fault is KeyboardInterrupt:
        assert cli.main([*argv, "--overwrite"]) == 130
    else:
        with pytest.raises(RuntimeError, match="injected"):
            cli.main([*argv, "--overwrite"])
    assert (dst / F.NF4_WEIGHTS).read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out"]


# --- host memory: fp32 shards quantize within one tensor's worth ------------------------------------------

MEM_CFG = S.tiny_config(dim=1024, ffn_dim=4096, num_heads=8, num_layers=2, text_dim=1024, freq_dim=256)

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from lingbot import load_pack
load_pack()
from lingbot_world.loaders import formats as F, monitor as M, quantize as Q, stream

src = F.detect_expert_format(sys.argv[2], require_config=False)
stream.release(stream.load_expert(src, "cpu", quantize=True))  # warm-up: lazy imports, kernels
stream.free_memory()
with M.RssSampler() as s:
    model = stream.load_expert(src, "cpu", quantize=True)
model_bytes = sum(t.untyped_storage().nbytes() for t in Q.nf4_state(model).values())
print("RESULT " + json.dumps(dict(growth=s.growth, model=model_bytes, largest=src.largest_tensor_bytes,
                                  file=src.nbytes, shards=len(src.files))))
"""


@pytest.mark.slow
def test_fp32_shards_quantize_within_one_tensor_of_ram(tmp_path):
    folder = fast_folder(tmp_path / "fp32", MEM_CFG, shards=3)
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(folder)], capture_output=True, text=True, timeout=300
    )
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and line, run.stderr[-3000:]
    m = json.loads(line[0][7:])
    assert m["shards"] == 3 and m["file"] > 150 * MiB
    extra = m["growth"] - m["model"]
    # far below one shard (~file / 3): the fp32 weights are read from the file's pages chunk by chunk
    assert extra <= m["largest"] + 24 * MiB, f"transient {extra / MiB:.1f} MiB above the model"
    assert extra < m["file"] / 3
