"""Streaming loader (loaders/stream.py): every layout into a working WanModel, 4-bit layers equal to
bitsandbytes' own dequantization of the stored data, streaming quantization equal to bnb's."""

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_f
import pytest
import torch
import torch.nn.functional as F
from bitsandbytes.functional import QuantState
from lingbot_world.loaders import formats as fmt
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.stream import build_expert_meta, load_expert, release
from lingbot_world.wan.config import A14B
from lingbot_world.wan.dit import WanModel, linear
from safetensors.torch import load_file
from torch import nn

CFG = S.tiny_config()
SEED = 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return {
        "nf4": S.write_nf4_expert(root / "nf4", CFG, seed=SEED, mode="quantize"),
        "nf4_pt": S.write_nf4_expert(root / "nf4_pt", CFG, seed=SEED, pt=True),
        "shards": S.write_diffusers_expert(root / "shards", CFG, seed=SEED, shards=2),
        "fp32": S.write_diffusers_expert(root / "fp32", CFG, seed=SEED, dtype=torch.float32),
        "single": S.write_single_safetensors(
            root / "one.safetensors", CFG, seed=SEED, prefix="diffusion_model."
        ),
    }


def stored_dequantized(folder) -> dict:
    """{module: (dense weight, bias)} from bnb's own deserialisation of the stored NF4 tensors."""
    state = load_file(folder / "model.safetensors")
    out = {}
    for module, layer in fmt.detect_expert_format(folder).quant_layers.items():
        comps = {t.split(".weight.", 1)[1]: state[t].clone() for p, t in layer.parts.items() if p != "weight"}
        qs = QuantState.from_dict(comps, device=torch.device("cpu"))
        out[module] = (bnb_f.dequantize_4bit(state[f"{module}.weight"], qs), state[f"{module}.bias"])
    return out


def inputs(cfg, control=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 4, 4, generator=g)
    y = torch.randn(20, 2, 4, 4, generator=g)
    ctx = torch.randn(7, cfg.text_dim, generator=g)
    cam = torch.randn(1, 384 if cfg.control_type == "cam" else 448, 2, 4, 4, generator=g) if control else None
    return x, torch.tensor([700.0]), ctx, y, cam


def params(model) -> dict:
    return dict(model.named_parameters())


def test_build_expert_meta_allocates_nothing():
    model = build_expert_meta(A14B)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 569 and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
    assert all(p.is_meta for p in model.parameters())
    some = build_expert_meta(CFG, quantized={"head.head"})
    assert [n for n, m in some.named_modules() if isinstance(m, bnb.nn.Linear4bit)] == ["head.head"]


def test_nf4_layers_compute_like_bnb_dequantization(ckpts):
    model = load_expert(ckpts["nf4"], "cpu")
    state = load_file(ckpts["nf4"] / "model.safetensors")
    reference = stored_dequantized(ckpts["nf4"])
    assert len(reference) == 37
    g = torch.Generator().manual_seed(1)
    for module, (weight, bias) in reference.items():
        layer = model.get_submodule(module)
        assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.bnb_quantized
        assert torch.equal(
            layer.weight.data.view(-1), state[f"{module}.weight"].view(-1)
        )  # packed bytes as stored
        assert (
            layer.weight.quant_state.dtype == torch.bfloat16 and layer.quant_state is layer.weight.quant_state
        )
        x = torch.randn(5, weight.shape[1], generator=g)
        for dtype in (torch.bfloat16, torch.float32):  # Linear4bit forward, and dequantize-then-matmul
            got = linear(layer, x, dtype)
            want = F.linear(x.to(dtype), weight.to(dtype), bias.to(dtype))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # everything else in its stored dtype and value
    for name, p in params(model).items():
        if name in state and p.dtype != torch.uint8:
            assert p.dtype == state[name].dtype and torch.equal(p, state[name]), name


def test_4bit_model_forward_matches_dense_dequantized_model(ckpts):
    model = load_expert(ckpts["nf4"], "cpu")
    reference = WanModel.from_config(CFG)
    state = {k: v for k, v in load_file(ckpts["nf4"] / "model.safetensors").items() if k in params(reference)}
    state.update({f"{m}.weight": w for m, (w, _) in stored_dequantized(ckpts["nf4"]).items()})
    reference.load_state_dict(state, strict=True)
    reference = reference.to(torch.bfloat16).eval()
    x, t, ctx, y, cam = inputs(CFG)
    with torch.no_grad():
        got = model(x, t, ctx, y=y, cam=cam)
        want = reference(x, t, ctx, y=y, cam=cam)
    assert got.shape == (16, 2, 4, 4) and got.abs().mean() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.training is False and not any(p.requires_grad for p in model.parameters())


def test_pt_form_loads_identically(ckpts):
    a, b = load_expert(ckpts["nf4"], "cpu"), load_expert(ckpts["nf4_pt"], "cpu")
    for (name, p), q in zip(params(a).items(), params(b).values(), strict=True):
        assert torch.equal(p, q), name
    qa, qb = a.blocks[1].ffn[0].weight.quant_state, b.blocks[1].ffn[0].weight.quant_state
    assert torch.equal(qa.absmax, qb.absmax) and qa.offset == qb.offset and qa.shape == qb.shape


def test_dense_layouts_load_the_written_values(ckpts):
    models = {k: load_expert(ckpts[k], "cpu") for k in ("shards", "fp32", "single")}
    shapes, _ = S.model_specs(CFG)
    for name, shape in shapes.items():
        want = S.random_tensor(name, shape, SEED, torch.bfloat16)
        for key, model in models.items():
            p = params(model)[name]
            assert p.dtype == torch.bfloat16 and torch.equal(p, want), (key, name)  # fp32 cast to bf16
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in models["shards"].modules())


