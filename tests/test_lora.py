"""LoRA on NF4 experts (wan/lora.py, loaders/lora.py): every key layout's unmerged side path equals
the dense merged reference (dequantized W + strength * alpha/rank * up @ down), stacking adds,
strength 0 and detaching change nothing, and bad files are refused naming their tensors."""

import math
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_f
import pytest
import torch
import torch.nn.functional as F
from bitsandbytes.functional import QuantState
from lingbot_world.loaders import formats as fmt
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.lora import LoraSpec, load_loras, parse_lora_spec, read_lora, read_loras
from lingbot_world.loaders.stream import build_expert_meta, load_expert, quantize_nf4
from lingbot_world.wan.dit import WanModel, linear
from lingbot_world.wan.lora import (
    Lora,
    LoraError,
    LoraSide,
    attach_lora,
    attached_loras,
    detach_all,
    detach_lora,
    merge_into_weight,
)
from safetensors.torch import load_file, save_file

CFG = S.tiny_config()
SEED = 5
RANK, ALPHA = 4, 8.0  # scale alpha / rank = 2
FP32_LAYERS = {"time_embedding.0", "time_embedding.2", "time_projection.1", "head.head"}

# Linear targets of the low-rank tests and their diffusers names, written out independently of the loader.
DIFFUSERS = {
    "blocks.0.self_attn.q": "blocks.0.attn1.to_q",
    "blocks.1.self_attn.o": "blocks.1.attn1.to_out.0",
    "blocks.0.cross_attn.k": "blocks.0.attn2.to_k",
    "blocks.1.cross_attn.o": "blocks.1.attn2.to_out.0",
    "blocks.1.ffn.0": "blocks.1.ffn.net.0.proj",
    "blocks.0.ffn.2": "blocks.0.ffn.net.2",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "blocks.0.cam_injector_layer1": "blocks.0.cam_injector_layer1",
    "patch_embedding_wancamctrl": "patch_embedding_wancamctrl",
}
LINEARS = list(DIFFUSERS)
LAYOUTS = ("comfy", "comfy_ab", "kohya", "wan_fun", "peft")


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory):
    return S.write_nf4_expert(tmp_path_factory.mktemp("lora") / "nf4", CFG, seed=SEED, mode="quantize")


@pytest.fixture(scope="module")
def dequantized(nf4_dir) -> dict:
    """{module: dense bf16 weight} from bnb's own deserialisation of the stored NF4 data."""
    state = load_file(nf4_dir / "model.safetensors")
    out = {}
    for module, layer in fmt.detect_expert_format(nf4_dir).quant_layers.items():
        comps = {t.split(".weight.", 1)[1]: state[t].clone() for p, t in layer.parts.items() if p != "weight"}
        qs = QuantState.from_dict(comps, device=torch.device("cpu"))
        out[module] = bnb_f.dequantize_4bit(state[f"{module}.weight"], qs)
    return out


