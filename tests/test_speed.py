"""Speed options of the sampling loop on tiny random experts: everything off is today's loop bit for bit,
guide scale 1 runs one forward, EasyCache (threshold 0 exact, more threshold more skips, reset at the
expert switch), compiled blocks (one shared graph set, fallbacks), attention backends."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import counting_blocks, fake_module
from lingbot_world.loaders.synthetic import tiny_config
from lingbot_world.wan import attention, fast, i2v, pipeline, schedulers, speed
from lingbot_world.wan.config import SampleConfig
from lingbot_world.wan.dit import WanModel, init_random_
from lingbot_world.wan.speed import SpeedOptions, SpeedStats
from lingbot_world.wan.step_cache import EasyCache

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
_EXPERTS = [schedulers.expert_for_timestep(t, 0.947) for t in schedulers.sampling_sigmas(STEPS, 10.0)[0]]
SPLIT = (_EXPERTS.count("high"), _EXPERTS.count("low"))


class Inputs:
    def __init__(self, layers=2):
        cfg = tiny_config("cam", num_layers=layers)
        self.models = {
            w: init_random_(WanModel.from_config(cfg).eval(), seed=s) for w, s in (("high", 1), ("low", 2))
        }
        g = torch.Generator().manual_seed(0)
        f, h, w = 2, 4, 6
        self.noise = torch.randn(16, f, h, w, generator=g)
        self.y = torch.randn(20, f, h, w, generator=g)
        self.context = torch.randn(7, 32, generator=g)
        self.context_null = torch.randn(5, 32, generator=g)
        self.cam = torch.randn(1, 384, f, h, w, generator=g)
        self.calls = []  # the expert of every forward
        self.per_step = []  # forwards run in each step
        for which, model in self.models.items():
            model.register_forward_pre_hook(lambda module, args, which=which: self.calls.append(which))

    def experts(self, which):
        return self.models[which]

    def denoise(self, settings=None, **kwargs):
        self.calls.clear()
        self.per_step.clear()
        done = [0]

        def progress(i, n, latent):
            self.per_step.append(len(self.calls) - done[0])
            done[0] = len(self.calls)

        settings = settings or SampleConfig(sample_steps=STEPS)
        hooks = pipeline.Hooks(progress=progress)
        return pipeline.denoise(
            self.experts,
            self.noise,
            self.y,
            self.context,
            self.context_null,
            self.cam,
            settings,
            hooks,
            **kwargs,
        )


@pytest.fixture(scope="module")
def inputs():
    return Inputs()


def todays_loop(inp: Inputs, settings: SampleConfig) -> torch.Tensor:
    """The sampling loop as it was before the speed options, step for step."""
    scheduler = schedulers.make_scheduler(
        settings.solver, settings.sample_steps, settings.sample_shift, "cpu"
    )
    seq_len = i2v.seq_len(*inp.noise.shape[1:])
    latent = inp.noise
    for t in scheduler.timesteps:
        model = inp.models[schedulers.expert_for_timestep(t, settings.boundary)]
        g = schedulers.guide_scale_for(t, settings.boundary, settings.guide_scale)
        timestep = t.reshape(1)
        with torch.no_grad():
            cond = model(latent, timestep, inp.context, seq_len, y=inp.y, cam=inp.cam)
            uncond = model(latent, timestep, inp.context_null, seq_len, y=inp.y, cam=inp.cam)
            latent = scheduler.step(uncond + g * (cond - uncond), t, latent)
    return latent


def test_everything_off_is_todays_loop_bit_for_bit(inputs):
    settings = SampleConfig(sample_steps=STEPS)
    before = todays_loop(inputs, settings)
    for options in (
        None,
        SpeedOptions(),
        SpeedOptions(attention="sdpa", compile=False, cache=None, fp8=False),
    ):
        assert torch.equal(inputs.denoise(speed=options), before)
    assert len(inputs.calls) == 2 * STEPS


def test_guide_scale_one_runs_only_the_cond_forward(inputs):
    settings = SampleConfig(sample_steps=STEPS, guide_scale=(1.0, 3.0))  # low-noise expert at 1
    stats = SpeedStats()
    out = inputs.denoise(settings, stats=stats)
    n_high, n_low = SPLIT
    assert inputs.calls == ["high"] * (2 * n_high) + ["low"] * n_low
    assert stats.forwards == {"high": 2 * n_high, "low": n_low} and stats.total_skipped == 0

    # Exactly the cond prediction where g == 1 (not uncond + 1 * (cond - uncond), which can round).
    scheduler = schedulers.make_scheduler("unipc", STEPS, settings.sample_shift, "cpu")
    latent = inputs.noise
    for t in scheduler.timesteps:
        which = schedulers.expert_for_timestep(t, settings.boundary)
        model = inputs.models[which]
        with torch.no_grad():
            cond = model(latent, t.reshape(1), inputs.context, None, y=inputs.y, cam=inputs.cam)
            if which == "high":
                uncond = model(latent, t.reshape(1), inputs.context_null, None, y=inputs.y, cam=inputs.cam)
                cond = uncond + 3.0 * (cond - uncond)
        latent = scheduler.step(cond, t, latent)
    assert torch.equal(out, latent)


def test_cache_threshold_zero_is_bit_identical(inputs):
    settings = SampleConfig(sample_steps=STEPS)
    stats = SpeedStats()
    cached = inputs.denoise(
        speed=SpeedOptions(cache="easycache", cache_threshold=0.0, cache_keep_first=0), stats=stats
    )
    assert torch.equal(cached, todays_loop(inputs, settings))
    assert stats.total_skipped == 0 and stats.total_forwards == 2 * STEPS


def cached_run(inp, threshold, keep_first=2, keep_last=1, guide=(5.0, 5.0)):
    stats = SpeedStats()
    options = SpeedOptions(
        cache="easycache", cache_threshold=threshold, cache_keep_first=keep_first, cache_keep_last=keep_last
    )
    out = inp.denoise(SampleConfig(sample_steps=STEPS, guide_scale=guide), speed=options, stats=stats)
    return out, stats


def test_larger_thresholds_skip_monotonically_more(inputs):
    skipped = []
    for threshold in (0.0, 0.3, 0.6, 1.0, 3.0, 1e6):
        out, stats = cached_run(inputs, threshold)
        assert torch.isfinite(out).all()
        assert len(inputs.calls) == stats.total_forwards  # the counter counts real forwards
        assert stats.total_forwards + stats.total_skipped == 2 * STEPS
        skipped.append(stats.total_skipped)
    assert skipped == sorted(skipped), skipped
    assert skipped[0] == 0
    # an unreachable threshold skips every step but the kept ones (2 first, 1 last per expert)
    assert skipped[-1] == 2 * (STEPS - 2 * 3)


def test_cache_resets_at_the_expert_switch_and_keeps_the_ends(inputs):
    n_high, n_low = SPLIT
    # keep nothing: only the two steps a transformation rate needs are computed, in each expert
    _, stats = cached_run(inputs, 1e6, keep_first=0, keep_last=0)
    assert stats.skipped_steps == {"high": n_high - 2, "low": n_low - 2}
    assert inputs.per_step == [2, 2] + [0] * (n_high - 2) + [2, 2] + [0] * (n_low - 2)
    # the first 3 and the last 2 steps of each expert's stretch always run
    _, stats = cached_run(inputs, 1e6, keep_first=3, keep_last=2)
    assert stats.skipped_steps == {"high": n_high - 5, "low": n_low - 5}
    stretch = {n: [2] * 3 + [0] * (n - 5) + [2] * 2 for n in (n_high, n_low)}
    assert inputs.per_step == stretch[n_high] + stretch[n_low]


def test_cache_with_guide_scale_one_skips_the_single_branch(inputs):
    n_high, n_low = SPLIT
    _, stats = cached_run(inputs, 1e6, guide=(1.0, 1.0))
    assert stats.skipped == {"high": n_high - 3, "low": n_low - 3}  # one forward per skipped step
    assert stats.forwards == {"high": 3, "low": 3}


def test_easycache_keeps_one_residual_per_branch():
    cache = EasyCache(keep_first=0, keep_last=0)
    cache.start(steps=5, threshold=10.0)
    x0, x1, x2 = torch.zeros(4), torch.full((4,), 1.0), torch.full((4,), 1.5)
    assert not cache.should_skip(x0)
    cache.store("cond", x0, torch.full((4,), 2.0))
    cache.store("uncond", x0, torch.full((4,), -1.0))
    assert not cache.should_skip(x1)  # no rate yet
    cache.store("cond", x1, torch.full((4,), 4.0))
    cache.store("uncond", x1, torch.full((4,), 3.0))
    assert cache.rate == pytest.approx(2.0)  # |4 - 2| / |1 - 0|
    assert cache.should_skip(x2)  # predicted change 2 * 0.5 / 4 = 0.25 < 10
    assert cache.accumulated == pytest.approx(0.25)
    assert torch.equal(cache.reuse("cond", x2), torch.full((4,), 4.5))  # x + (4 - 1)
    assert torch.equal(cache.reuse("uncond", x2), torch.full((4,), 3.5))  # x + (3 - 1)
    cache.start(steps=5, threshold=10.0)
    assert cache.rate is None and not cache.residual


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"cache": "teacache"}, "cache must be one of"),
        ({"cache_threshold": -0.1}, "cache_threshold"),
        ({"cache_threshold": (0.1, 0.2, 0.3)}, "cache_threshold"),
        ({"cache_keep_first": -1}, "cache_keep_first"),
        ({"cache_keep_last": 1.5}, "cache_keep_last"),
        ({"compile": "yes"}, "compile"),
    ],
)
def test_bad_options_name_the_parameter(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SpeedOptions(**kwargs)


def test_per_expert_threshold():
    options = SpeedOptions(cache="easycache", cache_threshold=(0.1, 0.3))
    assert (options.threshold_for("low"), options.threshold_for("high")) == (0.1, 0.3)


# --- compile -----------------------------------------------------------------------------------


def test_compiled_blocks_trace_once_for_all_blocks_steps_and_experts():
    inp = Inputs(layers=4)
    runner, graphs = counting_blocks()
    x, y, cam = inp.noise, inp.y, inp.cam
    with torch.no_grad():
        for model in inp.models.values():
            eager = model(x, torch.tensor([900]), inp.context, None, y=y, cam=cam)
            model.block_runner = runner
            for t in (900, 700, 500):  # steps
                for ctx in (inp.context, inp.context_null):  # CFG branches
                    model(x, torch.tensor([t]), ctx, None, y=y, cam=cam)
            assert torch.equal(model(x, torch.tensor([900]), inp.context, None, y=y, cam=cam), eager)
            model.block_runner = None
    # 2 experts x 4 blocks x 7 calls: two graphs, bf16 residual stream into block 0 and fp32 after
    assert len(graphs) == 2


def test_a_deferring_runner_hands_each_ffn_update_to_the_next_block():
    """A runner that `defers` (the chunk loop's) gets each block's FFN update back un-added and hands it to the
    next block, which adds it first (inside its own graph, where the norm after it fuses with it); the last one
    is added after the loop. The forward is the same bit for bit; a runner without `defers` (the bidirectional
    one, whose long sequences would keep the update alive through the next block) gets the plain arguments."""
    inp = Inputs(layers=3)
    model = inp.models["low"]
    args = (inp.noise, torch.tensor([700]), inp.context, None)
    seen = []

    def deferring(block, *a, **deferral):
        seen.append(deferral)
        return block(*a, **deferral)

    deferring.defers = True
    plain = []
    with torch.no_grad():
        eager = model(*args, y=inp.y, cam=inp.cam)
        try:
            model.block_runner = deferring
            deferred = model(*args, y=inp.y, cam=inp.cam)
            model.block_runner = lambda block, *a, **kw: plain.append(kw) or block(*a, **kw)
            undeferred = model(*args, y=inp.y, cam=inp.cam)
        finally:
            model.block_runner = None
    assert torch.equal(deferred, eager) and torch.equal(undeferred, eager)
    assert [d["defer"] for d in seen] == [True] * 3 and seen[0]["pending"] is None
    assert all(isinstance(d["pending"], tuple) and len(d["pending"]) == 2 for d in seen[1:])
    assert plain == [{}] * 3
    assert fast.ChunkBlocks.defers and not hasattr(speed.CompiledBlocks, "defers")


def test_compiled_sampling_loop_traces_once_and_leaves_experts_plain(inputs, monkeypatch):
    runner, graphs = counting_blocks()
    monkeypatch.setattr(speed, "compiler_missing", lambda device: None)
    monkeypatch.setitem(speed._shared_runners, speed.run_block, runner)
    stats = SpeedStats()
    out = inputs.denoise(speed=SpeedOptions(compile=True), stats=stats)
    assert stats.compiled and len(graphs) == 2  # 16 steps x 2 branches x 2 experts x 2 blocks
    assert all(m.block_runner is None for m in inputs.models.values())
    assert torch.equal(out, inputs.denoise())  # this backend runs the traced graph as is


def test_compile_without_compiler_falls_back_with_one_log_line(inputs, monkeypatch, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(speed.shutil, "which", lambda name: None)
    assert "C++ compiler" in speed.compiler_missing(torch.device("cpu"))
    stats = SpeedStats()
    with caplog.at_level(logging.WARNING, logger="LingBot-World"):
        out = inputs.denoise(speed=SpeedOptions(compile=True), stats=stats)
    assert torch.equal(out, inputs.denoise())
    assert not stats.compiled
    lines = [r.getMessage() for r in caplog.records if "compile" in r.getMessage()]
    assert len(lines) == 1 and "unavailable" in lines[0] and "eagerly" in lines[0]


def test_compiler_failure_at_first_call_falls_back_to_eager(inputs, caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    # earlier tests' compiled blocks (bf16, fp8) fill dynamo's per-function cache; at its recompile limit dynamo
    # would run the block eagerly without asking this backend at all
    torch._dynamo.reset()
    runner = speed.CompiledBlocks(backend=broken_backend)
    model = inputs.models["high"]
    x, y, cam, t = inputs.noise, inputs.y, inputs.cam, torch.tensor([900])
    with torch.no_grad():
        eager = model(x, t, inputs.context, None, y=y, cam=cam)
        model.block_runner = runner
        try:
            with caplog.at_level(logging.WARNING, logger="LingBot-World"):
                first = model(x, t, inputs.context, None, y=y, cam=cam)
                second = model(x, t, inputs.context, None, y=y, cam=cam)
        finally:
            model.block_runner = None
    assert runner.failed
    assert torch.equal(first, eager) and torch.equal(second, eager)
    lines = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(lines) == 1 and "InvalidCxxCompiler" in lines[0]


@pytest.mark.slow
def test_real_compile_matches_eager_on_a_tiny_model():
    if speed.compiler_missing(torch.device("cpu")):
        pytest.skip("no C++ compiler for inductor")
    inp = Inputs(layers=1)
    model = inp.models["low"]
    args = (inp.noise, torch.tensor([500]), inp.context, None)
    with torch.no_grad():
        eager = model(*args, y=inp.y, cam=inp.cam)
        model.block_runner = speed.block_runner(SpeedOptions(compile=True), "cpu")
        try:
            compiled = model(*args, y=inp.y, cam=inp.cam)
        finally:
            model.block_runner = None
    assert not speed._shared_runners[speed.run_block].failed
    # the prediction is bf16-rounded: a fused kernel may move values by a few bf16 ulps
    assert torch.allclose(compiled, eager, rtol=0.05, atol=0.05)
    assert (compiled - eager).abs().mean() < 0.01 * eager.abs().mean()


# --- attention backends ------------------------------------------------------------------------


def test_unknown_attention_backend_lists_the_choices(inputs):
    with pytest.raises(ValueError, match=r"attention backend must be one of \[.*'sdpa'"):
        inputs.denoise(speed=SpeedOptions(attention="flash3"))


def test_sage_without_the_package_names_it(inputs, monkeypatch):
    fake_module(monkeypatch, "sageattention", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match="sageattention"):
        inputs.denoise(speed=SpeedOptions(attention="sage"))
    assert attention.active() is attention.sdpa


def test_registered_backend_runs_inside_the_loop_only(inputs, monkeypatch):
    seen = []

    def counting_sdpa(q, k, v, dtype):
        seen.append((q.shape, k.shape))
        return attention.sdpa(q, k, v, dtype)

    monkeypatch.setitem(attention._BACKENDS, "counting", counting_sdpa)
    out = inputs.denoise(speed=SpeedOptions(attention="counting"))
    assert torch.equal(out, inputs.denoise())
    # 2 blocks x (self + cross) per forward, 2 forwards per step
    assert len(seen) == 2 * 2 * 2 * STEPS
    assert seen[0][0] == (2 * 2 * 3, 4, 16) and seen[1][1] == (32, 4, 16)  # tokens; text_len keys
    assert attention.active() is attention.sdpa


def comfy_pytorch_attention(
    q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs
):
    """ComfyUI's optimized_attention contract in its default layout: [b, tokens, heads * d] in and out."""
    assert not skip_reshape and not skip_output_reshape and mask is None
    b, _, inner = q.shape
    q, k, v = (t.view(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, -1, inner)


def test_comfy_style_backend_matches_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))
    attention.register_comfy("comfy", comfy_pytorch_attention)
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(24, 4, 16, generator=g),
        torch.randn(32, 4, 16, generator=g),
        torch.randn(32, 4, 16, generator=g),
    )
    with attention.use("comfy"):
        out = attention.attention(q, k, v, torch.bfloat16)
    expected = attention.sdpa(q, k, v, torch.bfloat16)
    assert out.shape == (24, 4, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    with pytest.raises(TypeError, match="callable"):
        attention.register_comfy("bad", "not a function")


# --- benchmark -----------------------------------------------------------------------------------


def test_bench_speed_runs_tiny(tmp_path):
    env = {"LINGBOT_WORLD_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_speed.py"), "--scale", "tiny", "--profile", "cfg1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"eager", "cfg1", "floor", "floor_light", "device", "tokens"} <= summary.keys()
    assert summary["eager"]["step_s"] > 0 and summary["cfg1"]["forwards"] == 1
    assert summary["floor"]["exact"] and not summary["floor_light"]["exact"]
    assert summary["floor"]["sustained_step_s"] > 0
    best = summary["best_default_quality"]
    assert best["over_sustained_floor"] == pytest.approx(
        summary[best["case"]]["step_s"] / summary["floor"]["sustained_step_s"], rel=1e-2
    )
    # the profile lists the step's ops by time, the largest first, and sums what it leaves out
    kernels = summary["cfg1"]["kernels"]
    assert "kernels" not in summary["eager"] and 2 <= len(kernels) <= 26
    times = [k["ms"] for k in kernels[:-1]]
    assert times == sorted(times, reverse=True) and times[0] > 0 and "others" in kernels[-1]["kernel"]
