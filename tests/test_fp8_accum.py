"""The fp8 linears' accumulation (`wan.fp8.accumulation`): 'exact' by default, 'fast' (cuBLAS's fast
accumulation) only where asked, reaching every scaled matmul of the base-cam loop and of a chunk's forwards and
kept camera injections; the CLI's `--fp8 fast` and LingBot Speed's fp8_accumulation; refusals."""

import pytest
import torch
from helpers import TinyRun, args_for, expect_clear_error, fast_args, fast_sample, node_inputs
from lingbot_world import cli
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.fast_checkpoint import FAST_DIR, resolve_fast_dir
from lingbot_world.session import chunked, fast_run
from lingbot_world.session import play as play_module
from lingbot_world.session.play import PlaySession
from lingbot_world.wan import fp8
from lingbot_world.wan.config import CHUNKED_KINDS
from lingbot_world.wan.dit import WanModel, init_random_
from lingbot_world.wan.fast import FastConfig, FastSession
from lingbot_world.wan.speed import SpeedOptions


@pytest.fixture
def accums(monkeypatch):
    """The `use_fast_accum` of every scaled matmul called (the real one still computes)."""
    seen, real = [], torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    return seen


def test_accumulation_reaches_the_scaled_matmul_and_is_restored(accums):
    codes, scale = fp8.quantize_rows(torch.randn(16, 32))
    x = torch.randn(4, 32)
    exact = fp8.fp8_linear(x, codes, scale, None, torch.float32)
    with fp8.accumulation("fast"):
        fast = fp8.fp8_linear(x, codes, scale, None, torch.float32)
        with fp8.accumulation("exact"):
            fp8.fp8_linear(x, codes, scale, None, torch.float32)
        fp8.fp8_linear(x, codes, scale, None, torch.float32)
    fp8.fp8_linear(x, codes, scale, None, torch.float32)
    assert accums == [False, True, False, True, False]
    assert torch.allclose(fast, exact, rtol=0.05, atol=0.05)  # the CPU kernel has one accumulation
    with pytest.raises(ValueError, match="fp8 accumulation: expected one of exact, fast, got 'fp32'"):
        with fp8.accumulation("fp32"):
            pass
    assert fp8._fast_accum is False


def test_speed_options_fp8_accum_defaults_to_exact_and_needs_fp8():
    assert SpeedOptions().fp8_accum == "exact"
    assert SpeedOptions(fp8=True, fp8_accum="exact") == SpeedOptions(fp8=True)
    with pytest.raises(ValueError, match="fp8_accum 'fast' is the fp8 linears' accumulation: turn fp8 on"):
        SpeedOptions(fp8_accum="fast")
    with pytest.raises(ValueError, match="fp8_accum must be one of exact, fast"):
        SpeedOptions(fp8=True, fp8_accum="quick")


def test_base_cam_loop_runs_the_asked_accumulation(accums):
    run = TinyRun()
    exact = run.denoise(SpeedOptions(fp8=True))
    assert accums and not any(accums)
    accums.clear()
    fast = run.denoise(SpeedOptions(fp8=True, fp8_accum="fast"))
    assert accums and all(accums)
    assert fp8._fast_accum is False  # restored after the loop
    torch.testing.assert_close(fast, exact)  # the CPU has no separate fast kernel: same values


LAT = (12, 4, 6)
WINDOW = dict(local_attn_size=7, sink_size=1)


def fp8_model():
    m = init_random_(WanModel.from_config(S.tiny_config("cam", num_layers=2)), seed=1).eval()
    assert fp8.quantize_blocks_(m) > 0
    return m


