"""The chunk loop without host syncs (wan/fast.py): the cache placed once per chunk, the schedule looked up once
per session, and the compiled chunk loop (`FastConfig.compile`): it traces once the window is full, without
graph breaks, with two graphs for every block and chunk after, and equals the eager loop."""

import dataclasses
import types

import pytest
import torch
from helpers import fa3_cache_math, fa3_math, fake_module
from lingbot_world import cli
from lingbot_world.loaders import synthetic as S
from lingbot_world.session import chunked
from lingbot_world.wan import attention, fa3_attention, fast, speed
from lingbot_world.wan.config import CHUNKED_KINDS
from lingbot_world.wan.dit import WanModel, init_random_
from lingbot_world.wan.fast import FastConfig, FastSession, generate_fast
from torch.utils._pytree import tree_leaves

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


@pytest.mark.parametrize("backend", ["fa3", "fa3_fp8"])
def test_compiled_chunk_loop_with_flashattention3_is_one_graph_per_block(
    traced_chunk_blocks, monkeypatch, backend
):
    """FlashAttention-3 is looked up in its package at every call; an import there split each compiled block at
    its attention calls (eleven graph calls a block on an H100, none fused across the splits). The stand-in package
    is plain Python, traced inline; the real entry point is a custom op, traced as one node."""
    package = types.ModuleType("flash_attn_interface")
    package.flash_attn_func = fa3_math
    package.flash_attn_with_kvcache = fa3_cache_math
    fake_module(monkeypatch, "flash_attn_interface", package)
    monkeypatch.setattr(fa3_attention, "MIN_KEYS", 1)  # the tiny window's keys take the fp8 kernel too
    y, ctx, cam = inputs()
    kv = torch.float8_e4m3fn if backend == "fa3_fp8" else None
    config = FastConfig(**WINDOW, compile=True, attention=backend, kv_dtype=kv)
    s = FastSession(model(), ctx, y, LAT, config, "cpu")
    for k in range(4):
        s.next_chunk(cam[:, :, 3 * k : 3 * k + 3])
    assert len(traced_chunk_blocks) == 2 and not torch._dynamo.utils.counters["graph_break"]
    # each graph holds the block's whole forward: its self- and cross-attention and the FFN
    for graph in traced_chunk_blocks:
        code = graph.code
        assert code.count("scaled_dot_product_attention") == 2 and "gelu" in code
        # the fp8 kernel's operands are made in the graph
        assert ("float8_e4m3fn" in code) is (backend == "fa3_fp8")
        # RoPE's rotated pairs are stacked in the attention's dtype, not float64: the stack is what inductor writes
        # out and what fp8 attention's quantization reads back
        stacks = [n.meta["example_value"].dtype for n in graph.graph.nodes if n.target is torch.stack]
        assert len(stacks) == 2 and torch.float64 not in stacks


def test_live_play_compiles_its_growing_chunks_from_the_second(traced_chunk_blocks):
    """A stream session (live play: every rollout starts with the growing chunks) runs them from chunk 1 through
    the growing chunks' runner, whose two graphs take the cache's placement as symbols and serve every growing
    chunk after; chunk 0 stays eager (its first slot, 0, would trace as a constant)."""
    m = model()
    y, ctx, cam = inputs()
    want = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW), "cpu", stream=True)
    s = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu", stream=True)
    graphs_after = []
    for k in range(5):
        part = cam[:, :, 3 * k : 3 * k + 3]
        a, b = s.next_chunk(part), want.next_chunk(part)
        graphs_after.append(len(traced_chunk_blocks))
        assert torch.equal(a, b) if k == 0 else torch.allclose(a, b, rtol=1e-5, atol=1e-5), k
    assert graphs_after == [0, 2, 4, 4, 4]  # growing at chunk 1, fixed shapes at the roll (chunk 2)
    assert not torch._dynamo.utils.counters["graph_break"]
    # a whole clip runs its growing chunks eagerly
    assert FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu")._growing is None


def test_compile_off_takes_no_runner_and_a_window_that_never_fills_runs_eagerly(traced_chunk_blocks):
    m = model()
    y, ctx, cam = inputs()
    assert FastSession(m, ctx, y, LAT, FastConfig(**WINDOW), "cpu")._runner is None
    generate_fast(m, ctx, y, cam, LAT, FastConfig(compile=True), "cpu")  # unbounded: never evicts
    assert traced_chunk_blocks == []


FACTORIES = (torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor)
FACTORIES += (torch.randn, torch.rand, torch.linspace, torch.eye)


