import dataclasses

import pytest
import torch
from lingbot_world.wan.config import A14B, DiTConfig
from lingbot_world.wan.dit import WanModel, init_random_, rope_apply, rope_freqs, rope_table

TINY = DiTConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=32)


def meta_model(**changes) -> WanModel:
    with torch.device("meta"):
        return WanModel.from_config(dataclasses.replace(A14B, **changes))


@pytest.mark.parametrize(
    "control_type, params",
    [("cam", 18_544_332_864), ("act", 18_544_332_864 + (1792 - 1536) * 5120), (None, 14_288_901_184)],
)
def test_a14b_parameter_count_on_meta(control_type, params):
    model = meta_model(control_type=control_type)
    assert sum(p.numel() for p in model.parameters()) == params
    assert all(p.is_meta for p in model.parameters())


def test_a14b_cam_key_names_and_shapes():
    shapes = {k: tuple(v.shape) for k, v in meta_model().state_dict().items()}
    expected = {
        "patch_embedding.weight": (5120, 36, 1, 2, 2),
        "patch_embedding_wancamctrl.weight": (5120, 1536),
        "c2ws_hidden_states_layer1.weight": (5120, 5120),
        "c2ws_hidden_states_layer2.bias": (5120,),
        "text_embedding.0.weight": (5120, 4096),
        "text_embedding.2.weight": (5120, 5120),
        "time_embedding.0.weight": (5120, 256),
        "time_embedding.2.weight": (5120, 5120),
        "time_projection.1.weight": (30720, 5120),
        "blocks.0.self_attn.q.weight": (5120, 5120),
        "blocks.0.self_attn.norm_q.weight": (5120,),
        "blocks.39.cross_attn.norm_k.weight": (5120,),
        "blocks.0.norm3.weight": (5120,),
        "blocks.0.norm3.bias": (5120,),
        "blocks.0.ffn.0.weight": (13824, 5120),
        "blocks.0.ffn.2.weight": (5120, 13824),
        "blocks.0.modulation": (1, 6, 5120),
        "blocks.39.cam_injector_layer1.weight": (5120, 5120),
        "blocks.39.cam_injector_layer2.bias": (5120,),
        "blocks.39.cam_scale_layer.weight": (5120, 5120),
        "blocks.39.cam_shift_layer.weight": (5120, 5120),
        "head.head.weight": (64, 5120),
        "head.modulation": (1, 2, 5120),
    }
    for key, shape in expected.items():
        assert shapes[key] == shape, key
    assert not any(k.startswith("blocks.40.") for k in shapes)
    # Upstream's LayerNorms norm1/norm2 have no affine weights; no freqs buffer is saved.
    assert "blocks.0.norm1.weight" not in shapes and "freqs" not in shapes
    linears = [m for m in meta_model().modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 569  # every one is quantized in the NF4 repack


def test_act_and_plain_variants_differ_only_in_camera_layers():
    cam = set(meta_model().state_dict())
    act = meta_model(control_type="act").state_dict()
    plain = set(meta_model(control_type=None).state_dict())
    assert set(act) == cam
    assert act["patch_embedding_wancamctrl.weight"].shape == (5120, 1792)
    camera_keys = cam - plain
    assert all("cam" in k or "c2ws" in k for k in camera_keys)
    assert len(camera_keys) == 6 + 40 * 8


def test_meta_build_allocates_nothing():
    before = torch.empty(0).untyped_storage().nbytes()
    model = meta_model()
    assert before == 0
    assert sum(b.numel() for b in model.buffers()) == 0
    assert model._freqs is None


def tiny_inputs(cam_channels=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 3, 4, 6, generator=g)
    y = torch.randn(20, 3, 4, 6, generator=g)
    ctx = torch.randn(7, 32, generator=g)
    cam = torch.randn(1, cam_channels, 3, 4, 6, generator=g)
    return x, y, ctx, cam


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_with_and_without_camera(dtype):
    model = init_random_(WanModel.from_config(TINY)).to(dtype)
    model.compute_dtype = dtype
    x, y, ctx, cam = tiny_inputs()
    t = torch.tensor([900])
    with torch.no_grad():
        out_cam = model(x, t, ctx, y=y, cam=cam)
        out_plain = model(x, t, ctx, y=y)
        again = model(x, t, ctx, y=y, cam=cam)
    assert out_cam.shape == (16, 3, 4, 6) and out_cam.dtype == torch.float32
    assert torch.isfinite(out_cam).all()
    assert torch.equal(out_cam, again)  # deterministic
    assert (out_cam - out_plain).abs().max() > 1e-3  # the camera changes the prediction


def test_timestep_and_text_change_the_prediction():
    model = init_random_(WanModel.from_config(TINY))
    model.compute_dtype = torch.float32
    x, y, ctx, cam = tiny_inputs()
    with torch.no_grad():
        base = model(x, torch.tensor([900]), ctx, y=y, cam=cam)
        other_t = model(x, torch.tensor([100]), ctx, y=y, cam=cam)
        other_ctx = model(x, torch.tensor([900]), 3 * torch.randn(7, 32), y=y, cam=cam)
    assert (base - other_t).abs().max() > 1e-3
    assert (base - other_ctx).abs().max() > 1e-3


def test_bf16_close_to_fp32():
    model = init_random_(WanModel.from_config(TINY))
    x, y, ctx, cam = tiny_inputs()
    with torch.no_grad():
        model.compute_dtype = torch.float32
        ref = model(x, torch.tensor([500]), ctx, y=y, cam=cam)
        model.compute_dtype = torch.bfloat16
        low = model(x, torch.tensor([500]), ctx, y=y, cam=cam)
    rel = (ref - low).norm() / ref.norm()
    assert rel < 0.05


def test_act_model_takes_448_channels():
    model = init_random_(WanModel.from_config(dataclasses.replace(TINY, control_type="act")))
    x, y, ctx, cam = tiny_inputs(cam_channels=448)
    with torch.no_grad():
        assert model(x, torch.tensor([10]), ctx, y=y, cam=cam).shape == x.shape
    with pytest.raises(ValueError, match="448"):
        model(x, torch.tensor([10]), ctx, y=y, cam=torch.zeros(1, 384, 3, 4, 6))


def test_bad_inputs_are_named():
    model = init_random_(WanModel.from_config(TINY))
    x, y, ctx, cam = tiny_inputs()
    with pytest.raises(ValueError, match="image condition y"):
        model(x, torch.tensor([1]), ctx)
    with pytest.raises(ValueError, match="camera tensor gives"):
        model(x, torch.tensor([1]), ctx, y=y, cam=cam[:, :, :2])
    with pytest.raises(ValueError, match="text_len"):
        model(x, torch.tensor([1]), torch.zeros(600, 32), y=y)
    plain = init_random_(WanModel.from_config(dataclasses.replace(TINY, control_type=None)))
    with pytest.raises(ValueError, match="no camera layers"):
        plain(x, torch.tensor([1]), ctx, y=y, cam=cam)
    with pytest.raises(ValueError, match="control_type"):
        WanModel(control_type="depth")


def test_rope_identity_at_origin_and_rotation_elsewhere():
    freqs = rope_freqs(16)
    x = torch.randn(2 * 2 * 3, 2, 16, dtype=torch.float64)
    out = rope_apply(x, (2, 2, 3), freqs)
    assert torch.allclose(out[0].double(), x[0], atol=1e-6)  # position (0,0,0): no rotation
    assert not torch.allclose(out[5].double(), x[5], atol=1e-3)
    # A rotation preserves the norm of every complex pair.
    assert torch.allclose(out.double().norm(dim=-1), x.norm(dim=-1), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_equals_complex_rope(monkeypatch, dtype):
    """Compiled blocks get each token's rotation as real (cos, sin) pairs: the same float64 products, so
    the same values. Run eagerly (a compile that fell back), the table also goes in token chunks."""
    from lingbot_world.wan import dit

    freqs, grid = rope_freqs(128), (3, 4, 5)
    table = rope_table(grid, freqs)
    assert table.shape == (60, 1, 64, 2) and table.dtype == torch.float64 and table.is_contiguous()
    x = torch.randn(60, 3, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = rope_apply(x, grid, table, dtype)
    monkeypatch.setattr(dit, "ROPE_CHUNK", 7)
    rows, real_rotate = [], dit._rotate_pairs
    monkeypatch.setattr(
        dit, "_rotate_pairs", lambda x, t, d: (rows.append(x.shape[0]), real_rotate(x, t, d))[1]
    )
    chunked = rope_apply(x, grid, table, dtype)
    assert max(rows) == 7 and sum(rows) == 60  # bounded float64 temporaries
    complex_ = rope_apply(x, grid, freqs, dtype)
    assert whole.dtype == dtype and torch.equal(whole, complex_) and torch.equal(chunked, complex_)
    in_place = x.clone()
    assert rope_apply(in_place, grid, table, dtype, out=in_place) is in_place and torch.equal(
        in_place, complex_
    )
    assert not torch.equal(whole, x)


def test_chunked_ffn_matches_one_pass(monkeypatch):
    from lingbot_world.wan import dit

    model = init_random_(WanModel.from_config(TINY))
    model.compute_dtype = torch.float32
    x, y, ctx, cam = tiny_inputs()
    rows, real_linear = [], dit.linear

    def spy(layer, inp, dtype):
        if layer is model.blocks[0].ffn[0]:
            rows.append(inp.shape)
        return real_linear(layer, inp, dtype)

    monkeypatch.setattr(dit, "linear", spy)
    with torch.no_grad():
        whole = model(x, torch.tensor([300]), ctx, y=y, cam=cam)
        monkeypatch.setattr(dit, "FFN_CHUNK", 7)  # 18 tokens -> chunks of 7, 7, 4
        chunked = model(x, torch.tensor([300]), ctx, y=y, cam=cam)
    assert torch.allclose(whole, chunked, atol=1e-5, rtol=1e-5)
    assert [r[0] for r in rows] == [18, 7, 7, 4]  # the residual stream stays [tokens, dim]
