"""Checkpoint detection and validation (loaders/formats.py): every layout, the variant read from
the tensors, and a clear error for each kind of bad input."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from lingbot_world.loaders import formats as F
from lingbot_world.loaders import synthetic as S
from safetensors import safe_open
from safetensors.torch import load_file, save_file

CFG = S.tiny_config()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "nf4": S.write_nf4_expert(root / "nf4", CFG, seed=1, mode="quantize"),
        "nf4_random": S.write_nf4_expert(root / "nf4_random", CFG, seed=1, mode="random"),
        "nf4_pt": S.write_nf4_expert(root / "nf4_pt", CFG, seed=1, pt=True),
        "shards": S.write_diffusers_expert(root / "shards", CFG, seed=1, shards=3),
        "diffusers": S.write_diffusers_expert(root / "diffusers", CFG, seed=1, dtype=torch.float32),
        "single": S.write_single_safetensors(root / "single.safetensors", CFG, seed=1),
    }


def copy(src: Path, dst: Path) -> Path:
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    return dst


def edit_safetensors(path: Path, change) -> None:
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    state = load_file(path)
    change(state)
    save_file(state, path, metadata)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "name, kind, quantized, nfiles",
    [
        ("nf4", "nf4_folder", True, 1),
        ("nf4_random", "nf4_folder", True, 1),
        ("nf4_pt", "nf4_pt", True, 1),
        ("shards", "diffusers_folder", False, 3),
        ("diffusers", "diffusers_folder", False, 1),
        ("single", "single_safetensors", False, 1),
    ],
)
def test_detects_each_layout(ckpts, name, kind, quantized, nfiles):
    src = F.detect_expert_format(ckpts[name])
    assert src.kind == kind
    assert src.quantized is quantized
    assert len(src.files) == nfiles
    assert src.dit_config == CFG  # text_dim, patch_size, qk_norm... inferred, not in config.json
    assert src.control_type == "cam"
    if quantized:  # every nn.Linear is 4-bit, its dense shape from the quant_state JSON
        _, linears = F.expected_layout(CFG)
        assert set(src.quant_layers) == set(linears)
        assert all(src.quant_layers[m].shape == s for m, s in linears.items())


def test_nf4_meta_and_config_as_the_repack_writes_them(ckpts):
    cfg = json.loads((ckpts["nf4"] / "config.json").read_text())
    assert not {"patch_size", "text_dim", "control_type", "qk_norm"} & set(cfg)
    src = F.detect_expert_format(ckpts["nf4"])
    assert src.quantization_meta["quant"] == {
        "format": "bnb_nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
        "quant_type": "nf4",
    }
    state = src.quant_layers["blocks.0.ffn.0"].state
    assert state["blocksize"] == 64 and state["nested_blocksize"] == 256 and state["dtype"] == "bfloat16"


def test_random_nf4_matches_bnb_serialisation(ckpts):
    """The fast writer used for full-size benchmarks has the exact keys, dtypes, shapes and JSON fields
    of bitsandbytes' own Linear4bit state_dict."""
    a = F.detect_expert_format(ckpts["nf4"])
    b = F.detect_expert_format(ckpts["nf4_random"])
    assert {k: (r.dtype, r.shape) for k, r in a.tensors.items() if "quant_state" not in k} == {
        k: (r.dtype, r.shape) for k, r in b.tensors.items() if "quant_state" not in k
    }
    for m, q in a.quant_layers.items():
        assert list(q.state) == list(b.quant_layers[m].state)


def test_pt_form_is_the_same_state_dict(ckpts):
    a = F.detect_expert_format(ckpts["nf4"])
    b = F.detect_expert_format(ckpts["nf4_pt"])
    assert {k: (r.dtype, r.shape) for k, r in a.tensors.items()} == {
        k: (r.dtype, r.shape) for k, r in b.tensors.items()
    }


