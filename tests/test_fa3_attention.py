"""FlashAttention-3 (`--attention fa3` / `fa3_fp8`): our adapter around its `flash_attn_interface` (layout,
per-head fp8 scales, an fp8 cache's values as stored, short key sets), checked against a stand-in module that
records every call and computes what FA3 computes from what it is handed; the refusals where FA3 cannot run
(no CUDA here; another card; the package missing), in the CLI and the Speed node; the memory plan's copies."""

import types
from pathlib import Path

import pytest
import torch
from helpers import expect_clear_error, fa3_cache_math, fa3_math, fake_module, fast_args
from lingbot_world import cli
from lingbot_world.wan import attention, fa3_attention, fp8_attention

FP8 = torch.float8_e4m3fn


class RecordingFA3(types.ModuleType):
    """`flash_attn_interface` as our adapter uses it: `flash_attn_func(q, k, v, q_descale=, k_descale=,
    v_descale=)` on [batch, tokens, heads, d]; fp8 inputs are dequantized with their [batch, heads] descales and
    the output is bf16, as FA3 gives it. Records each call's dtypes, shapes and descales."""

    def __init__(self):
        super().__init__("flash_attn_interface")
        self.calls = []

    def flash_attn_func(self, q, k, v, q_descale=None, k_descale=None, v_descale=None):
        self.calls.append(
            {
                "dtypes": (q.dtype, k.dtype, v.dtype),
                "shapes": (q.shape, k.shape, v.shape),
                "descales": (q_descale, k_descale, v_descale),
                "inputs": (q, k, v),
            }
        )
        # (out, softmax_lse), as some builds return it
        return fa3_math(q, k, v, q_descale, k_descale, v_descale), None

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_leftpad=None, num_splits=0, **descales):
        self.calls.append(
            {
                "entry": "kvcache",
                "dtypes": (q.dtype, k_cache.dtype, v_cache.dtype),
                "shapes": (q.shape, k_cache.shape, v_cache.shape),
                "inputs": (q, k_cache, v_cache),
                "descales": tuple(descales.get(f"{t}_descale") for t in "qkv"),
                "leftpad": cache_leftpad,
            }
        )
        return fa3_cache_math(q, k_cache, v_cache, cache_leftpad, num_splits, **descales)


@pytest.fixture
def fa3(monkeypatch):
    module = RecordingFA3()
    fake_module(monkeypatch, "flash_attn_interface", module)
    return module


def qkv(lq=24, lk=fp8_attention.MIN_KEYS, heads=3, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, heads, d, generator=g) for n in (lq, lk, lk))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fa3_hands_its_layout_over_and_returns_ours(fa3):
    q, k, v = qkv()
    out = attention.resolve("fa3")(q, k, v, torch.bfloat16)
    (call,) = fa3.calls
    assert call["shapes"] == ((1, 24, 3, 16), (1, 2048, 3, 16), (1, 2048, 3, 16))
    assert call["dtypes"] == (torch.bfloat16,) * 3 and call["descales"] == (None,) * 3
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, attention.sdpa(q, k, v, torch.bfloat16), atol=1e-2, rtol=1e-2)
    # FA3 has no fp32 kernel: an fp32 model's attention runs in bf16 and comes back in fp32
    out = attention.resolve("fa3")(q, k, v, torch.float32)
    assert fa3.calls[-1]["dtypes"] == (torch.bfloat16,) * 3 and out.dtype == torch.float32
    assert rel(out, attention.sdpa(q, k, v, torch.float32)) < 1e-2


def test_fa3_fp8_scales_each_head_apart(fa3):
    q, k, v = qkv()
    for t in (q, k, v):
        t[:, 1] *= 1e-3  # one quiet head: a scale for the whole tensor would leave its codes subnormal
    out = attention.resolve("fa3_fp8")(q, k, v, torch.bfloat16)
    (call,) = fa3.calls
    assert call["dtypes"] == (FP8,) * 3
    for t, codes, scale in zip((q, k, v), call["inputs"], call["descales"], strict=True):
        assert scale.shape == (1, 3) and scale.dtype == torch.float32
        torch.testing.assert_close(scale[0], t.abs().amax(dim=(0, 2)) / fp8_attention.FP8_MAX)
        assert codes[0].float().abs().amax(dim=(0, 2)).tolist() == [448.0] * 3  # every head uses e4m3's range
    exact = attention.sdpa(q, k, v, torch.float32)
    assert out.dtype == torch.bfloat16
    for head in range(3):  # each head as close as fp8's 3 mantissa bits allow, the quiet ones too
        assert rel(out[:, head], exact[:, head]) < 0.08, head