def test_streaming_quantization_matches_bnb(ckpts):
    """bf16 expert quantized while streaming == bitsandbytes quantizing the same weights (and so
    == the NF4 folder written through bnb's Linear4bit from the same seed)."""
    streamed = load_expert(ckpts["shards"], "cpu", quantize=True)
    prequant = load_expert(ckpts["nf4"], "cpu")
    shapes, linears = S.model_specs(CFG)
    for module in linears:
        weight = S.random_tensor(f"{module}.weight", shapes[f"{module}.weight"], SEED, torch.bfloat16)
        packed, qs = bnb_f.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        got = streamed.get_submodule(module).weight
        assert torch.equal(got.data, packed), module
        for attr in ("absmax", "code", "offset"):
            assert torch.equal(getattr(got.quant_state, attr), getattr(qs, attr)), (module, attr)
        assert torch.equal(got.quant_state.state2.absmax, qs.state2.absmax)
        assert (
            got.quant_state.blocksize == 64 and got.quant_state.quant_type == "nf4" and got.quant_state.nested
        )
        assert torch.equal(got.data, prequant.get_submodule(module).weight.data)
        assert torch.equal(streamed.get_submodule(module).bias, prequant.get_submodule(module).bias)
    x, t, ctx, y, cam = inputs(CFG)
    with torch.no_grad():
        torch.testing.assert_close(
            streamed(x, t, ctx, y=y, cam=cam), prequant(x, t, ctx, y=y, cam=cam), rtol=0, atol=0
        )


def test_quantize_false_dequantizes(ckpts):
    dense = load_expert(ckpts["nf4"], "cpu", quantize=False)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in dense.modules())
    for module, (weight, _) in stored_dequantized(ckpts["nf4"]).items():
        assert torch.equal(dense.get_submodule(module).weight, weight.to(torch.bfloat16)), module


def test_staging_in_small_chunks_gives_the_same_model(ckpts):
    """The pinned-staging path (used on CUDA) run on CPU with a 1000-byte buffer: every tensor
    larger than that crosses several chunks and both buffers."""
    direct = load_expert(ckpts["nf4"], "cpu")
    staged = load_expert(ckpts["nf4"], "cpu", staging_bytes=1000)
    for (name, p), q in zip(params(direct).items(), params(staged).values(), strict=True):
        assert torch.equal(p, q), name
    staged_q = load_expert(ckpts["fp32"], "cpu", quantize=True, staging_bytes=1000)
    direct_q = load_expert(ckpts["fp32"], "cpu", quantize=True)
    for (name, p), q in zip(params(direct_q).items(), params(staged_q).values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("control_type", ["act", None])
def test_variants_load_and_run(tmp_path, control_type):
    cfg = S.tiny_config(control_type)
    model = load_expert(S.write_nf4_expert(tmp_path / "e", cfg, mode="random"), "cpu")
    assert model.control_type == control_type
    x, t, ctx, y, cam = inputs(cfg, control=control_type is not None)
    with torch.no_grad():
        out = model(x, t, ctx, y=y, cam=cam)
    assert out.shape == (16, 2, 4, 4) and torch.isfinite(out).all()


def test_release_frees_weights(ckpts):
    model = load_expert(ckpts["nf4"], "cpu")
    release(model)
    assert all(p.is_meta for p in model.parameters())
    assert all(getattr(m, "quant_state", None) is None for m in model.modules())


def test_load_errors_name_the_file(tmp_path, ckpts):
    with pytest.raises(FileNotFoundError, match="missing"):
        load_expert(tmp_path / "missing", "cpu")
    src = fmt.detect_expert_format(ckpts["single"])
    ckpts["single"].with_suffix(".bak").write_bytes(ckpts["single"].read_bytes())
    try:
        ckpts["single"].write_bytes(b"\0" * 16)  # changed on disk after detection
        with pytest.raises(ValueError, match="one.safetensors"):
            load_expert(src, "cpu")
    finally:
        ckpts["single"].write_bytes(ckpts["single"].with_suffix(".bak").read_bytes())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


GPU_CFG = S.tiny_config(dim=256, ffn_dim=512, text_dim=64, freq_dim=64)


@pytest.mark.gpu
@gpu
def test_cuda_load_matches_cpu_and_frees_on_error(tmp_path, monkeypatch):
    from lingbot_world.loaders import stream

    ckpts = {"nf4": S.write_nf4_expert(tmp_path / "nf4", GPU_CFG, seed=SEED, mode="quantize")}
    cpu = load_expert(ckpts["nf4"], "cpu")
    for staging in (None, 0, 1000):
        model = load_expert(ckpts["nf4"], "cuda", staging_bytes=staging)
        for (name, p), q in zip(params(cpu).items(), params(model).values(), strict=True):
            # .data: Params4bit.cpu() would move the layer's shared quant_state to the CPU in place
            assert q.device.type == "cuda" and torch.equal(p.data, q.data.cpu()), name
        x, t, ctx, y, cam = (None if v is None else v.cuda() for v in inputs(GPU_CFG))
        with torch.no_grad():
            out = model(x, t, ctx, y=y, cam=cam)
        assert out.shape == (16, 2, 4, 4)
        release(model)
    del model, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    calls = {"n": 0}
    real_set = stream._set

    def failing_set(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 50:
            raise RuntimeError("injected failure")
        return real_set(*args, **kwargs)

    monkeypatch.setattr(stream, "_set", failing_set)
    with pytest.raises(RuntimeError, match="injected"):
        load_expert(ckpts["nf4"], "cuda")
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == before