class HostMade(torch.overrides.TorchFunctionMode):
    """Records tensors made without naming a device: on a GPU they are made on the host, and copying one over
    waits for the stream (PyTorch's plain host-to-device copy syncs), which the chunk loop must never do."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.made.append(func.__name__)
        return func(*args, **kwargs)


def test_the_chunk_loop_makes_no_tensor_on_the_host():
    y, ctx, cam = inputs()
    s = FastSession(model(), ctx, y, LAT, FastConfig(**WINDOW), "cpu")
    for k in range(3):
        with HostMade() as mode:
            s.next_chunk(cam[:, :, 3 * k : 3 * k + 3])
        assert mode.made == [], f"chunk {k}"


class RecordedForward(fast.ForwardGraph):
    """A CUDA graph's contract on the CPU: the forward is kept as recorded (its closure as it was then) and run
    again at each replay on the buffers alone, into the output buffer; a value the session failed to route
    through the buffers stays at its recorded one, as it would in a real graph."""

    made = []

    def record(self, forward):
        self.forward, self.replays = forward, 0
        RecordedForward.made.append(self)
        return forward(**self.buffers)

    def memory_pool(self):
        return ("pool of", self)

    def replay(self):
        self.replays += 1
        made = self.forward(**self.buffers)  # a tensor, the camera injections' pairs, or None (a commit pass)
        assert (made is None) is (self.out is None)
        for out, value in zip(tree_leaves(self.out), tree_leaves(made), strict=True):
            if out is not None:
                out.copy_(value)


def test_steady_forwards_replay_one_recorded_graph_and_equal_the_compiled_loop(
    traced_chunk_blocks, monkeypatch
):
    m = model()
    y, ctx, cam = inputs()
    config = FastConfig(**WINDOW, compile=True)

    def run(graphs: bool, prompt_at=None):
        s = FastSession(m, ctx, y, LAT, config, "cpu")
        assert s._graphs is False  # CUDA only
        s._graphs = graphs
        out = []
        for k in range(5):
            if k == prompt_at:
                s.set_context(ctx + 1)
            out.append(s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]))
        return torch.cat(out, dim=1)

    want = run(False)
    monkeypatch.setattr(fast, "ForwardGraph", RecordedForward)
    RecordedForward.made = []
    # the timesteps, chunks (RoPE from each chunk's first frame), conditions and cameras all differ per replay
    assert torch.equal(run(True), want)
    # chunk 2 rolls first: its first step runs compiled, the second records; 3 + 4 + 4 replays. The commit pass
    # (its last block's keys alone) has its own graph, in the steps' memory pool: run at chunk 2, recorded at 3
    assert [g.replays for g in RecordedForward.made] == [11, 2]
    steps, commit = RecordedForward.made
    assert commit.pool == ("pool of", steps) and steps.pool is None and commit.out is None
    RecordedForward.made = []
    # a new prompt drops the graphs (they read the old text's keys): chunk 3's first forward makes the keys,
    # its second records the steps' graph again, its commit pass the commit's
    assert torch.equal(run(True, prompt_at=3), run(False, prompt_at=3))
    assert [g.replays for g in RecordedForward.made] == [3, 7, 2]


def test_kept_camera_injections_run_compiled_and_through_the_recorded_graph(traced_chunk_blocks, monkeypatch):
    """FastConfig.camera_cache under compile: the camera pass runs through its own compiled function (one graph for
    every block and chunk), from the second chunk through its own recorded graph too, the steady forwards' recorded
    graph reads the kept injections from fixed buffers, and the chunks equal the compiled loop without the cache; a
    chunk without a camera drops the forwards' graph."""
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    runner = speed.CompiledBlocks(backend=backend, fn=speed.run_camera)
    monkeypatch.setitem(speed._shared_runners, speed.run_camera, runner)
    m = model()
    y, ctx, cam = inputs()

    kept = []  # each chunk's kept buffers' addresses (the recorded graph reads the first ones)

    def run(camera_cache: bool, graphs: bool, cams=None):
        s = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True, camera_cache=camera_cache), "cpu")
        s._graphs = graphs
        out = []
        for c in cams or [cam[:, :, 3 * k : 3 * k + 3] for k in range(5)]:
            out.append(s.next_chunk(c))
            kept.append([t.data_ptr() for pair in s._cams or [] for t in pair])
        return torch.cat(out, dim=1)

    want = run(False, False)
    monkeypatch.setattr(fast, "ForwardGraph", RecordedForward)
    RecordedForward.made = []
    kept.clear()
    assert torch.equal(run(True, True), want)
    # the camera injections' own graph, recorded at chunk 1 and replayed from there on, then the forwards'
    replays = [(type(g.out).__name__, g.replays) for g in RecordedForward.made]
    assert len(traced) == 1 and replays == [("list", 4), ("Tensor", 11), ("NoneType", 2)]
    assert kept[0] and all(ptrs == kept[0] for ptrs in kept[:-1]) and kept[-1] == []  # the last chunk closes
    RecordedForward.made = []
    # chunk 3 without a camera: the graph recorded with the kept injections is not replayed for it
    cams = [cam[:, :, 3 * k : 3 * k + 3] for k in range(5)]
    cams[3] = None
    assert torch.equal(run(True, True, cams), run(False, False, cams))
    # the camera's graph skips chunk 3 and replays for chunk 4; the forwards' is recorded three times
    replays = [(type(g.out).__name__, g.replays) for g in RecordedForward.made]
    assert replays[0] == ("list", 3) and [kind for kind, _ in replays[1:]] == ["Tensor"] * 3