def test_fa3_fp8_takes_an_fp8_cache_as_stored(fa3):
    """An fp8 cache's e4m3 keys and values go over as they are, at scale 1: without descales (FA3 takes a missing
    one as 1), so no tensor of ones is made per call; the output is the attention of the decoded values."""
    q, k, v = qkv()
    k8, v8 = k.to(FP8), v.to(FP8)
    out = attention.resolve("fa3_fp8")(q, k8, v8, torch.bfloat16)
    (call,) = fa3.calls
    assert (
        call["inputs"][1][0].data_ptr() == k8.data_ptr() and call["inputs"][2][0].data_ptr() == v8.data_ptr()
    )
    assert call["descales"][1] is None and call["descales"][2] is None and call["descales"][0].shape == (1, 3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(0, 1) for t in (q, k8, v8))
    ).transpose(0, 1)
    assert (out.float() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("backend", ["fa3", "fa3_fp8"])
def test_fa3_reads_a_cache_aligned_right_from_its_start_on_the_device(fa3, backend):
    """A K/V cache aligned to its end (`wan.fast.SelfKVCache`'s `right`) goes over whole with its start on the
    device, FA3's cache_leftpad, in one pass (num_splits 1): the same attention as over its rows alone. Another
    backend gets the rows. An fp8 cache's codes go as stored; a bf16 cache's are quantized whole, and the zeros
    before the start leave each head's scale as the rows give it."""
    q, k, v = qkv(lk=fp8_attention.MIN_KEYS + 8)
    pad = 8
    k[:pad], v[:pad] = 0, 0  # rows before the start: never written
    for cache_dtype in (torch.bfloat16, FP8):
        kc, vc = k.to(cache_dtype), v.to(cache_dtype)
        start = torch.tensor([pad], dtype=torch.int32)
        rows = fa3_attention.CachedRows(kc, start), fa3_attention.CachedRows(vc, start)
        with attention.use(backend):
            out = attention.attention(q, *rows, torch.bfloat16)
            want = attention.attention(q, kc[pad:], vc[pad:], torch.bfloat16)
        cached, plain = fa3.calls[-2:]
        assert cached["entry"] == "kvcache" and "entry" not in plain
        assert cached["leftpad"] is start and cached["shapes"][1] == (1, len(k), 3, 16)
        if backend == "fa3_fp8" and cache_dtype == FP8:  # as stored: the cache itself, no descale
            assert cached["inputs"][1][0].data_ptr() == kc.data_ptr() and cached["descales"][1:] == (
                None,
                None,
            )
        for a, b in zip(cached["descales"], plain["descales"], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        torch.testing.assert_close(out, want, atol=1e-2, rtol=0)
        with attention.use("sdpa"):
            got = attention.attention(q, *rows, torch.float32)
        assert torch.equal(got, attention.sdpa(q, kc[pad:], vc[pad:], torch.float32))


def test_fa3_fp8_leaves_short_key_sets_unquantized(fa3):
    q, k, v = qkv(lk=fp8_attention.MIN_KEYS - 1)
    attention.resolve("fa3_fp8")(q, k, v, torch.bfloat16)
    (call,) = fa3.calls
    assert call["dtypes"] == (torch.bfloat16,) * 3 and call["descales"] == (None,) * 3


def test_fa3_refused_where_it_cannot_run(monkeypatch):
    for name in (
        "fa3",
        "fa3_fp8",
    ):  # on the CPU: SDPA is the one fallback (cuDNN's fp8 attention cannot run either)
        problem = attention.problem(name, "cpu")
        assert f"attention '{name}' runs FlashAttention-3's kernels on a Hopper GPU" in problem
        assert "this run is on cpu" in problem and problem.endswith(
            "Instead: use --attention sdpa (PyTorch's kernels, exact)"
        )
    check = fa3_attention._cuda_problem.__wrapped__  # the card checks, without the process-wide cache
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 9))
    fp8_runs = {"cuda:0": None}  # where cuDNN's fp8 attention runs, fa3_fp8 names it as well
    monkeypatch.setattr(fp8_attention, "attention_problem", lambda device: fp8_runs.get(str(device), "no"))
    problem = check("fa3_fp8", 0)
    assert "compute capability 9.0" in problem and "NVIDIA L40S is 8.9" in problem
    assert problem.endswith("Instead: use --attention fp8 (cuDNN's fp8 attention) or sdpa (exact)")
    assert check("fa3", 0).endswith(
        "Instead: use --attention sdpa (PyTorch's kernels, exact)"
    )  # fa3 is exact
    fp8_runs.clear()
    assert check("fa3_fp8", 0).endswith("Instead: use --attention sdpa (PyTorch's kernels, exact)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    fake_module(monkeypatch, "flash_attn_interface", None)  # not installed: import fails
    problem = check("fa3", 0)
    assert "flash_attn_3" in problem and "flash_attn_interface" in problem and "--attention sdpa" in problem
    with pytest.raises(
        RuntimeError, match="flash_attn_3"
    ):  # `use` asks for the package before the first block
        attention.resolve("fa3_fp8")


def test_cli_offers_every_built_in_backend_and_refuses_fa3_on_cpu(
    fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads
):
    assert cli.ATTENTION_CHOICES == attention.BUILT_IN  # the parser's list, written out to keep torch out
    out = tmp_path / "o.mp4"
    for name in ("fa3", "fa3_fp8"):
        args = fast_args(fast_ckpt, shipped_example, out, "--attention", name)
        expect_clear_error(
            capsys, args, out, f"--attention: attention '{name}' runs FlashAttention-3", "sdpa"
        )


def test_speed_node_offers_fa3_and_refuses_it_on_cpu(fast_ckpt, shipped_example, tmp_path, fake_comfy):
    from helpers import fast_sample, node_inputs
    from lingbot_world.loaders.fast_checkpoint import FAST_DIR

    nodes = fake_comfy(fast_ckpt, tmp_path)
    choices, _ = nodes.LingBotSpeed.INPUT_TYPES()["required"]["attention"]
    assert {"fa3", "fa3_fp8"} <= set(choices)
    (speed,) = nodes.LingBotSpeed().options("fa3_fp8", False, "none", 0.05, 7, 1)
    text, vae, _, image = node_inputs(nodes, shipped_example)
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    with pytest.raises(
        ValueError, match="speed attention: attention 'fa3_fp8' runs FlashAttention-3.*pick sdpa"
    ):
        fast_sample(nodes, model, vae, image, text=text, speed=speed)


def test_fa3_fp8_copies_are_planned_as_fp8_attention():
    """fa3_fp8 makes the same e4m3 copies of q, k and v as cuDNN's fp8 attention: the chunk loop's plan and the
    base-cam request count them; fa3 (bf16) makes none."""
    from lingbot_world.session import fast_run
    from lingbot_world.wan.config import CHUNKED_KINDS
    from lingbot_world.wan.fast import FastConfig
    from lingbot_world.wan.speed import SpeedOptions

    kind = CHUNKED_KINDS["v2-1.3b"]
    model = fast_run.ChunkedModel.of_kind(kind)

    def forward(**settings):
        config = FastConfig.for_kind(kind, **settings)
        return fast_run.fast_memory(model, (28, 58, 104), config, None, 0, "auto").work_forward

    assert forward(attention="fa3_fp8") == forward(attention="fp8") > forward(attention="fa3") == forward()
    with pytest.raises(ValueError, match="no room for fp8 attention's quantized"):
        SpeedOptions(attention="fa3_fp8", lean_activations=True)


def test_fa3_fp8_takes_queries_from_the_rotating_norm_as_codes(fa3, monkeypatch):
    """With fa3_fp8 active, a self-attention whose q and k its norm's kernel rotates (`wan.qk_rope`) hands FA3 the
    queries as that kernel's e4m3 codes at each head's weight bound (`qk_rope.head_bound_scale`): no amax pass over
    them. A stand-in computes what the kernel computes (its own accuracy: test_qk_rope). Other backends get q as
    before, and a short key set gets the codes decoded."""
    from lingbot_world.wan import dit, qk_rope

    made = []

    def codes_standin(norm, x, table, heads):
        q = qk_rope.norm_rope(norm, x, table, x.dtype).view(x.shape[0], heads, -1)
        scale = qk_rope.head_bound_scale(norm, heads)
        made.append((q, scale))
        codes = (q.float() / scale[0, :, None]).clamp(-448, 448).to(FP8)
        return codes.flatten(1), scale

    monkeypatch.setattr(qk_rope, "triton_runs_on", lambda t: True)  # as on a GPU
    monkeypatch.setattr(qk_rope, "norm_rope", dit_rope_standin)
    monkeypatch.setattr(qk_rope, "norm_rope_codes", codes_standin)
    heads, d, grid = 3, 32, (2, 4, 4)
    attn = dit.init_random_(dit.WanSelfAttention(heads * d, heads), seed=2).requires_grad_(False)
    attn.norm_q.weight.data[:d] *= 8  # one loud head: its own bound
    g = torch.Generator().manual_seed(0)  # not the global generator: the data must not depend on test order
    x = torch.randn(32, heads * d, generator=g) * 2
    table = dit.rope_table(grid, dit.rope_freqs(d))
    keys = torch.randn(fp8_attention.MIN_KEYS, heads, d, generator=g)

    def run(backend, k=keys):
        with attention.use(backend):
            return attn(x, grid, table, torch.bfloat16, keys=lambda _k, _v: (k, k))

    out = run("fa3_fp8")
    ((q, scale),) = made
    (call,) = fa3.calls
    q8, descale = call["inputs"][0][0], call["descales"][0]
    assert q8.dtype == FP8 and descale is scale and scale.shape == (1, heads)
    bound = attn.norm_q.weight.abs().view(heads, d).amax(1) * (heads * d) ** 0.5 / 448
    torch.testing.assert_close(scale[0], bound)
    assert scale[0, 0] > 4 * scale[0, 1:].max() and q8.float().abs().max() < 448  # no code saturates
    decoded = q8.float() * scale[0, :, None]
    q_error = rel(decoded, q.float())
    assert q_error < 0.04  # e4m3's 3 mantissa bits
    exact = run("fa3")  # bf16 queries, the same rotation
    assert len(made) == 1 and fa3.calls[-1]["dtypes"][0] == torch.bfloat16
    with monkeypatch.context() as patch:
        patch.setattr(attention, "takes_query_codes", lambda: False)
        amax = run("fa3_fp8")  # the queries quantized by their own amax, from bf16
    (amax_codes, *_), (amax_scale, *_) = fa3.calls[-1]["inputs"], fa3.calls[-1]["descales"]
    assert len(made) == 1 and amax_scale is not scale
    # the looser scale loses nothing measurable: e4m3 is floating point, so codes well above its subnormals keep
    # the same relative error; the decoded queries are as near q as the amax scale's (over 40 seeds the ratio
    # was 0.93-1.08). The attention outputs' errors are one draw of that noise through softmax (their ratio
    # spread 0.56-1.57 over the same seeds), so they are only held to a loose bound.
    assert q_error < 1.15 * rel(amax_codes[0].float() * amax_scale[0, :, None], q.float())
    assert rel(out, exact) < 2 * rel(amax, exact) and rel(amax, exact) < 0.2
    run("fa3_fp8", k=keys[:64])  # short keys: bf16 FA3 on the decoded codes
    assert fa3.calls[-1]["dtypes"] == (torch.bfloat16,) * 3 and len(made) == 2
    torch.testing.assert_close(fa3.calls[-1]["inputs"][0][0], decoded.bfloat16())


def dit_rope_standin(norm, x, table, dtype):
    """`qk_rope.norm_rope` in plain torch: the norm, then `rope_apply` with the compiled table."""
    from lingbot_world.wan import dit

    heads = x.shape[1] // (2 * table.shape[2])
    tokens = x.shape[0]
    grid = (1, 1, tokens)
    return dit.rope_apply(norm(x).view(tokens, heads, -1), grid, table, dtype).flatten(1)


@pytest.mark.parametrize("backend", ["fa3", "fa3_fp8"])
def test_the_chunk_floor_times_the_cache_entry_the_compiled_loop_runs(fa3, monkeypatch, backend):
    """`bench_fp8`'s floor for the chunk loops hands FA3 the keys as a whole cache read from row 0 (the compiled
    loop's `CachedRows`), the same attention as the plain call on the same operands."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_fp8

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, n, 16, generator=g) for n in (24, 40, 40))
    plain = bench_fp8._fa3_kernel(bench_fp8.fa3_operands(backend, q, k, v))
    cached = bench_fp8._fa3_kernel(bench_fp8.fa3_operands(backend, q, k, v, cache=True))
    first, second = fa3.calls[-2:]
    assert "entry" not in first and second["entry"] == "kvcache" and second["leftpad"].tolist() == [0]
    assert second["shapes"] == first["shapes"] and cached.shape == plain.shape == (1, 3, 24, 16)
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=0)
