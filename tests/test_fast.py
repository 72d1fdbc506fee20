"""LingBot-World-Fast (wan/fast.py): upstream parity through golden data from upstream's own chunk loop
(tests/golden/fast.safetensors, made by tests/golden/make_golden.py), the KV cache's roll with a sink,
the commit pass, the frame rule, config checks, block swap, the kv_dtype option, the attention backend,
hooks and interrupts."""

import functools
import json
from dataclasses import replace
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from helpers import record_forwards, tiny_fast_inputs, tiny_fast_model
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.stream import load_expert
from lingbot_world.wan import attention as attention_backends
from lingbot_world.wan.block_swap import BlockSwapper
from lingbot_world.wan.dit import BIDIRECTIONAL, WanModel
from lingbot_world.wan.fa3_attention import CachedRows
from lingbot_world.wan.fast import (
    CHUNK_FRAMES,
    FastConfig,
    FastSession,
    SelfKVCache,
    fast_frame_num,
    fast_latent_frames,
    generate_fast,
    kv_cache_bytes_for,
)
from lingbot_world.wan.pipeline import Hooks, Interrupted
from safetensors import safe_open

GOLDEN = Path(__file__).resolve().parent / "golden" / "fast.safetensors"
# Upstream in fp32 vs ours in fp32: only accumulation order differs (max 1.4e-6 measured on values
# of magnitude ~6 when the golden file was made).
TOL = dict(rtol=5e-6, atol=5e-6)


@functools.cache
def golden():
    with safe_open(GOLDEN, "pt") as f:
        return json.loads(f.metadata()["golden"]), {k: f.get_tensor(k) for k in f.keys()}


def golden_model() -> WanModel:
    meta, g = golden()
    model = WanModel(control_type="cam", **meta["config"]).eval()
    weights = {k.removeprefix("weights/"): v.float() for k, v in g.items() if k.startswith("weights/")}
    model.load_state_dict(weights, strict=True)
    model.compute_dtype = torch.float32  # upstream ran in fp32 (its attention too)
    return model


@pytest.mark.parametrize("camera_cache", [False, True], ids=["", "camera_cache"])
@pytest.mark.parametrize("run", ["full", "window"])
def test_matches_upstream_chunk_loop(run, camera_cache):
    meta, g = golden()
    (spec,) = [r for r in meta["runs"] if r["key"] == run]
    lat = (spec["lat_f"], spec["lat_h"], spec["lat_w"])
    config = FastConfig(
        shift=meta["shift"],
        seed=meta["seed"],
        local_attn_size=spec["local_attn_size"],
        sink_size=spec["sink_size"],
        camera_cache=camera_cache,
    )
    session = FastSession(golden_model(), g["context"], g["y"][:, : lat[0]], lat, config, "cpu")
    flows = record_forwards(session)
    cam = g[f"{run}/cam"].float()
    want_latent = g[f"{run}/latent"]
    for k in range(session.num_chunks):
        chunk = session.next_chunk(cam[:, :, k * 3 : k * 3 + 3])
        assert chunk.shape == (16, 3, lat[1], lat[2]) and chunk.dtype == torch.float32
        torch.testing.assert_close(chunk, want_latent[:, k * 3 : k * 3 + 3], **TOL)
    want_flows = g[f"{run}/flows"]
    assert len(flows) == len(want_flows) == 5 * session.num_chunks  # 4 steps + the commit per chunk
    for i, (ours, want) in enumerate(zip(flows, want_flows, strict=True)):
        torch.testing.assert_close(ours, want, **TOL, msg=lambda m, i=i: f"forward {i}: {m}")
    torch.testing.assert_close(session.latent(), want_latent, **TOL)
    assert want_latent.abs().max() > 1  # a real signal
    # the timesteps upstream fed (999, 978, 947, 825 at shift 10, then 0 for the commit)
    assert g[f"{run}/t"][:5].tolist() == [999, 978, 947, 825, 0]


def test_golden_window_run_evicts():
    meta, _ = golden()
    (spec,) = [r for r in meta["runs"] if r["key"] == "window"]
    assert spec["lat_f"] > spec["local_attn_size"] > spec["sink_size"] > 0


def fill(cache, start, n, value_offset=0):
    k = (torch.arange(start, start + n, dtype=torch.float32) + value_offset).view(n, 1, 1)
    return cache.write(0, k, -k, start)