@pytest.mark.parametrize("control_type", ["cam", "act", None])
@pytest.mark.parametrize("layout", ["nf4", "diffusers"])
def test_variant_comes_from_tensors_not_folder_name(tmp_path, control_type, layout):
    cfg = S.tiny_config(control_type)
    folder = tmp_path / "lingbot-world-base-cam" / "high_noise_model_bnb_nf4"  # misleading name
    if layout == "nf4":  # 4-bit: the packed shape says nothing, the JSON shape does
        S.write_nf4_expert(folder, cfg, mode="random")
    else:
        S.write_diffusers_expert(folder, cfg)
    src = F.detect_expert_format(folder)
    assert src.control_type == control_type
    assert src.dit_config == cfg


def test_single_file_without_config_uses_128_wide_heads(tmp_path):
    cfg = S.tiny_config("act", dim=256, num_heads=2, ffn_dim=64, text_len=512)  # text_len: default
    path = S.write_single_safetensors(tmp_path / "x.safetensors", cfg, config_metadata=False)
    src = F.detect_expert_format(path)
    assert src.config == {} and src.dit_config == cfg


def test_single_file_prefixed_keys(tmp_path):
    path = S.write_single_safetensors(tmp_path / "x.safetensors", CFG, prefix="model.diffusion_model.")
    src = F.detect_expert_format(path)
    assert "blocks.0.self_attn.q.weight" in src.tensors
    assert (
        src.tensors["blocks.0.self_attn.q.weight"].key == "model.diffusion_model.blocks.0.self_attn.q.weight"
    )


def test_files_inside_folders_resolve(ckpts):
    assert F.detect_expert_format(ckpts["nf4"] / "model.safetensors").kind == "nf4_folder"
    assert F.detect_expert_format(ckpts["nf4_pt"] / "model.pt").kind == "nf4_pt"


def test_find_experts_both_layouts(tmp_path, ckpts):
    nf4 = tmp_path / "nf4"
    copy(ckpts["nf4"], nf4 / "high_noise_model_bnb_nf4")
    copy(ckpts["nf4"], nf4 / "low_noise_model_bnb_nf4")
    assert F.find_experts(nf4) == {
        "high": nf4 / "high_noise_model_bnb_nf4",
        "low": nf4 / "low_noise_model_bnb_nf4",
    }
    up = tmp_path / "upstream"
    copy(ckpts["shards"], up / "high_noise_model")
    copy(ckpts["diffusers"], up / "low_noise_model")
    copy(ckpts["nf4"], up / "low_noise_model_bnb_nf4")  # NF4 preferred when both exist
    assert F.find_experts(up) == {"high": up / "high_noise_model", "low": up / "low_noise_model_bnb_nf4"}


