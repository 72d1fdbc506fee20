"""Lean activations (`WanAttentionBlock.forward_lean`): equal to the normal blocks (bit for bit in bf16 on the
CPU, within 1e-5 in fp32 compute, where chunked GEMMs round differently), with the camera, block swap, a
LoRA and sequence parallel; off is today's exact forward; the wiring through speed options, the planner's
'auto', the CLI and the node."""

import argparse
import math
import socket
from pathlib import Path

import parallel_worker as worker
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from einops import rearrange
from lingbot_world import cli
from lingbot_world.loaders.synthetic import tiny_config
from lingbot_world.session import planner as memplan
from lingbot_world.wan import dit, i2v, pipeline
from lingbot_world.wan.config import A14B, DiTConfig, SampleConfig
from lingbot_world.wan.dit import WanModel, init_random_, rope_apply, rope_freqs
from lingbot_world.wan.speed import SpeedOptions
from safetensors.torch import load_file

GOLDEN = Path(__file__).resolve().parent / "golden" / "dit_paths.safetensors"
TINY = DiTConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=32)


def golden_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 4, 6, generator=g)
    y = torch.randn(20, 3, 4, 6, generator=g)
    ctx = torch.randn(7, 32, generator=g)
    cam = torch.randn(1, 384, 3, 4, 6, generator=g)
    return x, y, ctx, cam


def tiny(dtype):
    model = init_random_(WanModel.from_config(TINY))
    model.compute_dtype = dtype
    return model


def forward(model, cam=True):
    x, y, ctx, c = golden_inputs()
    with torch.no_grad():
        return model(x, torch.tensor([700]), ctx, y=y, cam=c if cam else None)


def _layer_norm(norm, x):
    if isinstance(norm, torch.nn.Identity):
        return x
    w = None if norm.weight is None else norm.weight.float()
    b = None if norm.bias is None else norm.bias.float()
    return F.layer_norm(x.float(), norm.normalized_shape, w, b, norm.eps).type_as(x)