def test_cache_roll_keeps_sink_and_newest():
    # one token per frame: local 6 frames with a 3-frame sink, chunks of 3
    cache = SelfKVCache(1, 6, 1, 1, 3, torch.float32, "cpu")
    for c in range(4):
        k, v = fill(cache, 3 * c, 3)
        assert torch.equal(v, -k)
    assert cache.k[0].flatten().tolist() == [0, 1, 2, 9, 10, 11]
    assert k.flatten().tolist() == [0, 1, 2, 9, 10, 11]
    # a window that keeps part of the rolled past: local 7, sink 3
    cache = SelfKVCache(1, 7, 1, 1, 3, torch.float32, "cpu")
    seen = []
    for c in range(4):
        fill(cache, 3 * c, 3)
        # the next forward of the same chunk (the next step) overwrites its own slots only
        k, _ = fill(cache, 3 * c, 3, value_offset=0.5)
        seen.append(k.flatten().tolist())
    assert seen[0] == [0.5, 1.5, 2.5]
    assert seen[1] == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    assert seen[2] == [0.5, 1.5, 2.5, 5.5, 6.5, 7.5, 8.5]
    assert seen[3] == [0.5, 1.5, 2.5, 8.5, 9.5, 10.5, 11.5]
    # unbounded: nothing moves, queries read only the written part
    cache = SelfKVCache(1, 9, 1, 1, 0, torch.float32, "cpu")
    k, _ = fill(cache, 0, 3)
    assert k.shape[0] == 3


@pytest.mark.parametrize("size,sink", [(6, 3), (7, 3), (8, 2), (9, 0)])
def test_a_cache_aligned_right_reads_the_same_rows_with_the_chunk_in_its_last_slots(size, sink):
    """`SelfKVCache(right=True)` (FlashAttention-3, compiled): the rows each forward's queries read are the left
    cache's, in the same order, chunk after chunk, growing, rolling and re-placed for a chunk's next forward; the
    chunk's slots are always the last 3 and the rows before `start` are zeros."""
    left = SelfKVCache(1, size, 1, 1, sink, torch.float32, "cpu")
    right = SelfKVCache(1, size, 1, 1, sink, torch.float32, "cpu", right=True)
    assert left.start is None and right.start.dtype == torch.int32
    for c in range(6):
        for step in range(2):  # the chunk's next forward: the same placement, its own slots overwritten
            want, _ = fill(left, 3 * c, 3, value_offset=step / 2)
            got, got_v = fill(right, 3 * c, 3, value_offset=step / 2)
            assert isinstance(got, CachedRows) and got.full is right.k[0] and got.start is right.start
            assert torch.equal(got.rows(), want) and torch.equal(got_v.rows(), -want), (c, step)
            assert right.span == (size - 3, size) and int(right.start[0]) == size - len(want)
            assert not right.k[0][: size - len(want)].any()
            assert right.rolled == left.rolled and right.local_end == left.local_end