def nf4_model(nf4_dir):
    model = load_expert(nf4_dir, "cpu")
    for m in model.modules():  # bnb's AVX512-BF16 CPU kernel repacks weights in place; keep the stored layout
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def shapes_of(model) -> dict:
    return {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def random_lowrank(targets, shapes, seed, with_bias=False) -> dict:
    """{target: (down, up, diff_b)} in bf16, sized so the delta is ~ the weight's own scale."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in targets:
        o, i = shapes[t]
        down = (torch.randn(RANK, i, generator=g) / math.sqrt(i)).bfloat16()
        up = (0.5 * torch.randn(o, RANK, generator=g) / math.sqrt(RANK)).bfloat16()
        bias = (0.1 * torch.randn(o, generator=g)).bfloat16() if with_bias else None
        out[t] = (down, up, bias)
    return out


def lowrank_file(path, patches: dict, layout: str) -> None:
    """Write `patches` in one trainer's key layout; the peft layout stores no alpha, so its `up`
    carries the scale (as diffusers' converter does)."""
    sd = {}
    for t, (down, up, bias) in patches.items():
        if layout == "peft":
            base = f"transformer.{DIFFUSERS[t]}"
            sd[f"{base}.lora_A.weight"] = down
            sd[f"{base}.lora_B.weight"] = (up.float() * (ALPHA / RANK)).bfloat16()
            if bias is not None:
                sd[f"{base}.lora_B.bias"] = bias
            continue
        base, (d, u) = {
            "comfy": (f"diffusion_model.{t}", ("lora_down", "lora_up")),
            "comfy_ab": (f"diffusion_model.{t}", ("lora_A", "lora_B")),
            "kohya": ("lora_unet_" + t.replace(".", "_"), ("lora_down", "lora_up")),
            "wan_fun": ("lora_unet__" + t.replace(".", "_"), ("lora_down", "lora_up")),
        }[layout]
        sd[f"{base}.{d}.weight"], sd[f"{base}.{u}.weight"] = down, up
        sd[f"{base}.alpha"] = torch.tensor(ALPHA)
        if bias is not None:
            sd[f"{base}.diff_b"] = bias
    save_file(sd, str(path))


def effective_up(up, layout):
    return (
        (up.float() * (ALPHA / RANK)).bfloat16().float() if layout == "peft" else up.float() * (ALPHA / RANK)
    )


def dtype_of(target):
    """The dtype wan.dit runs a Linear in (bnb's CPU bf16 kernel also needs in_features >= 64)."""
    return torch.float32 if target in FP32_LAYERS else torch.bfloat16


def reference_linear(x, weight, bias, dtype):
    return F.linear(x.to(dtype), weight.to(dtype), bias.to(dtype))


def assert_close_bf16(got, want):
    """Within bf16 rounding of the output's scale (a few ulps of the largest value)."""
    tol = 3 * 2**-8 * want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_side_path_equals_merged_reference(nf4_dir, dequantized, tmp_path, layout):
    model = nf4_model(nf4_dir)
    shapes = shapes_of(model)
    patches = random_lowrank(LINEARS, shapes, seed=1, with_bias=True)
    lowrank_file(tmp_path / "l.safetensors", patches, layout)
    strength = 0.7
    lora = read_lora(tmp_path / "l.safetensors", model, strength=strength)
    assert set(lora.patches) == set(LINEARS)
    g = torch.Generator().manual_seed(2)
    xs = {t: torch.randn(6, shapes[t][1], generator=g) for t in LINEARS}
    before = {t: linear(model.get_submodule(t), xs[t], dtype_of(t)) for t in LINEARS}
    attach_lora(model, lora)
    for t, (down, up, bias) in patches.items():
        dtype = dtype_of(t)
        layer = model.get_submodule(t)
        w = dequantized[t].float() + strength * effective_up(up, layout) @ down.float()
        b = layer.bias.float() + strength * bias.float()
        got = linear(layer, xs[t], dtype)
        want = reference_linear(xs[t], w, b, dtype)
        assert got.dtype == dtype
        assert_close_bf16(got, want)
        # the LoRA matters: far more than the tolerance
        assert (got.float() - before[t].float()).abs().max() > 0.1 * want.abs().max()


def test_nf4_weights_untouched_and_detach_is_exact(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    packed = {n: p.data.clone() for n, p in model.named_parameters()}
    x, t, ctx, y, cam = inputs()
    with torch.no_grad():
        plain = model(x, t, ctx, y=y, cam=cam)
    patches = random_lowrank(LINEARS, shapes_of(model), seed=3, with_bias=True)
    lowrank_file(tmp_path / "l.safetensors", patches, "comfy")
    diff_file(tmp_path / "d.safetensors", model, seed=4)
    with pytest.warns(UserWarning, match="dense side weights"):
        handles = load_loras(
            model, [LoraSpec(tmp_path / "l.safetensors"), LoraSpec(tmp_path / "d.safetensors")], "high"
        )
    assert len(handles) == 2 and attached_loras(model) == handles
    with torch.no_grad():
        patched = model(x, t, ctx, y=y, cam=cam)
    assert (patched - plain).abs().max() > 0.1
    sides = [n for n, m in model.named_modules() if isinstance(m, LoraSide)]
    assert sides and not any(".lora." in k for k in model.state_dict())  # never saved with the model
    for name, p in model.named_parameters():
        if p.dtype == torch.uint8:
            assert torch.equal(p.data, packed[name]), name  # 4-bit weights never rewritten
    detach_all(model)
    assert not attached_loras(model) and not any(isinstance(m, LoraSide) for m in model.modules())
    for name, p in model.named_parameters():
        assert torch.equal(p.data, packed[name]), name  # in-place deltas undone exactly
    with torch.no_grad():
        again = model(x, t, ctx, y=y, cam=cam)
    assert torch.equal(again, plain)


def test_linear_without_adapters_is_unchanged(nf4_dir):
    """No adapters: `linear` is Linear4bit's own forward (bf16) and dequantize-then-matmul (fp32)."""
    model = nf4_model(nf4_dir)
    g = torch.Generator().manual_seed(0)
    for name in ("blocks.0.self_attn.q", "head.head"):
        layer = model.get_submodule(name)
        x = torch.randn(3, layer.in_features, generator=g)
        dense = bnb_f.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        assert torch.equal(linear(layer, x, torch.float32), F.linear(x, dense.float(), layer.bias.float()))
        assert torch.equal(linear(layer, x, torch.bfloat16), layer(x.bfloat16()))
    dense_layer = torch.nn.Linear(8, 5)
    x = torch.randn(2, 8, generator=g)
    assert torch.equal(linear(dense_layer, x, torch.float32), dense_layer(x))


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 4, 4, generator=g)
    y = torch.randn(20, 2, 4, 4, generator=g)
    ctx = torch.randn(7, CFG.text_dim, generator=g)
    cam = torch.randn(1, 384, 2, 4, 4, generator=g)
    return x, torch.tensor([700.0]), ctx, y, cam


# non-Linear parameters a step-distill LoRA's `diff`/`diff_b` may touch (ComfyUI names)
DIFF_PARAMS = {
    "blocks.0.norm3": ("diff", "diff_b"),
    "blocks.1.self_attn.norm_q": ("diff",),
    "blocks.0.modulation": ("diff",),
    "head.modulation": ("diff",),
    "patch_embedding": ("diff", "diff_b"),
}
DIFF_LINEARS = ("blocks.1.cross_attn.v", "time_embedding.0", "blocks.0.ffn.0")


def diff_file(path, model, seed) -> dict:
    """A step-distill style LoRA: full `diff` on Linears and non-Linear parameters, `diff_b` on biases."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    sd = {}
    for t, parts in DIFF_PARAMS.items():
        shape = params[t].shape if t.endswith("modulation") else params[f"{t}.weight"].shape
        sd[f"diffusion_model.{t}.diff"] = (0.05 * torch.randn(shape, generator=g)).bfloat16()
        if "diff_b" in parts:
            sd[f"diffusion_model.{t}.diff_b"] = (
                0.05 * torch.randn(params[f"{t}.bias"].shape, generator=g)
            ).bfloat16()
    for t in DIFF_LINEARS:
        layer = model.get_submodule(t)
        sd[f"diffusion_model.{t}.diff"] = (
            torch.randn(layer.out_features, layer.in_features, generator=g)
            / (3 * math.sqrt(layer.in_features))
        ).bfloat16()
        sd[f"diffusion_model.{t}.diff_b"] = (0.05 * torch.randn(layer.out_features, generator=g)).bfloat16()
    save_file(sd, str(path))
    return sd


def dense_reference(nf4_dir, dequantized, deltas: dict) -> WanModel:
    """A dense bf16 model of the dequantized NF4 weights with `deltas` {param name: fp32 delta} merged."""
    ref = WanModel.from_config(CFG)
    names = dict(ref.named_parameters())
    state = {k: v for k, v in load_file(nf4_dir / "model.safetensors").items() if k in names}
    state.update({f"{m}.weight": w for m, w in dequantized.items()})
    for k, d in deltas.items():
        state[k] = (state[k].float() + d).to(state[k].dtype)
    ref.load_state_dict(state, strict=True)
    return ref.to(torch.bfloat16).eval()


def test_model_forward_with_stacked_loras_matches_merged_dense_model(nf4_dir, dequantized, tmp_path):
    """Whole-model check: a low-rank LoRA (kohya) and a diff LoRA stacked at their strengths on the
    NF4 expert == a dense model with both merged into the dequantized weights."""
    model = nf4_model(nf4_dir)
    patches = random_lowrank(LINEARS, shapes_of(model), seed=7, with_bias=True)
    lowrank_file(tmp_path / "k.safetensors", patches, "kohya")
    sd = diff_file(tmp_path / "d.safetensors", model, seed=8)
    s1, s2 = 0.8, 0.6
    deltas = {}
    for t, (down, up, bias) in patches.items():
        deltas[f"{t}.weight"] = s1 * (ALPHA / RANK) * up.float() @ down.float()
        deltas[f"{t}.bias"] = s1 * bias.float()
    for key, v in sd.items():
        t, part = key[len("diffusion_model.") :].rsplit(".", 1)
        name = t if t.endswith("modulation") else f"{t}.{'weight' if part == 'diff' else 'bias'}"
        deltas[name] = deltas.get(name, 0) + s2 * v.float()
    ref = dense_reference(nf4_dir, dequantized, deltas)
    x, t, ctx, y, cam = inputs()
    with torch.no_grad():
        plain = model(x, t, ctx, y=y, cam=cam)
        specs = [
            parse_lora_spec(f"{tmp_path / 'k.safetensors'}:{s1}"),
            LoraSpec(tmp_path / "d.safetensors", s2),
        ]
        with pytest.warns(UserWarning, match="dense side weights"):
            load_loras(model, specs, "low")
        got = model(x, t, ctx, y=y, cam=cam)
        want = ref(x, t, ctx, y=y, cam=cam)
    effect = (want - plain).abs().max().item()
    err = (got - want).abs().max().item()
    assert effect > 0.3 and err < 0.05 * effect, (err, effect)


def test_stacked_loras_add_and_detach_one(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    shapes = shapes_of(model)
    a, b = random_lowrank(LINEARS, shapes, seed=11), random_lowrank(LINEARS[:5], shapes, seed=12)
    lowrank_file(tmp_path / "a.safetensors", a, "comfy")
    lowrank_file(tmp_path / "b.safetensors", b, "peft")
    la, lb = (
        read_lora(tmp_path / "a.safetensors", model, 1.0),
        read_lora(tmp_path / "b.safetensors", model, -0.5),
    )
    g = torch.Generator().manual_seed(0)
    xs = {t: torch.randn(4, shapes[t][1], generator=g) for t in LINEARS}

    def outputs():
        return {t: linear(model.get_submodule(t), xs[t], dtype_of(t)) for t in LINEARS}

    base = outputs()
    ha = attach_lora(model, la)
    only_a = outputs()
    attach_lora(model, lb)
    both = outputs()
    for t in LINEARS:
        da = only_a[t].float() - base[t].float()
        want = base[t].float() + da
        if t in b:
            down, up, _ = b[t]
            want = want - 0.5 * (xs[t].to(dtype_of(t)).float() @ down.float().T) @ effective_up(up, "peft").T
        assert_close_bf16(both[t], want)
    detach_lora(model, ha)
    lb_alone = outputs()
    detach_all(model)
    attach_lora(model, lb)
    assert all(torch.equal(lb_alone[t], v) for t, v in outputs().items())
    with pytest.raises(ValueError, match="not attached"):
        detach_lora(model, ha)


def test_strength_zero_is_a_no_op(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    lowrank_file(tmp_path / "l.safetensors", random_lowrank(LINEARS, shapes_of(model), seed=1), "comfy")
    diff_file(tmp_path / "d.safetensors", model, seed=2)
    x, t, ctx, y, cam = inputs()
    with torch.no_grad():
        plain = model(x, t, ctx, y=y, cam=cam)
        load_loras(
            model,
            [parse_lora_spec(f"{tmp_path / 'l.safetensors'}:0"), LoraSpec(tmp_path / "d.safetensors", 0.0)],
            "high",
        )
        assert len(attached_loras(model)) == 2
        assert torch.equal(model(x, t, ctx, y=y, cam=cam), plain)
    assert merge_into_weight("blocks.0.self_attn.q.weight", torch.ones(3), [Lora({}, 0.0)]).sum() == 3


def test_unmatched_keys_listed_in_one_error(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    patches = random_lowrank(["blocks.0.self_attn.q"], shapes_of(model), seed=1)
    lowrank_file(tmp_path / "l.safetensors", patches, "comfy")
    sd = load_file(tmp_path / "l.safetensors")
    extra = {
        "diffusion_model.blocks.7.self_attn.q.lora_down.weight": torch.zeros(RANK, 64),  # no block 7
        "diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight": torch.zeros(RANK, 64),  # Wan2.1 i2v
        "diffusion_model.blocks.0.self_attn.q.hada_w1_a": torch.zeros(RANK, 64),  # LoHa: unsupported
    }
    save_file({**sd, **extra}, str(tmp_path / "x.safetensors"))
    with pytest.raises(LoraError) as e:
        read_lora(tmp_path / "x.safetensors", model)
    msg = str(e.value)
    assert "3 key(s) match no layer" in msg and all(k in msg for k in extra) and "x.safetensors" in msg
    assert "Wan2.1 i2v" in msg and "allow_unmatched" in msg
    with pytest.warns(UserWarning, match="3 key"):
        lora = read_lora(tmp_path / "x.safetensors", model, allow_unmatched=True)
    assert list(lora.patches) == ["blocks.0.self_attn.q"]


def test_lora_for_another_model_is_refused_naming_the_tensor(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    other = build_expert_meta(S.tiny_config(dim=96, ffn_dim=192))  # a wider model
    lowrank_file(tmp_path / "w.safetensors", random_lowrank(["blocks.1.ffn.0"], shapes_of(other), 1), "kohya")
    with pytest.raises(LoraError, match=r"lora_unet_blocks_1_ffn_0\.lora_down\.weight.*\[4, 96\].*64 inputs"):
        read_lora(tmp_path / "w.safetensors", model)
    # a diff of the wrong shape, an up without its down, and a bias delta for a bias-less norm
    save_file(
        {
            "diffusion_model.blocks.0.modulation.diff": torch.zeros(1, 6, 96),
            "diffusion_model.blocks.0.ffn.2.lora_up.weight": torch.zeros(64, RANK),
            "diffusion_model.blocks.0.self_attn.norm_k.diff_b": torch.zeros(64),
        },
        str(tmp_path / "bad.safetensors"),
    )
    with pytest.raises(LoraError) as e:
        read_lora(tmp_path / "bad.safetensors", model)
    msg = str(e.value)
    assert "diffusion_model.blocks.0.modulation.diff: shape [1, 6, 96], expected [1, 6, 64]" in msg
    assert "diffusion_model.blocks.0.ffn.2.lora_up.weight: low-rank 'up' without its 'down'" in msg
    assert "diffusion_model.blocks.0.self_attn.norm_k.diff_b: blocks.0.self_attn.norm_k has no bias" in msg
    save_file(
        {
            "diffusion_model.patch_embedding.lora_down.weight": torch.zeros(RANK, 36),
            "diffusion_model.patch_embedding.lora_up.weight": torch.zeros(64, RANK),
        },
        str(tmp_path / "conv.safetensors"),
    )
    with pytest.raises(LoraError, match="patch_embedding.*Conv3d.*only 'diff'"):
        read_lora(tmp_path / "conv.safetensors", model)
    (tmp_path / "l.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="only .safetensors"):
        read_lora(tmp_path / "l.pt", model)


def test_merge_into_weight_before_quantization(nf4_dir, tmp_path):
    """Merge-before-quantize: the dense tensor a streaming loader is about to quantize gets exactly
    strength * alpha/rank * up @ down (fp32 sum, rounded once), and NF4 of it keeps the LoRA."""
    model = nf4_model(nf4_dir)
    patches = random_lowrank(["blocks.0.ffn.0"], shapes_of(model), seed=9, with_bias=True)
    lowrank_file(tmp_path / "l.safetensors", patches, "comfy")
    meta = build_expert_meta(CFG)
    loras = read_loras([LoraSpec(tmp_path / "l.safetensors", 0.9, "low")], meta, "low")
    assert read_loras([LoraSpec(tmp_path / "l.safetensors", 0.9, "low")], meta, "high") == []
    down, up, bias = patches["blocks.0.ffn.0"]
    w = S.random_tensor("blocks.0.ffn.0.weight", (128, 64), SEED, torch.bfloat16)
    b = S.random_tensor("blocks.0.ffn.0.bias", (128,), SEED, torch.bfloat16)
    merged = merge_into_weight("blocks.0.ffn.0.weight", w, loras)
    want = w.float() + 0.9 * (ALPHA / RANK) * up.float() @ down.float()
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, want.bfloat16())
    assert torch.equal(
        merge_into_weight("blocks.0.ffn.0.bias", b, loras), (b.float() + 0.9 * bias.float()).bfloat16()
    )
    other = S.random_tensor("blocks.1.ffn.0.weight", (128, 64), SEED, torch.bfloat16)
    assert merge_into_weight("blocks.1.ffn.0.weight", other, loras) is other
    packed, qs = quantize_nf4(merged, torch.bfloat16)
    requant = bnb_f.dequantize_4bit(packed, qs).float()
    nf4_error = (requant - want).abs().mean()
    assert nf4_error < 0.3 * (want - w.float()).abs().mean()  # the LoRA survives quantization


def test_side_paths_follow_the_model_and_keep_dtypes(nf4_dir, tmp_path):
    model = nf4_model(nf4_dir)
    lowrank_file(tmp_path / "l.safetensors", random_lowrank(LINEARS, shapes_of(model), seed=1), "comfy")
    load_loras(model, [LoraSpec(tmp_path / "l.safetensors")], "high")
    q, head = model.get_submodule("blocks.0.self_attn.q.lora"), model.get_submodule("head.head.lora")
    assert [t.dtype for t in q.paths()[0][:2]] == [torch.bfloat16] * 2  # compute dtype
    assert [t.dtype for t in head.paths()[0][:2]] == [torch.float32] * 2  # the head runs in fp32
    assert isinstance(model.get_submodule("blocks.0.self_attn.q"), bnb.nn.Linear4bit)
    assert q.paths()[0][2] == pytest.approx(ALPHA / RANK)
    bufs = {n for n, _ in model.named_buffers()}
    assert "blocks.0.self_attn.q.lora.down_" in " ".join(bufs)  # moves with model.to(...)


def test_parse_lora_spec(tmp_path):
    assert parse_lora_spec("a.safetensors") == LoraSpec("a.safetensors", 1.0, "both")
    assert parse_lora_spec("dir/a.safetensors:0.5") == LoraSpec("dir/a.safetensors", 0.5, "both")
    assert parse_lora_spec("C:/x/a.SafeTensors:-1:low") == LoraSpec("C:/x/a.SafeTensors", -1.0, "low")
    assert parse_lora_spec("a.safetensors:2:HIGH").experts == "high"
    for bad, why in [
        ("a.ckpt:1", "FILE a .safetensors"),
        ("a.safetensors:strong", "strength 'strong' is not a number"),
        ("a.safetensors:1:middle", "high, low or both, got 'middle'"),
        ("a.safetensors:nan", "finite"),
        ("a.safetensors:1:low:x", "FILE"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_lora_spec(bad)
    with pytest.raises(ValueError, match="experts must be one of"):
        LoraSpec("a.safetensors", 1.0, "all")
    spec = LoraSpec("a.safetensors", 1.0, "low")
    assert spec.applies_to("low") and not spec.applies_to("high")


def test_lora_load_time_is_seconds(nf4_dir, tmp_path):
    """Reading and attaching a LoRA touches no 4-bit weight: on the tiny model it takes milliseconds."""
    model = nf4_model(nf4_dir)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    lowrank_file(tmp_path / "all.safetensors", random_lowrank(targets, shapes_of(model), seed=1), "comfy")
    start = time.perf_counter()
    handles = load_loras(model, [LoraSpec(tmp_path / "all.safetensors")], "high")
    elapsed = time.perf_counter() - start
    assert len(handles[0].lora.patches) == len(targets) == 37
    print(f"tiny LoRA ({len(targets)} layers) read + attach: {elapsed * 1e3:.1f} ms")
    assert elapsed < 5.0


def test_key_names_map_to_our_layers():
    """Prefixes and names of the other layouts, including diffusers' norm/modulation names."""
    from lingbot_world.loaders.lora import match_keys
    from lingbot_world.wan.lora import lora_targets

    targets = lora_targets(build_expert_meta(CFG))
    cases = {
        "model.diffusion_model.blocks.1.cross_attn.q.lora_down.weight": ("blocks.1.cross_attn.q", "down"),
        "base_model.model.blocks.0.attn2.to_v.lora_B.default.weight": ("blocks.0.cross_attn.v", "up"),
        "lycoris_blocks_1_ffn_2.lora_up.weight": ("blocks.1.ffn.2", "up"),
        "lora_transformer_blocks_0_attn1_to_out_0.alpha": ("blocks.0.self_attn.o", "alpha"),
        "transformer.blocks.1.norm2.diff": ("blocks.1.norm3", "diff"),  # diffusers norm2 = cross-attn norm
        "transformer.blocks.0.attn1.norm_k.diff": ("blocks.0.self_attn.norm_k", "diff"),
        "transformer.blocks.0.scale_shift_table.diff": ("blocks.0.modulation", "diff"),
        "transformer.scale_shift_table.diff": ("head.modulation", "diff"),
        "diffusion_model.head.head.weight.diff": ("head.head", "diff"),
        "diffusion_model.blocks.0.norm3.bias.diff": ("blocks.0.norm3", "diff_b"),
        "diffusion_model.time_projection.1.diff_b": ("time_projection.1", "diff_b"),
        "diffusion_model.c2ws_hidden_states_layer2.lora_A.weight": ("c2ws_hidden_states_layer2", "down"),
        "lora_unet_blocks_1_cam_scale_layer.lora_down.weight": ("blocks.1.cam_scale_layer", "down"),
    }
    groups, unmatched = match_keys(list(cases), targets)
    assert unmatched == []
    assert {(t, p) for t, parts in groups.items() for p in parts} == set(cases.values())
    for target, parts in groups.items():
        for part, key in parts.items():
            assert cases[key] == (target, part)
    # plain Wan2.2 (no camera layers): the camera keys match nothing
    plain = lora_targets(build_expert_meta(S.tiny_config(None)))
    _, unmatched = match_keys(list(cases), plain)
    assert sorted(unmatched) == sorted(k for k in cases if "c2ws" in k or "cam_" in k)