def test_find_experts_lists_every_missing_file(tmp_path, ckpts):
    root = tmp_path / "ck"
    copy(ckpts["nf4"], root / "high_noise_model_bnb_nf4")
    copy(ckpts["shards"], root / "low_noise_model")
    (root / "high_noise_model_bnb_nf4" / "config.json").unlink()
    shard = sorted((root / "low_noise_model").glob("*-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError) as e:
        F.find_experts(root)
    assert "high_noise_model_bnb_nf4/config.json" in str(e.value) and shard.name in str(e.value)
    shutil.rmtree(root / "low_noise_model")
    with pytest.raises(FileNotFoundError, match="low_noise_model_bnb_nf4/ .* or .*low_noise_model/"):
        F.find_experts(root)
    (root / "low_noise_model_bnb_nf4").mkdir()  # present but empty: its files are named
    with pytest.raises(
        FileNotFoundError,
        match=r"low_noise_model_bnb_nf4/model\.safetensors; .*low_noise_model_bnb_nf4/config\.json",
    ):
        F.find_experts(root)


# ----------------------------------------------------------------------------- bad inputs


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        F.detect_expert_format(tmp_path / "nowhere")


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors.*diffusion_pytorch_model"):
        F.detect_expert_format(tmp_path)


def test_missing_config(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"e/config\.json"):
        F.detect_expert_format(d)


def test_config_not_json(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    (d / "config.json").write_text("{dim: 64")
    with pytest.raises(F.CheckpointError, match=r"config\.json: not valid JSON"):
        F.detect_expert_format(d)


def test_truncated_data(tmp_path, ckpts):
    d = copy(ckpts["shards"], tmp_path / "e")
    shard = sorted(d.glob("*-00003-of-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(F.CheckpointError, match=rf"{shard.name}: truncated, tensor '[\w.]+' needs bytes"):
        F.detect_expert_format(d)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[:5], "no header"),
        (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "corrupt or truncated safetensors header"),
        (lambda b: b[:8] + b"\x00garbage" + b[16:], "corrupt safetensors header"),
        (lambda b: b[:200], "corrupt or truncated safetensors header"),
    ],
)
def test_corrupt_header(tmp_path, ckpts, damage, message):
    path = copy(ckpts["single"], tmp_path / "x.safetensors")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(F.CheckpointError, match=message) as e:
        F.detect_expert_format(path)
    assert "x.safetensors" in str(e.value)


def test_header_offsets_must_tile(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(F.CheckpointError, match="tensor 'a' starts at 4, expected 0"):
        F.read_safetensors_header(path)


def test_missing_and_unexpected_keys_are_listed(tmp_path, ckpts):
    path = copy(ckpts["single"], tmp_path / "x.safetensors")

    def change(state):
        del state["blocks.1.ffn.2.bias"], state["head.modulation"]
        state["blocks.0.lora_A.weight"] = torch.zeros(2)

    edit_safetensors(path, change)
    with pytest.raises(F.CheckpointError) as e:
        F.detect_expert_format(path)
    msg = str(e.value)
    assert "missing keys (2): blocks.1.ffn.2.bias, head.modulation" in msg
    assert "unexpected keys (1): blocks.0.lora_A.weight" in msg and "x.safetensors" in msg


def test_shape_and_dtype_mismatch(tmp_path, ckpts):
    path = copy(ckpts["single"], tmp_path / "x.safetensors")

    def change(state):
        state["blocks.1.norm3.weight"] = torch.ones(63, dtype=torch.bfloat16)
        state["blocks.0.modulation"] = torch.zeros(1, 6, 64, dtype=torch.int64)

    edit_safetensors(path, change)
    with pytest.raises(F.CheckpointError) as e:
        F.detect_expert_format(path)
    assert "blocks.1.norm3.weight ([63], expected [64])" in str(e.value)
    assert "blocks.0.modulation (torch.int64, expected float16/bfloat16/float32)" in str(e.value)


def test_incomplete_quantization_components(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    edit_safetensors(d / "model.safetensors", lambda s: s.pop("blocks.0.ffn.0.weight.nested_absmax"))
    with pytest.raises(
        F.CheckpointError,
        match=r"components for layer blocks\.0\.ffn\.0: missing blocks\.0\.ffn\.0\.weight\.nested_absmax",
    ):
        F.detect_expert_format(d)


def test_quant_components_without_quant_state(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    edit_safetensors(
        d / "model.safetensors", lambda s: s.pop("head.head.weight.quant_state.bitsandbytes__nf4")
    )
    with pytest.raises(
        F.CheckpointError, match=r"incomplete quantization components: head\.head\.weight\.absmax"
    ):
        F.detect_expert_format(d)


def test_quant_component_wrong_shape(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    edit_safetensors(
        d / "model.safetensors",
        lambda s: s.update({"text_embedding.0.weight.absmax": torch.zeros(7, dtype=torch.uint8)}),
    )
    with pytest.raises(
        F.CheckpointError, match=r"tensor text_embedding\.0\.weight\.absmax: expected torch\.uint8 \[32\]"
    ):
        F.detect_expert_format(d)


def test_corrupt_quant_state_json(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    key = "blocks.1.cam_scale_layer.weight.quant_state.bitsandbytes__nf4"
    edit_safetensors(
        d / "model.safetensors",
        lambda s: s.update({key: torch.tensor(list(b'{"shape": [64'), dtype=torch.uint8)}),
    )
    with pytest.raises(F.CheckpointError, match=rf"tensor {key}: corrupt quant_state JSON"):
        F.detect_expert_format(d)


def test_quant_state_shape_disagrees_with_model(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    key = "blocks.1.self_attn.o.weight.quant_state.bitsandbytes__nf4"
    state = json.loads(bytes(load_file(d / "model.safetensors")[key].tolist()))
    state["shape"] = [32, 128]  # same element count, so the packed components still fit
    edit_safetensors(
        d / "model.safetensors",
        lambda s: s.update({key: torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)}),
    )
    with pytest.raises(
        F.CheckpointError,
        match=r"blocks\.1\.self_attn\.o\.weight \(quant_state shape \[32, 128\], expected \[64, 64\]\)",
    ):
        F.detect_expert_format(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dim": 5120}, r"config says dim=5120 but the tensors give 64 \(from patch_embedding\.weight\)"),
        ({"control_type": "act"}, r"config says control_type='act' but the tensors give 'cam'"),
        ({"num_layers": 3}, r"num_layers=3 but the tensors give 2 \(from blocks\.0\.\.1\)"),
        ({"num_heads": 5}, r"unusable architecture .*dim 64 must split into 5 heads"),
    ],
)
def test_config_disagreeing_with_tensors(tmp_path, ckpts, change, message):
    d = copy(ckpts["nf4"], tmp_path / "e")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(F.CheckpointError, match=message) as e:
        F.detect_expert_format(d)
    assert str(d / "config.json") in str(e.value)


def test_quantization_meta_disagreeing(tmp_path, ckpts):
    d = copy(ckpts["nf4"], tmp_path / "e")
    meta = json.loads((d / "quantization_meta.json").read_text())
    meta["model_config"]["ffn_dim"] = 13824
    (d / "quantization_meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        F.CheckpointError, match=r"quantization_meta\.json: model_config ffn_dim=13824 disagrees"
    ):
        F.detect_expert_format(d)


def test_unknown_camera_width(tmp_path, ckpts):
    path = copy(ckpts["single"], tmp_path / "x.safetensors")
    edit_safetensors(
        path,
        lambda s: s.update(
            {"patch_embedding_wancamctrl.weight": torch.zeros(64, 1000, dtype=torch.bfloat16)}
        ),
    )
    with pytest.raises(
        F.CheckpointError,
        match=r"patch_embedding_wancamctrl\.weight has 1000 in-features; expected 1536 \(cam\) or 1792 \(act\)",
    ):
        F.detect_expert_format(path)


def test_index_names_missing_shards(tmp_path, ckpts):
    d = copy(ckpts["shards"], tmp_path / "e")
    gone = sorted(d.glob("*.safetensors"))[:2]
    for g in gone:
        g.unlink()
    with pytest.raises(FileNotFoundError) as e:
        F.detect_expert_format(d)
    assert all(g.name in str(e.value) for g in gone)


def test_index_disagreeing_with_shards(tmp_path, ckpts):
    d = copy(ckpts["shards"], tmp_path / "e")
    index = json.loads((d / F.DIFFUSERS_INDEX).read_text())
    index["weight_map"]["head.head.bias"] = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"].pop("blocks.0.norm3.bias")
    if index["weight_map"]["head.head.bias"] == "diffusion_pytorch_model-00003-of-00003.safetensors":
        pytest.skip("head.head.bias already in the first shard")
    (d / F.DIFFUSERS_INDEX).write_text(json.dumps(index))
    with pytest.raises(
        F.CheckpointError,
        match=r"listed but not in the named shard: head\.head\.bias; in a shard but not listed: blocks\.0\.norm3\.bias",
    ):
        F.detect_expert_format(d)


def test_corrupt_pt(tmp_path, ckpts):
    d = copy(ckpts["nf4_pt"], tmp_path / "e")
    (d / "model.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(
        F.CheckpointError,
        match=r"model\.pt: could not read it as a torch state dict with torch\.load\(weights_only=True, mmap=True\) \(PytorchStreamReader failed reading zip archive: not a ZIP archive\); supported",
    ):
        F.detect_expert_format(d)


class _Payload:
    """Unpickling this would create a file; weights_only loading must refuse it instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pt_is_never_unpickled(tmp_path, ckpts):
    d = copy(ckpts["nf4_pt"], tmp_path / "e")
    marker = tmp_path / "pwned"
    torch.save({"blocks.0.modulation": _Payload(marker)}, d / "model.pt")
    with pytest.raises(F.CheckpointError, match=r"model\.pt: refused: .* would run code from the file"):
        F.detect_expert_format(d)
    assert not marker.exists()
