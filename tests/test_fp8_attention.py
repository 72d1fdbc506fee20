"""fp8 attention (`--attention fp8`): the quantization, the kernel's arithmetic (`reference`, what the op runs off
CUDA) against exact attention, compile tracing through the op, the chunk loop taking the backend from its
config, and the refusal where cuDNN's fp8 attention cannot run (here: the CPU), in the CLI and the nodes."""

from dataclasses import replace

import pytest
import torch
from helpers import (
    NODE_SIZE,
    args_for,
    expect_clear_error,
    fast_args,
    fast_sample,
    node_inputs,
    tiny_fast_inputs,
    tiny_fast_model,
)
from lingbot_world.loaders.fast_checkpoint import FAST_DIR
from lingbot_world.wan import attention, fp8_attention
from lingbot_world.wan.fast import FastConfig, FastSession
from lingbot_world.wan.speed import SpeedOptions


def qkv(lq=40, lk=72, heads=3, d=32, seed=0, peak=2.0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(lq, heads, d, generator=g) * peak,
        torch.randn(lk, heads, d, generator=g),
        torch.randn(lk, heads, d, generator=g),
    )


def exact(q, k, v):
    return attention.sdpa(q, k, v, torch.float32)


def test_quantize_one_scale_per_tensor():
    t = torch.randn(50, 2, 16) * 7
    codes, scale = fp8_attention.quantize(t)
    assert codes.dtype == torch.float8_e4m3fn and codes.is_contiguous() and scale.shape == (1,)
    assert codes.float().abs().max() == fp8_attention.FP8_MAX  # the largest magnitude maps to e4m3's largest
    back = codes.float() * scale
    assert ((back - t).abs() <= t.abs() * 2**-4 + scale * 2**-9).all()  # 3 mantissa bits (subnormals: 2^-9)
    zero_codes, zero_scale = fp8_attention.quantize(torch.zeros(4, 1, 16))
    assert zero_scale.item() > 0 and not zero_codes.float().any()
    stored = t.to(torch.float8_e4m3fn)  # an fp8 K/V cache's keys: their own codes at scale 1
    same, one = fp8_attention.quantize(stored)
    assert same.data_ptr() == stored.data_ptr() and one.tolist() == [1.0]


@pytest.fixture
def fp8_everywhere(monkeypatch):
    """The fp8 backend on every key set (the tiny shapes here are below its SDPA threshold)."""
    monkeypatch.setattr(fp8_attention, "MIN_KEYS", 0)


def test_short_key_sets_stay_exact():
    q, k, v = qkv(lk=fp8_attention.MIN_KEYS - 1)
    assert torch.equal(
        attention.resolve("fp8")(q, k, v, torch.bfloat16), attention.sdpa(q, k, v, torch.bfloat16)
    )
    q, k, v = qkv(lq=4, lk=fp8_attention.MIN_KEYS, heads=1, d=16)
    fp8_out = attention.resolve("fp8")(q, k, v, torch.float32)
    assert torch.equal(fp8_out, fp8_attention.attention(q, k, v, torch.float32))
    assert not torch.equal(fp8_out, exact(q, k, v))