def test_a_cache_offers_the_q_k_kernel_its_slots_for_keys_it_stores_as_they_are():
    """An e4m3 K/V cache, or one of the keys' own dtype (and the block's views of it), offers the q/k kernel the
    chunk's slots to write its keys into (`Bidirectional.key_slot`: the kernel's codes are e4m3's at scale 1, as the
    cache stores them); an e5m2 cache of bf16 keys, or a forward of other rows than the chunk's, gets none. Keys
    given as None are left as the kernel wrote them; values, and keys given, are still clamped to 448 and cast."""
    from lingbot_world.wan.fast import ChunkCausal, LayerKeys

    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    for dtype, offers in ((bf16, True), (torch.float8_e5m2, False), (e4m3, True)):
        cache = SelfKVCache(1, 8, 2, 8, 0, dtype, "cpu")
        cache.begin(0, 3)
        cache.begin(3, 4)
        views = (ChunkCausal(cache, 1), LayerKeys(cache, cache.k[0], cache.v[0], None))
        for view in views:
            slot = view.key_slot(0, 4, bf16)
            assert (slot is not None) == offers, dtype
            if offers:  # the layer's cache itself, and the chunk's first row
                assert slot.cache is cache.k[0] and slot.start == 3
            assert view.key_slot(0, 3, bf16) is None and BIDIRECTIONAL.key_slot(0, 4, bf16) is None
    g = torch.Generator().manual_seed(0)
    codes = (torch.randn(4, 2, 8, generator=g) * 100).to(e4m3)
    values = torch.randn(4, 2, 8, generator=g).bfloat16() * 1000
    kv = ChunkCausal(cache, 1)
    slot = kv.key_slot(0, 4, bf16)
    slot.cache[slot.start : slot.start + 4] = codes  # as the kernel writes them
    k, v = kv.self_kv(0, None, values)
    assert torch.equal(k[3:7].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(v[3:7].view(torch.uint8), values.float().clamp(-448, 448).to(e4m3).view(torch.uint8))
    k, _ = kv.self_kv(0, values, values)
    assert torch.equal(k[3:7].view(torch.uint8), v[3:7].view(torch.uint8))
    with pytest.raises(ValueError, match="placed first"):  # a slot is only the placed chunk's
        cache.write(0, None, values, start=7)


def test_commit_pass_changes_the_next_chunk():
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    outs = []
    for skip in (False, True):
        s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(), "cpu")
        s._skip_commit = skip
        outs.append([s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]) for k in range(2)])
    assert torch.equal(outs[0][0], outs[1][0])  # chunk 0 does not see its own commit
    assert (outs[0][1] - outs[1][1]).abs().max() > 1e-3


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_a_keys_only_forward_writes_the_whole_forwards_keys(kv_dtype):
    """`keys_only` (the compiled loop's commit pass): the last block makes its keys and values alone and nothing
    after it runs (no attention, FFN or head); every layer's cache equals the whole forward's bit for bit, in the
    compute dtype and in an e4m3 cache. A bidirectional forward, which keeps no keys, refuses it."""
    from lingbot_world.wan.dit import WanAttentionBlock, WanSelfAttention

    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    latent = torch.randn(16, 3, 4, 6, generator=torch.Generator().manual_seed(3))
    tokens = model.embed_camera(cam[:, :, 3:6], model.compute_dtype)
    kept, calls = [], []
    ffn, attend, head = WanAttentionBlock.feed_forward, WanSelfAttention.attend, type(model.head).forward
    for keys_only in (False, True):
        s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(kv_dtype=kv_dtype), "cpu")
        s.next_chunk(cam[:, :, :3])  # chunk 0 made and committed, the text's keys kept
        n = 3 * s.frame_seqlen
        s._cache.begin(n, n)
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(WanAttentionBlock, "feed_forward", lambda *a: calls.append("ffn") or ffn(*a))
            mp.setattr(WanSelfAttention, "attend", lambda *a, **k: calls.append("attend") or attend(*a, **k))
            mp.setattr(type(model.head), "forward", lambda *a: calls.append("head") or head(*a))
            out = model.forward_tokens(
                latent, s._y[1], s._t[-1], None, tokens, start_frame=3, kv=s._kv, keys_only=keys_only
            )
        kept.append((out, sorted(calls), [t.clone() for t in s._cache.k + s._cache.v]))
    (whole, whole_calls, want), (trimmed, trimmed_calls, got) = kept
    blocks = len(model.blocks)
    assert whole.shape == latent.shape and trimmed is None
    assert whole_calls == ["attend"] * blocks + ["ffn"] * blocks + ["head"]  # the self-attention's
    assert trimmed_calls == ["attend"] * (blocks - 1) + ["ffn"] * (blocks - 1)
    assert got[0].dtype == (kv_dtype or model.compute_dtype)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, want, strict=True))
    assert got[blocks - 1][n : 2 * n].float().abs().max() > 0  # the last block's chunk keys were written
    with pytest.raises(ValueError, match="keys_only: a forward run for its keys needs a chunk-causal kv"):
        model.forward_tokens(latent, s._y[1], s._t[-1], model.embed_text(ctx), tokens, keys_only=True)


def test_chunks_run_the_models_one_forward():
    """The session has no block of its own: its first forward (empty cache) is the bidirectional forward of
    the chunk, bit for bit."""
    assert not {"_block", "_self_attn", "_cross_attn", "_rope"} & set(vars(FastSession))
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(), "cpu")
    flows = record_forwards(s)
    s.next_chunk(cam[:, :, :3])
    noise = torch.randn(16, 9, 4, 6, generator=torch.Generator().manual_seed(FastConfig().seed))[:, :3]
    with torch.no_grad():
        want = model(noise, s.timesteps[0].reshape(1), ctx, y=y[:, :3], cam=cam[:, :, :3])
    assert torch.equal(flows[0], want)


