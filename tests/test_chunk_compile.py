"""The chunk loop without host syncs (wan/fast.py): the cache placed once per chunk, the schedule looked up once
per session, and the compiled chunk loop (`FastConfig.compile`): it traces once the window is full, without
graph breaks, with two graphs for every block and chunk after, and equals the eager loop."""

import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders import synthetic as S
from lingbot_world.session import chunked
from lingbot_world.wan import speed
from lingbot_world.wan.config import CHUNKED_KINDS
from lingbot_world.wan.dit import WanModel, init_random_
from lingbot_world.wan.fast import FastConfig, FastSession, generate_fast

LAT = (15, 4, 6)  # 5 chunks of 3; window 7 with a 1-frame sink: chunk 2 is the first that evicts
WINDOW = dict(local_attn_size=7, sink_size=1)


def inputs():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(20, *LAT, generator=g),
        torch.randn(5, 32, generator=g),
        torch.randn(1, 384, *LAT, generator=g),
    )


def model():
    return init_random_(WanModel.from_config(S.tiny_config("cam", num_layers=3)), seed=1).eval()


def test_cache_is_placed_once_per_chunk_and_the_schedule_once_per_session(monkeypatch):
    y, ctx, cam = inputs()
    s = FastSession(model(), ctx, y, LAT, FastConfig(**WINDOW), "cpu")
    calls = []
    begin = s._cache.begin
    monkeypatch.setattr(s._cache, "begin", lambda *a: calls.append(a) or begin(*a))
    monkeypatch.setattr(s, "_sigma_noise", None)  # looked up at construction, never in the loop
    monkeypatch.setattr(s, "_sigma_x0", None)
    for k in range(3):
        s.next_chunk(cam[:, :, 3 * k : 3 * k + 3])
    n = 3 * s.frame_seqlen
    assert calls == [(0, n), (n, n), (2 * n, n)]
    assert s._cache.rolled and s._cache.span == (
        4 * s.frame_seqlen,
        7 * s.frame_seqlen,
    )  # the newest 3 of 7 frames


def test_compiled_chunk_loop_traces_once_without_graph_breaks_and_equals_eager(traced_chunk_blocks):
    m = model()
    y, ctx, cam = inputs()
    want = generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW), "cpu")
    s = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    got, graphs_after = [], []
    for k in range(5):
        got.append(s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]))
        graphs_after.append(len(traced_chunk_blocks))
    # eager until the window is full (chunk 2 evicts first); then two graphs (bf16 stream into block 0,
    # fp32 after) serve every block, forward and chunk
    assert graphs_after == [0, 0, 2, 2, 2]
    assert not torch._dynamo.utils.counters["graph_break"]
    got = torch.cat(got, dim=1)
    assert torch.equal(got[:, :6], want[:, :6])  # the eager chunks
    # this backend runs the traced graph as is: RoPE as real pairs instead of complex, the same float64 products
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # a second session reuses the graphs
    generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    assert len(traced_chunk_blocks) == 2


def test_compile_off_takes_no_runner_and_a_window_that_never_fills_runs_eagerly(traced_chunk_blocks):
    m = model()
    y, ctx, cam = inputs()
    assert FastSession(m, ctx, y, LAT, FastConfig(**WINDOW), "cpu")._runner is None
    generate_fast(m, ctx, y, cam, LAT, FastConfig(compile=True), "cpu")  # unbounded: never evicts
    assert traced_chunk_blocks == []


def test_compile_is_refused_with_lean_activations_and_checked():
    m = model()
    y, ctx, _ = inputs()
    m.lean_activations = True
    with pytest.raises(ValueError, match="compile"):
        FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    with pytest.raises(ValueError, match="compile"):
        FastConfig(compile=1).validate()


def test_front_ends_pass_compile_to_the_session_config():
    parser = cli.build_parser()
    for command in ("fast", "play"):
        args = parser.parse_args(
            [command, "--ckpt_dir", "m", "--image", "i.png", "--prompt", "p", "--compile"]
        )
        assert args.compile is True
        assert (
            parser.parse_args([command, "--ckpt_dir", "m", "--image", "i.png", "--prompt", "p"]).compile
            is False
        )
    kind = CHUNKED_KINDS["v2-1.3b"]
    for on in (False, True):
        config, _ = chunked.settings(kind, 30, None, 0, None, None, "bf16", "0", None, compile=on)
        assert config.compile is on