def test_a_refused_recording_leaves_the_session_on_the_compiled_blocks(
    traced_chunk_blocks, monkeypatch, caplog
):
    def refuse(self, forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fast.ForwardGraph, "record", refuse)
    m = model()
    y, ctx, cam = inputs()
    want = generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    s = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    s._graphs = True
    got = torch.cat([s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]) for k in range(5)], dim=1)
    assert torch.equal(got, want) and s._graphs is False
    assert "CUDA graph of the chunk forward refused (operation not permitted" in caplog.text


def test_a_refused_commit_recording_drops_the_steps_graph_too(traced_chunk_blocks, monkeypatch, caplog):
    """The commit pass's graph refused after the steps' was recorded: the session goes back to the compiled blocks
    for every forward and lets the steps' graph (and so its memory pool) go, with the same chunks."""

    class RefusedCommit(RecordedForward):
        def record(self, forward):
            if self.pool is not None:  # the commit's, recorded into the steps' pool
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().record(forward)

    m = model()
    y, ctx, cam = inputs()
    want = generate_fast(m, ctx, y, cam, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    monkeypatch.setattr(fast, "ForwardGraph", RefusedCommit)
    RecordedForward.made = []
    s = FastSession(m, ctx, y, LAT, FastConfig(**WINDOW, compile=True), "cpu")
    s._graphs = True
    got = [s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]) for k in range(4)]
    assert s._graphs is False and s._graph == {}  # before the last chunk, which closes the session
    got = torch.cat([*got, s.next_chunk(cam[:, :, 12:15])], dim=1)
    assert torch.equal(got, want)
    # the steps' graph replayed at chunks 2 and 3 (3 + 4), then nothing after the commit's refusal at chunk 3
    assert [g.replays for g in RecordedForward.made] == [7]
    assert "CUDA graph of the chunk forward refused (operation not permitted" in caplog.text


def test_a_refused_camera_recording_leaves_the_injections_on_their_compiled_calls(
    traced_chunk_blocks, monkeypatch, caplog
):
    real = RecordedForward.record

    def refuse_the_camera(self, forward):
        if "cam" in self.buffers:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, forward)

    monkeypatch.setattr(fast, "ForwardGraph", RecordedForward)
    monkeypatch.setattr(RecordedForward, "record", refuse_the_camera)
    RecordedForward.made = []
    m = model()
    y, ctx, cam = inputs()
    config = FastConfig(**WINDOW, compile=True, camera_cache=True)
    want = generate_fast(m, ctx, y, cam, LAT, dataclasses.replace(config, compile=False), "cpu")
    s = FastSession(m, ctx, y, LAT, config, "cpu")
    s._graphs = True
    got, states = [], []
    for k in range(5):
        got.append(s.next_chunk(cam[:, :, 3 * k : 3 * k + 3]))
        states.append((s._camera_graph, s._graphs))
    assert torch.equal(torch.cat(got, dim=1), want)
    # refused at chunk 1, not tried again; the forwards' graph stays on (the last chunk closes the session)
    assert states[:4] == [(None, True)] + [(False, True)] * 3
    assert caplog.text.count("CUDA graph of the camera injections refused (operation not permitted") == 1


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
    # --camera_cache: auto by default (the memory check decides), on / off as asked; on is refused with swapped blocks
    for command in ("fast", "play"):
        base = [command, "--ckpt_dir", "m", "--image", "i.png", "--prompt", "p"]
        assert parser.parse_args(base).camera_cache == "auto"
        assert cli.AUTO_ON_OFF[parser.parse_args([*base, "--camera_cache", "on"]).camera_cache] is True
    for asked in ("auto", False, True):
        config, _ = chunked.settings(kind, 30, None, 0, None, None, "bf16", "0", None, camera_cache=asked)
        assert config.camera_cache == asked
    with pytest.raises(ValueError, match="--camera_cache on: .* --swap_blocks 2"):
        chunked.settings(kind, 30, None, 0, None, None, "bf16", "2", None, camera_cache=True)


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
    monkeypatch.setattr(speed, "chunk_block_runner", lambda device, growing=False: None)
    return asked, made