def test_camera_cache_is_bit_identical_and_made_once_per_chunk(monkeypatch):
    """FastConfig.camera_cache: each block's camera injection made once per chunk (not in each of its 5 forwards)
    and handed to them; the chunks equal the loop without it bit for bit, with and without a window rolling."""
    from lingbot_world.wan.dit import WanAttentionBlock

    model = tiny_fast_model()  # bf16 compute
    y, ctx, cam = tiny_fast_inputs()
    calls = []
    real = WanAttentionBlock.camera
    monkeypatch.setattr(WanAttentionBlock, "camera", lambda self, *a: calls.append(1) or real(self, *a))
    for window in (FastConfig(), FastConfig(local_attn_size=6, sink_size=3)):
        calls.clear()
        want = generate_fast(model, ctx, y, cam, (9, 4, 6), window, "cpu")
        assert len(calls) == 3 * 5 * len(model.blocks)  # 3 chunks of 4 steps + the commit
        calls.clear()
        got = generate_fast(model, ctx, y, cam, (9, 4, 6), replace(window, camera_cache=True), "cpu")
        assert len(calls) == 3 * len(model.blocks)
        assert torch.equal(got, want)
    # 'auto' that no planner decided runs as off; no camera: nothing kept
    s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(camera_cache="auto"), "cpu")
    s.next_chunk(cam[:, :, :3])
    assert s._cams is None
    s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(camera_cache=True), "cpu")
    s.next_chunk(cam[:, :, :3])
    kept = [t.data_ptr() for pair in s._cams for t in pair]
    s.next_chunk(cam[:, :, 3:6])  # the same buffers, overwritten (a recorded CUDA graph reads them)
    assert [t.data_ptr() for pair in s._kv.cams for t in pair] == kept
    calls.clear()
    s.next_chunk(None)  # no camera: nothing kept, nothing injected
    assert s._kv.cams is None and not calls


def test_camera_cache_is_refused_with_swapped_or_lean_blocks():
    model = tiny_fast_model()
    y, ctx, _ = tiny_fast_inputs()
    model.lean_activations = True
    try:
        with pytest.raises(ValueError, match="camera_cache: .* lean_activations"):
            FastSession(model, ctx, y, (9, 4, 6), FastConfig(camera_cache=True), "cpu")
        FastSession(model, ctx, y, (9, 4, 6), FastConfig(camera_cache="auto"), "cpu")  # runs as off
    finally:
        model.lean_activations = False
    model.block_swap = object()
    try:
        with pytest.raises(ValueError, match="camera_cache: .* swap_blocks"):
            FastSession(model, ctx, y, (9, 4, 6), FastConfig(camera_cache=True), "cpu")
    finally:
        model.block_swap = None


def test_lean_activations_run_the_chunks_too():
    model = tiny_fast_model()  # bf16 compute: the lean blocks equal the normal ones bit for bit on the CPU
    y, ctx, cam = tiny_fast_inputs()
    fast = FastConfig(local_attn_size=6, sink_size=3)
    want = generate_fast(model, ctx, y, cam, (9, 4, 6), fast, "cpu")
    model.lean_activations, model.lean_chunk = True, 7
    try:
        got = generate_fast(model, ctx, y, cam, (9, 4, 6), fast, "cpu")
    finally:
        model.lean_activations = False
    assert torch.equal(got, want)


def test_generate_fast_is_the_session_loop_and_windows_matter():
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs(lat=(12, 4, 6))
    full = generate_fast(model, ctx, y, cam, (12, 4, 6), FastConfig(), "cpu")
    s = FastSession(model, ctx, y, (12, 4, 6), FastConfig(), "cpu")
    for k in range(4):
        s.next_chunk(cam[:, :, 3 * k : 3 * k + 3])
    assert torch.equal(s.latent(), full)
    win = generate_fast(model, ctx, y, cam, (12, 4, 6), FastConfig(local_attn_size=6, sink_size=3), "cpu")
    assert torch.equal(win[:, :6], full[:, :6])  # identical until the cache rolls
    assert (win[:, 6:] - full[:, 6:]).abs().max() > 1e-3
    # a window at least as long as the clip never evicts
    same = generate_fast(model, ctx, y, cam, (12, 4, 6), FastConfig(local_attn_size=12, sink_size=3), "cpu")
    assert torch.equal(same, full)