@pytest.mark.parametrize("camera_cache", [False, True])
def test_chunk_forwards_and_kept_injections_run_the_asked_accumulation(accums, camera_cache):
    g = torch.Generator().manual_seed(0)
    y, ctx = torch.randn(20, *LAT, generator=g), torch.randn(5, 32, generator=g)
    cam = torch.randn(1, 384, *LAT, generator=g)
    m = fp8_model()
    latents = {}
    for accum in fp8.ACCUMULATIONS:
        accums.clear()
        config = FastConfig(**WINDOW, camera_cache=camera_cache, fp8_accum=accum)
        s = FastSession(m, ctx, y, LAT, config, "cpu")
        latents[accum] = [s.next_chunk(cam[:, :, k : k + 3]) for k in range(0, LAT[0], 3)]
        assert accums and set(accums) == {accum == "fast"}
    assert fp8._fast_accum is False
    for a, b in zip(*latents.values(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="fp8_accum: expected one of exact, fast, got 'fp16'"):
        FastConfig(fp8_accum="fp16").validate()


def test_cli_fp8_takes_its_accumulation(nf4_ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    parser = cli.build_parser()
    base = ["fast", "--ckpt_dir", "x", "--image", "i.jpg", "--prompt", "p"]
    assert cli.fp8_accum(parser.parse_args(base)) == "exact" and parser.parse_args(base).fp8 is None
    assert parser.parse_args([*base, "--fp8"]).fp8 == "exact"
    assert cli.fp8_accum(parser.parse_args([*base, "--fp8", "fast"])) == "fast"
    assert cli.fp8_accum(parser.parse_args([*base, "--fp8", "--compile"])) == "exact"
    generate = parser.parse_args(
        ["generate", "--ckpt_dir", "x", "--image", "i.jpg", "--prompt", "p", "--fp8", "fast"]
    )
    options = cli.speed_options(generate)
    assert options.fp8 is True and options.fp8_accum == "fast"
    config, _ = chunked.settings(
        CHUNKED_KINDS["v2-1.3b"], 2, None, 0, None, None, "bf16", "0", None, fp8_accum="fast"
    )
    assert config.fp8_accum == "fast"
    assert fast_run.fast_config(None, 0, None, None, "bf16").fp8_accum == "exact"
    out = tmp_path / "o.mp4"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([*base, "--fp8", "fp32"])
    assert exit_info.value.code == 2
    assert "--fp8: invalid choice: 'fp32'" in capsys.readouterr().err
    # asked for on a card without fp8 tensor cores: the same refusal as --fp8, before anything loads
    args = args_for(nf4_ckpt, shipped_example / "poses.npy", out, "--fp8", "fast")
    expect_clear_error(capsys, args, out, "--fp8: fp8 linears need a CUDA GPU", "leave fp8 off")


class Asked(Exception):
    """What a patched step raises once it has recorded its arguments."""


def test_speed_node_fp8_accumulation_reaches_fast_and_play(
    fast_ckpt, shipped_example, tmp_path, fake_comfy, monkeypatch
):
    nodes = fake_comfy(fast_ckpt, tmp_path)
    choices, opts = nodes.LingBotSpeed.INPUT_TYPES()["optional"]["fp8_accumulation"]
    assert choices == ["exact", "fast"] and opts["default"] == "exact"
    node_args = ("sdpa", False, "none", 0.05, 7, 1)
    assert nodes.LingBotSpeed().options(*node_args, fp8_accumulation="exact")[0] == SpeedOptions()
    (speed,) = nodes.LingBotSpeed().options(*node_args, fp8_linears=True, fp8_accumulation="fast")
    assert speed.fp8 is True and speed.fp8_accum == "fast"
    refusal = (
        "fp8_accumulation: fast is the fp8 linears' accumulation; turn fp8_linears on, or set it to exact"
    )
    with pytest.raises(ValueError, match=refusal):
        nodes.LingBotSpeed().options(*node_args, fp8_accumulation="fast")
    with pytest.raises(ValueError, match=r"fp8_accumulation: expected one of \['exact', 'fast'\]"):
        nodes.LingBotSpeed().options(*node_args, fp8_linears=True, fp8_accumulation="bf16")
    # on a card with fp8 tensor cores (stood in), both chunked nodes hand the accumulation to their run
    monkeypatch.setattr(nodes.speed, "fp8_problem", lambda device: None)
    asked = []

    def record(*args, **kwargs):
        asked.append(kwargs["fp8_accum"])
        raise Asked

    monkeypatch.setattr(nodes.fast.chunked, "settings", record)
    monkeypatch.setattr(nodes.play, "NodePlaySession", record)
    text, vae, _, image = node_inputs(nodes, shipped_example)
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    with pytest.raises(Asked):
        fast_sample(nodes, model, vae, image, text=text, speed=speed)
    with pytest.raises(Asked):
        nodes.LingBotPlay().play(model, vae, image, "64*112", 3, "hold", -2, -1, text=text, speed=speed)
    assert asked == ["fast", "fast"]


def test_cli_fast_and_play_hand_the_accumulation_to_their_runs(
    fast_ckpt, shipped_example, tmp_path, capsys, monkeypatch, nothing_loads
):
    assert cli.FP8_ACCUMULATIONS == fp8.ACCUMULATIONS  # the parser's list, written out to keep torch out
    monkeypatch.setattr(fp8, "fp8_problem", lambda device: None)  # a card with fp8 tensor cores, stood in
    asked = []

    def record(name):
        def step(*args, **kwargs):
            asked.append((name, kwargs.get("fp8_accum")))
            raise ValueError(f"{name} recorded")

        return step

    monkeypatch.setattr(cli.chunked, "settings", record("fast"))
    monkeypatch.setattr(play_module, "PlaySession", record("play"))  # cli imports it when play runs
    out = tmp_path / "o.mp4"
    assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--fp8", "fast")) == 2
    play_args = ["play", "--ckpt_dir", str(fast_ckpt), "--image", str(shipped_example / "image.jpg")]
    assert cli.main([*play_args, "--prompt", "a castle", "--device", "cpu", "--fp8", "fast"]) == 2
    assert cli.main([*play_args, "--prompt", "a castle", "--device", "cpu", "--fp8"]) == 2
    assert asked == [("fast", "fast"), ("play", "fast"), ("play", "exact")]
    assert "fast recorded" in capsys.readouterr().err and not out.exists()


def test_play_session_config_carries_the_accumulation(fast_ckpt):
    files = resolve_fast_dir(fast_ckpt)
    for accum in fp8.ACCUMULATIONS:
        session = PlaySession(files, "cpu", area=64 * 112, t5_mode="inprocess", fp8_accum=accum)
        assert session.config.fp8_accum == accum
    with pytest.raises(ValueError, match="fp8_accum: expected one of exact, fast, got 'fast16'"):
        PlaySession(files, "cpu", area=64 * 112, t5_mode="inprocess", fp8_accum="fast16")


def scaled(x, codes, scale):
    return fp8.fp8_linear(x, codes, scale, None, torch.float32)


def test_compiled_linear_recompiles_for_the_other_accumulation():
    """A compiled block guards on the accumulation: switching traces the other graph (with its fast-accumulating
    scaled matmul) once, and switching back reuses the first."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(
            [n.kwargs.get("use_fast_accum") for n in gm.graph.nodes if "scaled_mm" in str(n.target)]
        )
        return gm.forward

    compiled = torch.compile(scaled, backend=backend)
    codes, scale = fp8.quantize_rows(torch.randn(16, 32))
    x = torch.randn(4, 32)
    compiled(x, codes, scale)
    with fp8.accumulation("fast"):
        compiled(x, codes, scale)
    compiled(x, codes, scale)
    assert graphs == [[False], [True]]


def times(block, x):
    return x * block


def test_shared_runners_hold_more_graphs_than_dynamo_default():
    """Each residual dtype, camera form, attention backend and accumulation a process runs is a graph of the
    shared runner: more than dynamo's default limit (8) must still compile, not fall back to eager unseen."""
    from lingbot_world.wan import speed

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    runner = speed.CompiledBlocks(backend=backend, fn=times)
    x = torch.ones(3)
    for block in range(12):  # a Python int specializes: one graph each
        assert torch.equal(runner(block, x), x * block)
    assert len(graphs) == 12 and not runner.failed