def _rms_norm(norm, x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight.to(
        x.dtype
    )


def _reference_block(b, x, e0, grid, freqs, context, cam, dtype):
    lin, sa, ca = dit.linear, b.self_attn, b.cross_attn
    n, d = sa.num_heads, sa.head_dim
    e = (b.modulation.float() + e0)[0].unbind(0)
    h = _layer_norm(b.norm1, x).float() * (1 + e[1]) + e[0]
    q = dit.rope_apply(_rms_norm(sa.norm_q, lin(sa.q, h, dtype)).view(-1, n, d), grid, freqs, dtype)
    k = dit.rope_apply(_rms_norm(sa.norm_k, lin(sa.k, h, dtype)).view(-1, n, d), grid, freqs, dtype)
    v = lin(sa.v, h, dtype).view(-1, n, d)
    x = x + lin(sa.o, dit.attention(q, k, v, dtype).flatten(1), dtype) * e[2]
    if cam is not None:
        h = lin(b.cam_injector_layer2, F.silu(lin(b.cam_injector_layer1, cam, dtype)), dtype) + cam
        x = (1.0 + lin(b.cam_scale_layer, h, dtype)) * x + lin(b.cam_shift_layer, h, dtype)
    q = _rms_norm(ca.norm_q, lin(ca.q, _layer_norm(b.norm3, x), dtype)).view(-1, n, d)
    k = _rms_norm(ca.norm_k, lin(ca.k, context, dtype)).view(-1, n, d)
    v = lin(ca.v, context, dtype).view(-1, n, d)
    x = x + lin(ca.o, dit.attention(q, k, v, dtype).to(q.dtype).flatten(1), dtype)
    h = _layer_norm(b.norm2, x).float() * (1 + e[4]) + e[3]
    return x + lin(b.ffn[2], F.gelu(lin(b.ffn[0], h, dtype), approximate="tanh"), dtype) * e[5]


def reference_forward(model, cam=True):
    """`forward(model, cam)` with the normal blocks, frozen: WanModel.forward written out op by op as it
    was when lean activations came (one process: no block swap, sequence parallel or compile), from the
    model's parameters and dit's leaf functions (linear, rope_apply, attention). A change to the model's
    forward that changes its results has to change this too, on purpose."""
    x, y, context, c = golden_inputs()
    dtype, lin, f32 = model.compute_dtype, dit.linear, torch.float32
    pe = model.patch_embedding
    with torch.no_grad():
        x = torch.cat([x, y]).unsqueeze(0).to(dtype)
        x = F.conv3d(x, pe.weight.to(dtype), pe.bias.to(dtype), stride=model.patch_size)[0]
        grid = tuple(x.shape[1:])
        x = x.flatten(1).transpose(0, 1)
        e = dit.sinusoidal_embedding_1d(model.freq_dim, torch.tensor([700])).float()
        e = lin(model.time_embedding[2], F.silu(lin(model.time_embedding[0], e, f32)), f32)
        e0 = lin(model.time_projection[1], F.silu(e), f32).unflatten(1, (6, model.dim))
        context = torch.cat([context, context.new_zeros(model.text_len - context.shape[0], context.shape[1])])
        context = lin(model.text_embedding[0], context, dtype)
        context = lin(model.text_embedding[2], F.gelu(context, approximate="tanh"), dtype)
        if cam:
            p1, p2, p3 = model.patch_size
            c = rearrange(c, "1 c (f c1) (h c2) (w c3) -> (f h w) (c c1 c2 c3)", c1=p1, c2=p2, c3=p3)
            c = lin(model.patch_embedding_wancamctrl, c, dtype)
            c = c + lin(
                model.c2ws_hidden_states_layer2, F.silu(lin(model.c2ws_hidden_states_layer1, c, dtype)), dtype
            )
        freqs = dit.rope_freqs(model.blocks[0].self_attn.head_dim)
        for block in model.blocks:
            x = _reference_block(block, x, e0, grid, freqs, context, c if cam else None, dtype)
        m = (model.head.modulation.float() + e.unsqueeze(1)).chunk(2, dim=1)
        x = lin(model.head.head, _layer_norm(model.head.norm, x) * (1 + m[1][0]) + m[0][0], f32)
        u = x.to(dtype)[: math.prod(grid)].view(*grid, *model.patch_size, model.out_dim)
        u = torch.einsum("fhwpqrc->cfphqwr", u)
        return u.reshape(model.out_dim, *[i * j for i, j in zip(grid, model.patch_size, strict=True)]).float()


# The golden outputs against this machine's: another CPU (instruction set, GEMM blocking) or torch build
# rounds the bf16/fp32 GEMMs differently in their last bits (measured between machines: one bf16 step of
# the output in bf16 compute, 3e-6 in fp32); allowed here: twice that.
GOLDEN_TOL = {torch.bfloat16: dict(rtol=2**-7, atol=2**-7), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cam", [True, False])
def test_off_is_todays_forward_bit_for_bit(dtype, cam, monkeypatch):
    """Lean off runs the normal blocks only, and gives today's forward: bit for bit the frozen reference
    implementation above, computed here (so on any machine: the same ops on the same CPU), and within
    rounding the outputs of the forward before lean activations existed (tests/golden/dit_paths), which
    guards the reference itself.

    The golden file alone was compared bit for bit before; it was made on one CPU and failed on others
    (AMD EPYC, other Xeons, other torch builds), whose GEMM kernels round the last bits differently. The
    reference keeps the bit-exact check's power (a change of one rounding in the forward fails it)
    without depending on the machine."""
    calls = []
    monkeypatch.setattr(dit.WanAttentionBlock, "forward_lean", lambda *a, **k: calls.append(1))
    model = tiny(dtype)
    assert model.lean_activations is False
    got = forward(model, cam)
    assert torch.equal(got, reference_forward(model, cam)) and not calls
    want = load_file(str(GOLDEN))[f"{'cam' if cam else 'plain'}_{str(dtype).removeprefix('torch.')}"]
    torch.testing.assert_close(got, want, **GOLDEN_TOL[dtype])


@pytest.mark.parametrize("cam", [True, False])
def test_lean_equals_normal(cam, monkeypatch):
    rows, real_linear = [], dit.linear

    def spy(layer, inp, dtype):
        rows.append((layer, inp.reshape(-1, inp.shape[-1]).shape[0]))
        return real_linear(layer, inp, dtype)

    for dtype in (torch.bfloat16, torch.float32):
        model = tiny(dtype)
        text = {id(b.cross_attn.k) for b in model.blocks} | {id(b.cross_attn.v) for b in model.blocks}
        per_token = {id(m) for m in [*model.blocks.modules(), model.head.head]} - text
        want = forward(model, cam)
        model.lean_activations = True
        for chunk in (5, 7, 18, 1000):  # 18 tokens: several chunks with a short last one, one chunk, more
            model.lean_chunk = chunk
            monkeypatch.setattr(dit, "linear", spy)
            rows.clear()
            got = forward(model, cam)
            monkeypatch.setattr(dit, "linear", real_linear)
            # every per-token projection of the blocks and the head ran on one chunk of tokens at most
            block_rows = [n for layer, n in rows if id(layer) in per_token]
            assert len(block_rows) >= 17 and max(block_rows) == min(chunk, 18)
            assert sum(n for layer, n in rows if layer is model.blocks[1].ffn[0]) == 18
            if dtype == torch.bfloat16:  # the model's compute dtype: bit for bit on the CPU
                assert torch.equal(got, want), chunk
            else:  # fp32 GEMMs of fewer rows round differently
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lean_keeps_the_residual_in_place_and_only_full_length_tensors(monkeypatch):
    """Block 1's fp32 residual is updated in place (the tensor returned is the one passed in), and the
    q/k/v buffers are rotated in place (no second full-length q or k)."""
    model = tiny(torch.bfloat16)
    model.lean_activations, model.lean_chunk = True, 16
    seen, ropes = {}, []
    real_lean, real_rope = dit.WanAttentionBlock.forward_lean, dit.rope_apply

    def lean(block, x, *args):
        out = real_lean(block, x, *args)
        seen[len(seen)] = (x.data_ptr(), x.dtype, out.data_ptr(), out.dtype)
        return out

    def rope(x, grid, freqs, out_dtype=torch.float32, out=None):
        ropes.append(out is x)
        return real_rope(x, grid, freqs, out_dtype, out)

    monkeypatch.setattr(dit.WanAttentionBlock, "forward_lean", lean)
    monkeypatch.setattr(dit, "rope_apply", rope)
    forward(model)
    assert seen[0][1] == torch.bfloat16 and seen[0][3] == torch.float32  # block 0 makes the fp32 copy
    assert seen[1][0] == seen[1][2] and seen[1][1] == torch.float32  # block 1 writes into it
    assert ropes == [True] * 4


def test_rope_in_place_equals_new_tensor():
    g = torch.Generator().manual_seed(1)
    grid = (3, 4, 5)
    x = torch.randn(60, 2, 16, generator=g).to(torch.bfloat16)
    freqs = rope_freqs(16)
    want = rope_apply(x, grid, freqs, torch.bfloat16)
    y = x.clone()
    assert rope_apply(y, grid, freqs, torch.bfloat16, out=y) is y and torch.equal(y, want)
    with pytest.raises(ValueError, match="rope_apply out"):
        rope_apply(x, grid, freqs, torch.float32, out=x.clone())


def test_lean_with_block_swap_and_lora(tmp_path):
    from helpers import SWAP_CFG, load_nf4, lora_for, swap_run
    from lingbot_world.loaders import synthetic
    from lingbot_world.wan.block_swap import BlockSwapper
    from lingbot_world.wan.lora import attach_lora

    nf4 = synthetic.write_nf4_expert(tmp_path / "nf4", SWAP_CFG, seed=3, mode="quantize")
    model = load_nf4(nf4)
    plain = swap_run(model)
    attach_lora(model, lora_for(model))
    want = swap_run(model)
    assert (want - plain).abs().max() > 1e-3  # the LoRA matters
    model.lean_activations, model.lean_chunk = True, 5
    assert torch.equal(swap_run(model), want)  # the side paths are added chunk by chunk
    swapper = BlockSwapper(model, 3)
    assert torch.equal(swap_run(model), want) and not swapper._live
    swapper.unpin()


def test_compiled_blocks_and_lean_are_refused_together():
    with pytest.raises(ValueError, match="lean_activations: .*compile"):
        SpeedOptions(compile=True, lean_activations=True)
    assert SpeedOptions(compile=True).lean is False  # 'auto' stays allowed (never picked under compile)
    for bad in ("on", 1, None):
        with pytest.raises(ValueError, match="lean_activations must be"):
            SpeedOptions(lean_activations=bad)
    model = tiny(torch.bfloat16)
    model.lean_activations, model.block_runner = True, lambda block, *args: block(*args)
    with pytest.raises(ValueError, match="lean_activations: the lean blocks do not run compiled"):
        forward(model)
    model.block_runner, model.lean_chunk = None, 0
    with pytest.raises(ValueError, match="lean_chunk"):
        forward(model)


def test_pipeline_runs_lean_only_when_asked_and_restores_the_expert():
    model = init_random_(WanModel.from_config(tiny_config("cam")), seed=1)
    g = torch.Generator().manual_seed(0)
    noise, y = torch.randn(16, 2, 4, 6, generator=g), torch.randn(20, 2, 4, 6, generator=g)
    ctx, null = torch.randn(7, 32, generator=g), torch.randn(5, 32, generator=g)
    cam = torch.randn(1, 384, 2, 4, 6, generator=g)
    states = []
    model.register_forward_pre_hook(lambda m, args: states.append(m.lean_activations))

    def run(speed):
        states.clear()
        return pipeline.denoise(
            lambda which: model, noise, y, ctx, null, cam, SampleConfig(sample_steps=3), speed=speed
        )

    want = run(SpeedOptions())  # 'auto' no planner resolved: the normal blocks
    assert set(states) == {False}
    model.lean_chunk = 7
    got = run(SpeedOptions(lean_activations=True))
    assert set(states) == {True} and model.lean_activations is False
    assert torch.equal(got, want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lean_under_sequence_parallel(tmp_path):
    expected = worker.forward(worker.tiny_model())
    mp.spawn(worker.dit_rank, args=(2, _free_port(), str(tmp_path), True), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32 compute: GEMM rounding


# --- planner, request, CLI, node -----------------------------------------------------------------------


def test_lean_term_counts_the_full_length_tensors():
    lean, normal = memplan.lean_activation_vram(75_600, A14B), memplan.activation_vram(75_600, A14B)
    assert lean < normal / 2
    # per token: fp32 residual + bf16 q/k/v + attention output + camera tokens = 14 bytes per channel (past
    # ~82k tokens, where the attention output outweighs one RoPE chunk's transient), plus the measured fit
    tokens = 200_000
    fit = tokens * memplan.LEAN_FIT_PER_TOKEN
    lean = memplan.lean_activation_vram(tokens, A14B)
    grow = memplan.lean_activation_vram(2 * tokens, A14B) - lean
    assert grow == tokens * A14B.dim * 14 + fit
    plain = DiTConfig(**{**vars(A14B), "control_type": None})
    assert memplan.lean_activation_vram(2 * tokens, plain) - memplan.lean_activation_vram(tokens, plain) == (
        tokens * A14B.dim * 12 + fit
    )
    assert memplan.lean_activation_vram(tokens, A14B, ranks=2) < lean


def planner(h, w, frames, **kw):
    size = i2v.latent_size(h, w, h * w)
    request = memplan.MemoryRequest({"high": 9_740_000_000, "low": 9_740_000_000}, t5_device="cpu", **kw)
    return memplan.Planner(A14B, size, frames, request, (h, w), h * w)


def test_auto_picks_lean_only_when_the_normal_forward_does_not_fit(monkeypatch):
    monkeypatch.setattr(memplan, "AUTO_HEADROOM", 0.0)  # the decision order; the headroom is tested below
    p = planner(480, 832, 81, lean_activations="auto")
    normal = planner(480, 832, 81).plan(None).phase("denoise_high").vram
    lean = planner(480, 832, 81, lean_activations=True).plan(None).phase("denoise_high").vram
    assert lean < normal
    assert not p.plan(None).lean_activations  # no budget known: today's blocks
    assert not p.plan(normal).lean_activations  # fits as it is
    tight = p.plan(normal - 1)
    assert tight.lean_activations and tight.phase("denoise_high").vram == lean and "lean" in tight.table()
    # before swapping: with swap 'auto', lean first; swap only once lean alone does not fit
    both = planner(480, 832, 81, lean_activations="auto", swap_blocks="auto")
    assert both.plan(normal - 1).swap_blocks == 0 and both.plan(normal - 1).lean_activations
    assert both.plan(lean - 1).swap_blocks > 0 and both.plan(lean - 1).lean_activations
    assert not both.plan(normal).lean_activations and both.plan(normal).swap_blocks == 0
    # compiled blocks do not run lean: 'auto' swaps instead
    compiled = planner(480, 832, 81, lean_activations="auto", swap_blocks="auto", compile=True)
    tight = compiled.plan(None).phase("denoise_high").vram - 1
    assert not compiled.plan(tight).lean_activations and compiled.plan(tight).swap_blocks > 0


def test_auto_keeps_headroom_below_the_budget():
    """'auto' packs the denoise into the budget less AUTO_HEADROOM: a budget the plan just fills without it
    gets lean (or more swap) with it."""
    exact = planner(480, 832, 81).plan(None).phase("denoise_high").vram
    auto = planner(480, 832, 81, lean_activations="auto", swap_blocks="auto").plan(exact)
    assert auto.lean_activations or auto.swap_blocks > 0
    assert auto.phase("denoise_high").vram <= exact * (1 - memplan.AUTO_HEADROOM)
    roomy = planner(480, 832, 81, lean_activations="auto", swap_blocks="auto").plan(int(exact / 0.9))
    assert not roomy.lean_activations and roomy.swap_blocks == 0


def test_plan_request_resolves_auto_onto_the_plans_speed():
    from lingbot_world.session.request import plan_request

    request = memplan.MemoryRequest({"high": 9_740_000_000, "low": 9_740_000_000}, t5_device="cpu")
    args = ((480, 832), A14B, SampleConfig())
    assert plan_request(*args, max_area=480 * 832).speed.lean_activations is False  # no memory check
    cpu = memplan.MemoryCheck(request, "cpu")
    assert plan_request(*args, max_area=480 * 832, memory=cpu).speed.lean_activations is False
    tight = memplan.MemoryCheck(request, "cuda", free_vram=13 * memplan.GIB)
    plan = plan_request(*args, max_area=480 * 832, memory=tight)
    assert plan.speed.lean_activations is True and plan.memory.lean_activations and plan.swap_blocks == 0
    with pytest.raises(memplan.MemoryPlanError, match=r"fit: --lean_activations on, --swap_blocks"):
        plan_request(*args, max_area=480 * 832, memory=tight, speed=SpeedOptions(lean_activations=False))


def test_cli_flag():
    parser = argparse.ArgumentParser()
    cli.add_generate_args(parser)
    base = ["--ckpt_dir", "c", "--image", "i.jpg", "--prompt", "p"]
    assert cli.speed_options(parser.parse_args(base)).lean_activations == "auto"
    assert cli.speed_options(parser.parse_args([*base, "--lean_activations", "on"])).lean_activations is True
    assert (
        cli.speed_options(parser.parse_args([*base, "--lean_activations", "off"])).lean_activations is False
    )
    with pytest.raises(ValueError, match="lean_activations"):
        cli.speed_options(parser.parse_args([*base, "--lean_activations", "on", "--compile"]))
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--lean_activations", "yes"])


def test_speed_node_widget(fake_comfy, tmp_path):
    nodes = fake_comfy(tmp_path, tmp_path)
    spec = nodes.LingBotSpeed.INPUT_TYPES()
    assert "lean_activations" not in spec["required"]  # optional: saved workflows and prompts still load
    choices, opts = spec["optional"]["lean_activations"]
    assert choices == ["auto", "on", "off"] and opts["default"] == "auto"
    node = nodes.LingBotSpeed()
    args = ("sdpa", False, "none", 0.05, 7, 1)
    assert node.options(*args)[0].lean_activations == "auto"
    assert node.options(*args, lean_activations="on")[0].lean_activations is True
    assert node.options(*args, lean_activations="off")[0].lean_activations is False
    with pytest.raises(ValueError, match="lean_activations"):
        node.options(*args, lean_activations="maybe")
    with pytest.raises(ValueError, match="lean_activations"):
        node.options("sdpa", True, "none", 0.05, 7, 1, lean_activations="on")
    assert nodes.sampler.PLAN_NAMES["lean_activations"]
    # camera_cache, then fp8_accumulation: optional, after fp8_linears (saved workflows keep their widget order);
    # camera_cache is the chunked nodes' (the base-cam sampler refuses on, before any work)
    assert list(spec["optional"])[-2:] == ["camera_cache", "fp8_accumulation"]
    assert spec["optional"]["camera_cache"][0] == [
        "auto",
        "on",
        "off",
    ]
    assert node.options(*args)[0].camera_cache == "auto"
    assert node.options(*args, camera_cache="on")[0].camera_cache is True
    with pytest.raises(ValueError, match="camera_cache"):
        node.options(*args, camera_cache="maybe")
    with pytest.raises(ValueError, match="speed camera_cache: on keeps a chunk's camera injections"):
        nodes.speed.check_base_cam_speed(node.options(*args, camera_cache="on")[0], "cpu")
    nodes.speed.check_base_cam_speed(node.options(*args, camera_cache="off")[0], "cpu")