def test_fp8_backend_is_close_to_exact_and_never_saturates(fp8_everywhere):
    q, k, v = qkv()
    want = exact(q, k, v)
    got = attention.resolve("fp8")(q, k, v, torch.float32)
    assert got.shape == want.shape and got.dtype == torch.float32
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-3 < rel < 0.15  # lossy (e4m3 probabilities and output), not wrong
    # the output rides at v's scale: a convex combination of v's rows never exceeds max |v|
    (q8, qs), (k8, ks), (v8, vs) = (fp8_attention.quantize(t) for t in (q, k, v))
    codes = fp8_attention.reference(q8, k8, v8, qs, ks, vs, vs)
    assert codes.float().abs().max() < fp8_attention.FP8_MAX
    # bf16 in and out, fp8 K/V (a cache stored in e4m3) in: the same arithmetic
    half = attention.resolve("fp8")(q.bfloat16(), k.to(torch.float8_e4m3fn), v.bfloat16(), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and ((half.float() - want).norm() / want.norm()) < 0.15


def test_fp8_cache_values_keep_their_precision_when_small(fp8_everywhere):
    """K/V stored in e4m3 come in at scale 1; the output's scale follows their amax, so small values (near
    e4m3's subnormal range at scale 1) stay as precise as large ones."""
    q, k, v = qkv(lk=512)
    errors = []
    for spread in (1.0, 0.02):
        k8, v8 = k.to(torch.float8_e4m3fn), (v * spread).to(torch.float8_e4m3fn)
        want = exact(q, k8.float(), v8.float())
        got = attention.resolve("fp8")(q, k8, v8, torch.float32)
        errors.append(((got - want).norm() / want.norm()).item())
    assert errors[1] < 1.5 * errors[0] and errors[1] < 0.15, errors


def test_reference_with_a_peaked_softmax_follows_the_top_key(fp8_everywhere):
    q, k, v = qkv(lq=8, lk=64, heads=1, d=16, peak=1.0)
    k[5] = q[0] * 40  # query 0 attends to key 5 almost alone
    got = attention.resolve("fp8")(q, k, v, torch.float32)
    assert torch.allclose(got[0], v[5], rtol=0.08, atol=0.08 * v.abs().max().item())


def test_fp8_op_traces_into_one_graph(fp8_everywhere):
    q, k, v = qkv()
    eager = attention.resolve("fp8")(q, k, v, torch.bfloat16)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with attention.use("fp8"):
        fn = torch.compile(lambda q, k, v: attention.attention(q, k, v, torch.bfloat16), backend=record)
        out = fn(q, k, v)
    assert torch.equal(out, eager)
    assert len(graphs) == 1  # no graph break: the cuDNN call is one opaque op inside the block's graph
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.lingbot.fp8_attention.default in ops or torch.ops.lingbot.fp8_attention in ops


def test_chunk_loop_takes_the_backend_from_its_config(fp8_everywhere, monkeypatch):
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    lat = (9, 4, 6)

    def chunks(config):
        s = FastSession(model, ctx, y, lat, config, "cpu")
        return torch.cat([s.next_chunk(cam[:, :, 3 * i : 3 * i + 3]) for i in range(3)], dim=1)

    want = chunks(FastConfig())
    assert torch.equal(chunks(FastConfig(attention="sdpa")), want)  # the default: the exact loop
    got = chunks(FastConfig(attention="fp8"))
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.3
    assert attention.active() is attention.sdpa  # the session's backend does not leak out of its forwards

    # an fp8 K/V cache: SDPA casts what the cache hands over; fp8 attention takes the stored codes as they are
    kv8 = FastConfig(kv_dtype=torch.float8_e4m3fn)
    exact_kv8 = chunks(kv8)
    assert 0 < ((exact_kv8 - want).norm() / want.norm()) < 0.3
    scales, reference = [], fp8_attention.reference
    monkeypatch.setattr(
        fp8_attention, "reference", lambda q, k, v, *s: scales.append(s) or reference(q, k, v, *s)
    )
    got_kv8 = chunks(replace(kv8, attention="fp8"))
    assert 0 < ((got_kv8 - exact_kv8).norm() / exact_kv8.norm()) < 0.3
    self_calls = [s for s in scales if s[0].numel() == 1 and s[1].item() == 1.0 and s[2].item() == 1.0]
    assert len(self_calls) == 3 * 5 * len(
        model.blocks
    )  # every self-attention read the cache's codes as stored
    with pytest.raises(ValueError, match=r"attention: expected one of .*'fp8'.*got 'fp9'"):
        FastConfig(attention="fp9").validate()


def test_fp8_attention_and_lean_blocks_are_refused_together():
    with pytest.raises(ValueError, match="lean_activations: .*fp8 attention"):
        SpeedOptions(attention="fp8", lean_activations=True)
    assert (
        SpeedOptions(attention="fp8").lean is False
    )  # 'auto' stays allowed (never picked with fp8 attention)


def test_fp8_attention_refused_off_cuda():
    problem = attention.problem("fp8", "cpu")
    assert "CUDA GPU with fp8 tensor cores" in problem and "--attention sdpa" in problem
    assert attention.problem("sdpa", "cpu") is None
    assert "--attention sdpa" in attention.problem("sage", "cpu")  # no sageattention here, and no CUDA
    assert "attention backend must be one of" in attention.problem("flash9", "cpu")


def test_cli_attention_fp8_refused_on_cpu_before_anything_loads(
    nf4_ckpt, fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads
):
    out = tmp_path / "o.mp4"
    for args in (
        args_for(nf4_ckpt, shipped_example / "poses.npy", out, "--attention", "fp8"),
        fast_args(fast_ckpt, shipped_example, out, "--attention", "fp8"),
        ["play", "--ckpt_dir", str(fast_ckpt), "--image", str(shipped_example / "image.jpg")]
        + ["--prompt", "a castle", "--device", "cpu", "--attention", "fp8"],
    ):
        expect_clear_error(
            capsys, args, out, "--attention: attention 'fp8' runs cuDNN's fp8 attention", "--attention sdpa"
        )
        sage = [
            a if a != "fp8" else "sage" for a in args
        ]  # its package is missing here: named before loading
        expect_clear_error(capsys, sage, out, "--attention: attention", "sage", "--attention sdpa")


def test_speed_node_fp8_attention_refused_in_both_samplers(
    nf4_ckpt, fast_ckpt, shipped_example, tmp_path, fake_comfy
):
    nodes = fake_comfy(nf4_ckpt, tmp_path)
    choices, _ = nodes.LingBotSpeed.INPUT_TYPES()["required"]["attention"]
    assert "fp8" in choices
    (speed,) = nodes.LingBotSpeed().options("fp8", False, "none", 0.05, 7, 1)
    assert speed.attention == "fp8"
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    (experts,) = nodes.LingBotExpertsLoader().load("", "", False, 0.0, ckpt_dir=str(nf4_ckpt))
    settings = (*NODE_SIZE, 9, 2, 10.0, 0.947, 4.0, 6.0, 0, "unipc")
    with pytest.raises(ValueError, match="speed attention: attention 'fp8' runs cuDNN.*pick sdpa"):
        nodes.LingBotSampler().sample(experts, vae, image, *settings, camera=camera, text=text, speed=speed)
    nodes = fake_comfy(fast_ckpt, tmp_path)
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    with pytest.raises(ValueError, match="speed attention: attention 'fp8' runs cuDNN"):
        fast_sample(nodes, model, vae, image, text=text, speed=speed)
    # Play takes LingBot Speed too: the same refusal before anything starts, and the base-cam-only options
    assert nodes.LingBotPlay.INPUT_TYPES()["optional"]["speed"][0] == "LINGBOT_SPEED"
    play = ("64*112", 3, "hold", -2, -1)
    with pytest.raises(ValueError, match="speed attention: attention 'fp8' runs cuDNN"):
        nodes.LingBotPlay().play(model, vae, image, *play, text=text, speed=speed)
    (cached,) = nodes.LingBotSpeed().options("sdpa", False, "easycache", 0.05, 7, 1)
    with pytest.raises(
        ValueError,
        match="speed: Play takes attention, compile, fp8_linears, fp8_accumulation and camera_cache",
    ):
        nodes.LingBotPlay().play(model, vae, image, *play, text=text, speed=cached)
    # camera_cache on with the Fast Loader's swapped blocks: one error in the widgets' names, before any work
    text, vae, camera, image = node_inputs(nodes, shipped_example)  # this ComfyUI's handles
    (kept,) = nodes.LingBotSpeed().options("sdpa", False, "none", 0.05, 7, 1, camera_cache="on")
    (swapped,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0, swap_blocks=1)
    refusal = r"^camera_cache on: .* swap_blocks 1 keeps blocks in host RAM; use camera_cache auto or off"
    with pytest.raises(ValueError, match=refusal):
        nodes.LingBotPlay().play(swapped, vae, image, *play, text=text, speed=kept)
    with pytest.raises(ValueError, match=refusal):
        fast_sample(nodes, swapped, vae, image, text=text, speed=kept)