@pytest.mark.parametrize(
    ("frame_num", "lat_f", "frames"),
    [(81, 21, 81), (161, 39, 153), (201, 51, 201), (9, 3, 9), (12, 3, 9), (33, 9, 33)],
)
def test_frame_rule(frame_num, lat_f, frames):
    assert fast_latent_frames(frame_num) == lat_f and lat_f % CHUNK_FRAMES == 0
    assert fast_frame_num(frame_num) == frames


@pytest.mark.parametrize("bad", [8, 1, 0, -5, 2.5, True])
def test_frame_rule_refuses_short_or_bad(bad):
    with pytest.raises(ValueError, match="frame_num"):
        fast_latent_frames(bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shift", 0),
        ("shift", float("nan")),
        ("timestep_index", ()),
        ("timestep_index", (0, 1000)),
        ("timestep_index", (0.5,)),
        ("seed", -1),
        ("sink_size", -1),
        ("local_attn_size", 0),
        ("local_attn_size", -2),
        ("kv_dtype", torch.int8),
        ("kv_dtype", "fp8"),
        ("camera_cache", "on"),
        ("camera_cache", None),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FastConfig(**{field: value}).validate()


def test_window_must_hold_sink_and_a_chunk():
    FastConfig(local_attn_size=6, sink_size=3).validate()
    with pytest.raises(ValueError, match="local_attn_size"):
        FastConfig(local_attn_size=5, sink_size=3).validate()


def test_bad_inputs_are_refused():
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    with pytest.raises(ValueError, match="lat_shape"):
        FastSession(model, ctx, y, (8, 4, 6), FastConfig(), "cpu")
    with pytest.raises(ValueError, match="y: expected"):
        FastSession(model, ctx, y[:, :6], (9, 4, 6), FastConfig(), "cpu")
    with pytest.raises(ValueError, match="context"):
        FastSession(model, ctx[0], y, (9, 4, 6), FastConfig(), "cpu")
    s = FastSession(model, ctx, y, (9, 4, 6), FastConfig(), "cpu")
    with pytest.raises(ValueError, match="cam: expected"):
        s.next_chunk(cam)  # the whole clip instead of the chunk's slice
    with pytest.raises(ValueError, match="cam: expected"):
        generate_fast(model, ctx, y, cam[:, :, :6], (9, 4, 6), FastConfig(), "cpu")


def load_nf4(path):
    model = load_expert(path, "cpu")
    for m in model.modules():  # bnb's portable CPU kernel, as tests/test_block_swap.py
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def test_block_swap_is_bit_identical(tmp_path):
    cfg = S.tiny_config(num_layers=4)
    path = S.write_nf4_expert(tmp_path / "nf4", cfg, seed=3, mode="quantize")
    y, ctx, cam = tiny_fast_inputs(text_dim=cfg.text_dim)
    fast = FastConfig(local_attn_size=6, sink_size=3)
    model = load_nf4(path)
    want = generate_fast(model, ctx, y, cam, (9, 4, 6), fast, "cpu")
    swapper = BlockSwapper(model, 3)
    got = generate_fast(model, ctx, y, cam, (9, 4, 6), fast, "cpu")
    assert torch.equal(got, want)
    assert not swapper._live  # nothing left on the device
    swapper.close()


def test_kv_dtype_fp8_stores_less_and_deviates_slightly():
    model = tiny_fast_model()  # bf16 compute
    y, ctx, cam = tiny_fast_inputs()
    base = FastSession(model, ctx, y, (9, 4, 6), FastConfig(), "cpu")
    small = FastSession(model, ctx, y, (9, 4, 6), FastConfig(kv_dtype=torch.float8_e4m3fn), "cpu")
    assert base._cache.k[0].dtype == torch.bfloat16 and small._cache.k[0].dtype == torch.float8_e4m3fn
    assert small._cache.nbytes() * 2 == base._cache.nbytes()
    a = torch.cat([base.next_chunk(cam[:, :, 3 * k : 3 * k + 3]) for k in range(3)], dim=1)
    b = torch.cat([small.next_chunk(cam[:, :, 3 * k : 3 * k + 3]) for k in range(3)], dim=1)
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < 0.1, rel


def test_kv_cache_bytes_planner_matches_session():
    model = tiny_fast_model()
    cfg = model.config
    y, ctx, cam = tiny_fast_inputs(lat=(12, 4, 6))
    for fast in (
        FastConfig(),
        FastConfig(local_attn_size=6, sink_size=3),
        FastConfig(kv_dtype=torch.float8_e5m2),
        FastConfig(camera_cache=True),
    ):
        s = FastSession(model, ctx, y, (12, 4, 6), fast, "cpu")
        s.next_chunk(cam[:, :, :3])  # the cross-attention cache exists from the first forward on
        assert s.kv_cache_bytes() == kv_cache_bytes_for(cfg, (12, 4, 6), fast) > 0
        s.close()
        assert s.kv_cache_bytes() == 0
    tokens = 2 * 3  # per frame at 4x6 latent
    per_frame = 2 * cfg.num_layers * cfg.dim * 2 * tokens  # K and V, bf16
    cross = 2 * cfg.num_layers * cfg.dim * 2 * cfg.text_len
    assert kv_cache_bytes_for(cfg, (12, 4, 6), FastConfig()) == 12 * per_frame + cross
    assert (
        kv_cache_bytes_for(cfg, (12, 4, 6), FastConfig(local_attn_size=6, sink_size=3))
        == 6 * per_frame + cross
    )
    cams = 2 * cfg.num_layers * cfg.dim * 2 * 3 * tokens  # scale and shift of a chunk's 3 frames, bf16
    assert kv_cache_bytes_for(cfg, (12, 4, 6), FastConfig(camera_cache=True)) == 12 * per_frame + cross + cams


def test_attention_backend_is_used():
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    calls = []

    def counting(q, k, v, dtype):
        calls.append(k.shape[0])
        return attention_backends.sdpa(q, k, v, dtype)

    attention_backends.register("counting_fast_test", counting)
    want = generate_fast(model, ctx, y, cam, (9, 4, 6), FastConfig(), "cpu")
    got = generate_fast(model, ctx, y, cam, (9, 4, 6), FastConfig(attention="counting_fast_test"), "cpu")
    assert torch.equal(got, want)
    layers = len(model.blocks)
    assert len(calls) == 3 * 5 * layers * 2  # self + cross per block, 5 forwards per chunk
    self_lens = sorted(set(calls) - {model.text_len})
    assert self_lens == [18, 36, 54]  # the cache grows by a chunk (3 frames x 6 tokens) per chunk


def test_hooks_progress_and_interrupt_frees_caches():
    model = tiny_fast_model()
    y, ctx, cam = tiny_fast_inputs()
    seen = []
    s = FastSession(
        model, ctx, y, (9, 4, 6), FastConfig(), "cpu", Hooks(progress=lambda i, n, x: seen.append((i, n, x)))
    )
    first = s.next_chunk(cam[:, :, :3])
    assert [(i, n) for i, n, _ in seen] == [(1, 3)] and seen[0][2] is first and s.done == 1
    checks = []

    def interrupted():
        checks.append(1)
        return len(checks) > 2

    s.hooks = Hooks(interrupted=interrupted)
    assert s.kv_cache_bytes() > 0
    with pytest.raises(Interrupted):
        s.next_chunk(cam[:, :, 3:6])
    assert len(checks) == 3  # checked before each forward
    assert s.kv_cache_bytes() == 0 and s.done == 1
    assert torch.equal(s.latent(), first)
    with pytest.raises(RuntimeError, match="closed"):
        s.next_chunk(cam[:, :, 3:6])


def test_rows_move_towards_the_start_in_place_as_a_copy_through_a_clone_would():
    from lingbot_world.wan.fast import move_rows

    for rows, src, dst in ((8, 10, 6), (12, 6, 2), (3, 9, 0), (5, 6, 5), (4, 4, 0)):
        t = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
        want = t.clone()
        want[dst : dst + rows] = t[src : src + rows].clone()
        ptr = t.data_ptr()
        move_rows(t, src, dst, rows)
        assert torch.equal(t, want) and t.data_ptr() == ptr, (rows, src, dst)
    with pytest.raises(ValueError, match="towards the start"):
        move_rows(torch.zeros(4, 1), 0, 2, 1)