def test_fast_compile_compiles_the_fast_decoder(
    fast_ckpt, shipped_example, tmp_path, monkeypatch, decoder_compiles
):
    """`fast --compile --vae_dtype bf16` builds the fast decoder with its levers (compiled blocks, sub-pixel
    upsampling); the bf16 decoder without --compile and the exact decoder with it have none (bf16 rather than
    the GPU's fp16: a CPU's fp16 convs are far slower, and the levers are the same)."""
    from helpers import fast_args

    monkeypatch.setenv("LINGBOT_WORLD_CACHE", str(tmp_path / "cache"))
    asked, made = decoder_compiles
    runs = [("bf16", "--compile"), ("bf16",), ("fp32", "--compile")]
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
        vae_dtype="bf16",
    )
    try:
        session.start(cli.load_image(shipped_example / "image.jpg"), "a castle")
        assert session.step() == 9
        # the unseen warm-up's rollout and the played one each build their decoder, both with the levers
        assert len(asked) == len(made) == 2 and all(m.spatial for m in made)
        assert session._decoder.decoder.levers is made[1]
    finally:
        session.close()


@pytest.mark.parametrize("backend,kv", [("fa3", None), ("fa3_fp8", None), ("fa3_fp8", torch.float8_e4m3fn)])
def test_flashattention3_chunks_all_run_one_graph_from_the_first_chunk(
    traced_chunk_blocks, monkeypatch, backend, kv
):
    """Compiled with FlashAttention-3 the cache is aligned to its end (FA3 reads it from a start on the device), so
    the growing chunks have the steady chunks' shapes: the fixed-shape blocks trace at chunk 0's second forward (no
    growing runner), and one recorded graph, recorded at its third, serves every later step of every chunk, rolled
    or not (the commit passes another, recorded at chunk 1). The chunks equal the compiled loop over upstream's
    layout (its growing chunks' runner)."""
    package = types.ModuleType("flash_attn_interface")
    package.flash_attn_func = fa3_math
    package.flash_attn_with_kvcache = fa3_cache_math
    fake_module(monkeypatch, "flash_attn_interface", package)
    monkeypatch.setattr(fa3_attention, "MIN_KEYS", 1)
    m = model()
    y, ctx, cam = inputs()
    config = FastConfig(**WINDOW, attention=backend, kv_dtype=kv, compile=True)
    with monkeypatch.context() as patch:  # as another backend has it: upstream's layout, the growing runner
        patch.setattr(attention, "takes_cached_rows", lambda name: False)
        want = FastSession(m, ctx, y, LAT, config, "cpu", stream=True)
    assert want._cache.start is None and want._growing is not None
    monkeypatch.setattr(fast, "ForwardGraph", RecordedForward)
    RecordedForward.made = []
    s = FastSession(m, ctx, y, LAT, config, "cpu", stream=True)
    assert s._cache.start is not None and s._growing is None
    s._graphs = True  # CUDA only: RecordedForward keeps the graph's contract on the CPU
    parts = [cam[:, :, 3 * k : 3 * k + 3] for k in range(5)]
    wanted = [want.next_chunk(part) for part in parts]
    assert len(traced_chunk_blocks) == 4  # the reference's growing and fixed-shape graphs
    graphs_after, devs = [], []
    for k, part in enumerate(parts):
        got = s.next_chunk(part)
        graphs_after.append(len(traced_chunk_blocks))
        devs.append(((got - wanted[k]).norm() / wanted[k].norm()).item())
    # this session's two (a bf16 stream into block 0, fp32 after), traced at its chunk 0
    assert graphs_after == [6] * 5 and not torch._dynamo.utils.counters["graph_break"]
    # chunk 0's steps: the text's keys (eager), then compiled, then recorded: 2 replays; 4 each for chunks 1-4. The
    # commit pass (its last block's keys alone) has its own graph: run at chunk 0, recorded at chunk 1
    assert [g.replays for g in RecordedForward.made] == [18, 4]
    assert devs[0] == 0
    # an e4m3 cache: chunk 0's commit runs compiled here (eager there), where the q/k kernel writes the keys' codes
    # rounded once (eager rounds to bf16 first), so a few codes differ by one step in every later chunk's keys
    assert max(devs) < (5e-3 if kv else 1e-5), devs