@pytest.mark.slow
def test_real_compile_of_the_chunk_loop_matches_eager(monkeypatch):
    if speed.compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    monkeypatch.delitem(speed._shared_runners, speed.run_chunk_block, raising=False)
    torch._dynamo.reset()
    m = model()
    y, ctx, cam = inputs()
    want = generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW), "cpu")
    got = generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    assert not speed._shared_runners[speed.run_chunk_block].failed
    # bf16 compute: a fused kernel may move values by a few bf16 ulps
    assert torch.allclose(got, want, rtol=0.05, atol=0.05)
    assert (got - want).abs().mean() < 0.01 * want.abs().mean()


def test_set_context_applies_from_the_next_chunk():
    m = model()
    y, ctx, cam = inputs()
    a, b = (FastSession(m, ctx, y, LAT, FastConfig(**WINDOW), "cpu") for _ in range(2))
    assert torch.equal(a.next_chunk(cam[:, :, :3]), b.next_chunk(cam[:, :, :3]))
    b.set_context(ctx + 1)  # the text's keys are made again from the new prompt
    assert not torch.equal(a.next_chunk(cam[:, :, 3:6]), b.next_chunk(cam[:, :, 3:6]))


@pytest.fixture
def decoder_compiles(monkeypatch):
    """Records each fast decoder's levers and each compiled-runner request, running them eagerly (CPU inductor
    takes minutes; the decoder's compile itself is tested in test_vae.py), and keeps the DiT blocks eager."""
    from lingbot_world.wan import vae as V

    asked, made, real = [], [], V.WanVAE.decoder_in

    def decoder_in(self, *args):
        decoder = real(self, *args)
        made.append(decoder.levers)
        return decoder

    monkeypatch.setattr(V, "decoder_runner", lambda device: asked.append(device))
    monkeypatch.setattr(V.WanVAE, "decoder_in", decoder_in)
    monkeypatch.setattr(speed, "chunk_block_runner", lambda device: None)
    return asked, made


def test_fast_compile_compiles_the_fast_decoder(
    fast_ckpt, shipped_example, tmp_path, monkeypatch, decoder_compiles
):
    """`fast --compile --vae_dtype fp16` builds the fast decoder with its levers (compiled blocks, sub-pixel
    upsampling); the fp16 decoder without --compile and the exact decoder with it have none."""
    from helpers import fast_args

    monkeypatch.setenv("LINGBOT_WORLD_CACHE", str(tmp_path / "cache"))
    asked, made = decoder_compiles
    runs = [("fp16", "--compile"), ("fp16",), ("fp32", "--compile")]
    for dtype, *extra in runs:
        out = tmp_path / f"{dtype}{len(extra)}.mp4"
        assert (
            cli.main(
                fast_args(fast_ckpt, shipped_example, out, "--vae_dtype", dtype, "--frame_num", "9", *extra)
            )
            == 0
        )
    assert len(asked) == 1 and len(made) == 2  # fp32 decodes with the VAE's own decoder, no copy
    assert made[0] is not None and len(made[0].spatial) == 3 and made[1] is None


def test_play_compile_compiles_the_fast_decoder(fast_ckpt, shipped_example, decoder_compiles):
    from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
    from lingbot_world.session import play

    asked, made = decoder_compiles
    session = play.PlaySession(
        resolve_fast_dir(fast_ckpt),
        "cpu",
        area=64 * 112,
        t5_mode="inprocess",
        condition_frames=4,
        compile=True,
        vae_dtype="fp16",
    )
    try:
        session.start(cli.load_image(shipped_example / "image.jpg"), "a castle")
        assert session.step() == 9
        # the unseen warm-up's rollout and the played one each build their decoder, both with the levers
        assert len(asked) == len(made) == 2 and all(m.spatial for m in made)
        assert session._decoder.decoder.levers is made[1]
    finally:
        session.close()
