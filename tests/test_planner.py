"""Run planner, memory refusals, the OOM message and `doctor` (CPU; memory figures injected)."""

import functools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lingbot  # noqa: E402

pack = lingbot.load_pack()
from lingbot_world import cli  # noqa: E402
from lingbot_world.loaders import demo_assets  # noqa: E402
from lingbot_world.session import doctor  # noqa: E402
from lingbot_world.session import planner as mp  # noqa: E402
from lingbot_world.wan import i2v  # noqa: E402
from lingbot_world.wan import vae as V  # noqa: E402
from lingbot_world.wan.config import A14B  # noqa: E402

GIB = mp.GIB
NF4 = 9_740_000_000


def planner(h=480, w=832, frames=81, **kw):
    area = h * w
    size = i2v.latent_size(h, w, area)
    return mp.Planner(A14B, size, frames, mp.MemoryRequest({"high": NF4, "low": NF4}, **kw), (h, w), area)


def test_calibration_points_within_ten_percent():
    p480, p720 = planner().plan(24 * GIB), planner(720, 1280).plan(24 * GIB)
    for plan, phase, gib in (
        (p480, "vae_encode", 7.43),
        (p480, "denoise_low", 14.80),
        (p480, "vae_decode", 6.79),
        (p720, "vae_encode", 16.98),
        (p720, "denoise_low", 22.06),
        (p720, "vae_decode", 15.66),
    ):
        assert abs(plan.phase(phase).vram / GIB - gib) <= 0.1 * gib, (phase, plan.phase(phase).vram / GIB)
    lora = planner(lora_bytes={"high": 830_000_000, "low": 830_000_000}).plan()
    assert abs(lora.phase("denoise_high").vram / GIB - 15.57) < 0.3
    assert planner(compile=True).plan().peak_vram < p480.peak_vram


def test_working_vram_is_the_denoise_figure_beyond_the_resident_expert():
    """What a front end asks the card to free besides the expert it loads: the larger expert's LoRA plus the
    activations, whatever the swap; with the resident (swap-reduced) weights it adds up to the denoise figure."""
    lora = {"high": 0, "low": 830_000_000}
    act = mp.activation_vram(planner().plan().tokens, A14B)
    for swap in (0, 24, 40):  # 24: the shipped 12 GB workflow
        plan = planner(swap_blocks=swap, lora_bytes=lora).plan()
        assert plan.working_vram == act + lora["low"], swap
        resident = mp.expert_vram(NF4, A14B.num_layers, swap)
        assert plan.phase("denoise_low").vram == resident + plan.working_vram
        assert plan.phase("denoise_high").vram == resident + plan.working_vram - lora["low"]


def test_t5_overlap_only_when_the_child_and_this_process_fit_together():
    lora = {"high": 830_000_000, "low": 830_000_000}
    alone = planner(lora_bytes=lora).plan(24 * GIB)
    auto = planner(lora_bytes=lora, t5_overlap="auto").plan(24 * GIB)
    assert not alone.text_overlap and auto.text_overlap
    # the child's T5 and CUDA context beside the larger of the first-frame encode and the first expert load
    loaded = mp.VAE_BASE + mp.expert_vram(NF4, A14B.num_layers, 0) + lora["high"]
    beside = max(auto.phase("vae_encode").vram, loaded)
    assert auto.phase("text_encode").vram == alone.phase("text_encode").vram + mp.T5_CHILD_CONTEXT + beside
    assert 20 * GIB < auto.phase("text_encode").vram <= 24 * GIB * (1 - mp.AUTO_HEADROOM)
    assert auto.phase("text_encode").ram > alone.phase("text_encode").ram
    assert [p for p in auto.phases if p.name != "text_encode"] == [
        p for p in alone.phases if p.name != "text_encode"
    ]
    assert "beside the first-frame encode" in auto.table()
    # too little room, block swap, an in-process encoder, several ranks, or no budget: one after the other
    assert not planner(t5_overlap="auto").plan(20 * GIB).text_overlap
    assert not planner(t5_overlap="auto", swap_blocks=4).plan(24 * GIB).text_overlap
    assert not planner(t5_overlap="auto", t5_mode="inprocess").plan(24 * GIB).text_overlap
    assert not planner(t5_overlap="auto").plan().text_overlap
    assert planner(t5_overlap="auto", t5_device="cpu").plan(16 * GIB).text_overlap  # T5 on the CPU: no VRAM
    # forced on, the plan checks the sum like any phase, and encoding first is the fix it names
    with pytest.raises(mp.MemoryPlanError, match="text_encode") as err:
        mp.check(planner(t5_overlap=True), 20 * GIB)
    assert err.value.suggestions[0] == [("t5_overlap", "off")] and "--t5_overlap off" in str(err.value)
    # 'auto' weighs the VRAM; when the overlap's host RAM does not fit, the run encodes first instead
    ram = (alone.peak_ram + auto.phase("text_encode").ram) // 2
    assert alone.peak_ram < ram < auto.phase("text_encode").ram
    checked = mp.check(planner(lora_bytes=lora, t5_overlap="auto"), 24 * GIB, free_ram=ram)
    assert not checked.text_overlap and checked.phase("text_encode") == alone.phase("text_encode")
    # an out-of-memory while the child shared the card points at the overlap first
    oom = mp.oom_error("vae_encode", auto)
    assert "text encoder's child shared the card" in str(oom) and oom.suggestions == [[("t5_overlap", "off")]]
    assert mp.oom_error("denoise_low", auto).suggestions != [[("t5_overlap", "off")]]


@pytest.mark.parametrize("phase", mp.PHASES[1:])
def test_monotonic_in_size_and_frames(phase):
    sizes = [(256, 448), (480, 832), (576, 1024), (720, 1280)]
    for frames in (9, 41, 81, 161, 321):
        vals = [planner(h, w, frames, vae_tile=None).plan().phase(phase).vram for h, w in sizes]
        assert vals == sorted(vals), (phase, frames, vals)
    for h, w in sizes:
        vals = [planner(h, w, f, vae_tile=None).plan().phase(phase).vram for f in range(5, 330, 8)]
        assert vals == sorted(vals), (phase, h, w)
    swaps = [planner(swap_blocks=s).plan().phase("denoise_high").vram for s in range(0, 41, 5)]
    assert swaps == sorted(swaps, reverse=True) and swaps[-1] < swaps[0] - 7 * GIB


def test_refusal_names_phase_and_fitting_settings():
    p = planner(720, 1280, 81)
    with pytest.raises(mp.MemoryPlanError) as err:
        mp.check(p, 20 * GIB)
    e = err.value
    assert e.param == "memory" and e.phase == "denoise_high" and "22." in str(e)
    assert "--swap_blocks" in str(e) and "--frame_num" in str(e) and "--size" in str(e)
    assert "--lean_activations on" in str(e)  # lean activations were off: turning them on is a fix
    for changes in e.suggestions:  # every suggestion fits by the same model
        kw = dict(changes)
        fixed = p.with_(
            frame_num=kw.get("frame_num"),
            swap_blocks=kw.get("swap_blocks", 0),
            lean_activations=kw.get("lean_activations") == "on",
            size=i2v.latent_size(720, 1280, i2v.parse_max_area(kw["size"])) if "size" in kw else None,
        )
        assert not fixed.plan(20 * GIB).over(20 * GIB)
    with pytest.raises(mp.MemoryPlanError, match="text_encode.*--t5_cpu"):
        mp.check(planner(), 8 * GIB)
    with pytest.raises(mp.MemoryPlanError, match="--vae_tile auto"):
        mp.check(planner(720, 1280, 81, vae_tile=None, swap_blocks=40, t5_device="cpu"), 14 * GIB)
    assert mp.check(planner(), 24 * GIB).peak_vram < 24 * GIB
    assert mp.check(planner(), None, cap=24 * GIB).swap_blocks == 0
    auto = mp.check(planner(swap_blocks="auto", t5_device="cpu"), 12 * GIB)
    assert 0 < auto.swap_blocks < 40 and auto.peak_vram <= 12 * GIB


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory):
    return demo_assets.ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def generate_argv(ckpt, *extra):
    ex = ROOT / "examples" / "00"
    return [
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(ex / "image.jpg"),
        "--prompt",
        "p",
        "--size",
        "64*112",
        "--frame_num",
        "9",
        "--device",
        "cpu",
        *extra,
    ]


def test_plan_subcommand_prints_table(demo_ckpt, capsys):
    assert cli.main(["plan", *generate_argv(demo_ckpt)]) == 0
    out = capsys.readouterr().out
    for phase in mp.PHASES:
        assert phase in out
    assert "9 frames at 48*112" in out and "peak VRAM" in out  # HEIGHT*WIDTH, as --size is typed
    assert "lean" not in out  # 'auto' with nothing to fit: the normal blocks
    assert cli.main(["plan", *generate_argv(demo_ckpt, "--lean_activations", "on")]) == 0
    assert "swap_blocks 0, VAE tile none (whole frame), lean activations" in capsys.readouterr().out


def test_generate_refuses_when_plan_does_not_fit(demo_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "resolve_device", lambda text: torch.device("cuda"))
    monkeypatch.setattr(mp, "free_memory", lambda device: (1 << 20, 64 * GIB))
    rc = cli.main(["generate", *generate_argv(demo_ckpt, "--output", str(tmp_path / "o.mp4"))])
    err = capsys.readouterr().err
    assert rc == 2 and "not enough memory" in err and "GiB free" in err and "Traceback" not in err
    assert not (tmp_path / "o.mp4").exists()


def test_oom_becomes_clear_message(demo_ckpt, tmp_path, monkeypatch, capsys):
    from lingbot_world.loaders.experts import ExpertSwitcher
    from lingbot_world.wan import pipeline

    def oom(**kw):
        with kw["hooks"].in_phase("denoise_high"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    closed = []
    real_close = ExpertSwitcher.close
    monkeypatch.setattr(ExpertSwitcher, "close", lambda self: (closed.append(1), real_close(self))[1])
    monkeypatch.setattr(pipeline, "sample", oom)
    monkeypatch.setattr(mp, "free_memory", lambda device: (8 * GIB, None))
    rc = cli.main(["generate", *generate_argv(demo_ckpt, "--output", str(tmp_path / "o.mp4"))])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "CUDA ran out of memory during denoise_high" in err and "the plan predicted" in err
    assert "models released" in err and closed
    e = mp.oom_error("denoise_low", planner(720, 1280).plan(20 * GIB))
    assert "denoise_low" in str(e) and "--swap_blocks" in str(e)


def test_run_uses_the_planned_vae_tiles(demo_ckpt, tmp_path, monkeypatch):
    """With --vae_tile auto and a plan made against a budget, the encode and decode run with the tiles the
    plan checked (not a second pick from the VRAM free at that moment)."""
    from dataclasses import replace

    from lingbot_world.wan.vae import WanVAE

    real_prepare, used = cli.prepare_generate, {}

    def prepare(args, **kw):
        device, files, tile, image, plan = real_prepare(args, **kw)
        planned = replace(plan.memory, encode_tile=(40, 41), vae_tile=(41, 44), budget=10 * GIB)
        return device, files, tile, image, replace(plan, memory=planned)

    def spy(name):
        real = getattr(WanVAE, name)

        def run(self, x, tile=None, **kw):
            used[name] = tile
            return real(self, x, tile=tile, **kw)

        return run

    monkeypatch.setattr(cli, "prepare_generate", prepare)
    monkeypatch.setattr(WanVAE, "encode", spy("encode"))
    monkeypatch.setattr(WanVAE, "decode", spy("decode"))
    argv = generate_argv(demo_ckpt, "--output", str(tmp_path / "o.mp4"), "--sampling_steps", "2")
    assert cli.main(["generate", *argv]) == 0
    assert used == {"encode": (40, 41), "decode": (41, 44)}


def test_auto_decode_tile_keeps_headroom():
    budget = 12 * GIB
    plan = planner(720, 1280).plan(budget)
    assert plan.vae_tile is not None and plan.budget == budget
    assert plan.phase("vae_decode").vram <= budget * (1 - mp.AUTO_HEADROOM)


def test_doctor_fails_clearly_without_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checks = {c.name: c for c in doctor.run_checks(tmp_path / "missing")}
    assert not checks["GPU"].ok and "CUDA build" in checks["GPU"].detail
    assert not checks["pinned memory"].ok and not checks["bitsandbytes"].ok
    assert not checks["checkpoints"].ok and "missing" in checks["checkpoints"].detail
    assert cli.main(["doctor", "--ckpt_dir", str(tmp_path / "missing")]) == 1
    assert "to fix: GPU" in capsys.readouterr().out


def test_doctor_missing_libraries_and_broken_ckpt(monkeypatch, demo_ckpt, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_libs(name, *a, **kw):
        if name in ("av", "bitsandbytes"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_libs)
    assert not doctor.check_pyav().ok and "pip install av" in doctor.check_pyav().detail
    assert "pip install bitsandbytes" in doctor.check_bitsandbytes().detail
    monkeypatch.setattr(builtins, "__import__", real_import)
    good = doctor.check_checkpoints(demo_ckpt)
    assert all(c.ok for c in good) and {c.name for c in good} == {"experts", "text encoder", "VAE"}
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(demo_ckpt, broken)
    vae = next(p for p in broken.iterdir() if "vae" in p.name.lower() and p.is_file())
    vae.write_bytes(b"not a checkpoint")
    checks = {c.name: c for c in doctor.check_checkpoints(broken)}
    bad = [c for c in checks.values() if not c.ok]
    assert bad and any(vae.name in c.detail for c in bad)


def test_plan_request_resolves_auto_swap_to_the_least_that_fits():
    """`swap_blocks auto` with a memory check: the Plan carries the planner's choice, which fits."""
    from lingbot_world.session.request import plan_request
    from lingbot_world.wan.config import SampleConfig
    from lingbot_world.wan.speed import SpeedOptions

    request = mp.MemoryRequest({"high": NF4, "low": NF4}, t5_device="cpu")
    check = mp.MemoryCheck(request, "cuda", free_vram=12 * GIB)
    plan = plan_request(
        (480, 832),
        A14B,
        SampleConfig(),
        max_area=480 * 832,
        memory=check,
        swap_blocks="auto",
        speed=SpeedOptions(lean_activations=False),
    )
    assert isinstance(plan.swap_blocks, int) and 0 < plan.swap_blocks < 40
    assert plan.swap_blocks == plan.memory.swap_blocks and plan.memory.peak_vram <= 12 * GIB
    assert plan.speed.lean_activations is False and not plan.memory.lean_activations
    # lean activations 'auto' (the default) come before swapping: lean blocks and fewer swapped ones
    lean = plan_request(
        (480, 832), A14B, SampleConfig(), max_area=480 * 832, memory=check, swap_blocks="auto"
    )
    assert lean.speed.lean_activations is True and lean.memory.lean_activations
    assert lean.swap_blocks < plan.swap_blocks and lean.memory.peak_vram <= 12 * GIB
    roomy = plan_request(
        (480, 832),
        A14B,
        SampleConfig(),
        max_area=480 * 832,
        swap_blocks="auto",
        memory=mp.MemoryCheck(request, "cuda", free_vram=40 * GIB),
    )
    assert roomy.swap_blocks == 0 and roomy.speed.lean_activations is False  # fits: today's exact blocks


# --- the first-frame encode follows the encode's own tiling --------------------------------------


class _Picked(Exception):
    pass


def encode_pick(monkeypatch, h, w, frames, budget):
    """The tile `WanVAE.encode(tile='auto')` chooses for an h x w x frames video with `budget` bytes free
    (the full-size VAE on the meta device; stopped right after the choice)."""
    picked = {}
    real = mp.pick_encode_tile  # the original (an earlier call may have replaced V.pick_encode_tile)

    def spy(*args, **kw):
        picked["tile"] = real(*args, **kw)
        raise _Picked

    monkeypatch.setattr(V, "free_vram", lambda device: budget)
    monkeypatch.setattr(V, "pick_encode_tile", spy)
    monkeypatch.setattr(V, "check_video", lambda video: None)  # a meta video has no values to check
    with torch.device("meta"):
        vae = V.WanVAE()
    with pytest.raises(_Picked):
        vae.encode(torch.empty(3, frames, h, w, device="meta"), tile="auto")
    return picked["tile"]


@pytest.mark.parametrize("h,w,frames", [(480, 832, 81), (720, 1280, 81), (720, 1280, 161)])
def test_encode_tile_is_the_one_the_encode_picks(monkeypatch, h, w, frames):
    seen = []
    for free in (6, 8, 12, 16, 24, 40):
        plan = planner(h, w, frames).plan(free * GIB)
        ph, pw = plan.size[2:]  # the size the pipeline runs (480p: 464 x 832)
        # what the encode sees free: the plan's budget less the VAE and the video already on the device
        budget = free * GIB - mp.VAE_BASE - 12 * frames * ph * pw
        assert plan.encode_tile == encode_pick(monkeypatch, ph, pw, frames, budget), free
        assert plan.phase("vae_encode").note == f"tile {mp._tile_text(plan.encode_tile)}"
        seen.append(plan.phase("vae_encode").vram)
    assert seen == sorted(seen)  # more free VRAM: a larger tile (or none), never a smaller peak
    untiled = planner(h, w, frames, vae_tile=None).plan(6 * GIB).phase("vae_encode").vram
    assert planner(h, w, frames).plan().phase("vae_encode").vram == untiled  # no budget known: whole frame
    if planner(h, w, frames).plan(6 * GIB).encode_tile is not None:
        assert seen[0] < untiled  # tiling saves what scales with the frame's area


@pytest.mark.parametrize("h,w,frames", [(480, 832, 81), (720, 1280, 81), (720, 1280, 161)])
def test_auto_encode_tile_fits_where_any_tile_does(h, w, frames):
    """The tile 'auto' encodes with and the planner's figure are one estimate (`wan.vae.encode_work_bytes`):
    for any budget the planner counts the tile the encode picks, and that figure fits the budget, or not even
    the smallest tile does and the plan is refused at the encode (the chunked plan likewise)."""
    from lingbot_world.session import fast_run
    from lingbot_world.wan.config import CHUNKED_KINDS

    least = (mp.DECODE_MIN_TILE, mp.DECODE_MIN_TILE)
    kind = CHUNKED_KINDS["v2-1.3b"]
    chunked = functools.partial(
        fast_run.fast_memory,
        fast_run.ChunkedModel.of_kind(kind),
        (i2v.latent_frames(frames), *planner(h, w, frames).size[:2]),
        fast_run.fast_config(None, 0, None, None, "fp8", kind),
        True,
        0,
        "auto",
    )
    fitted = refused = 0
    for budget in range(GIB, 40 * GIB, GIB // 4):
        p = planner(h, w, frames, t5_device="cpu", swap_blocks=40)
        plan = p.plan(budget)
        lat_h, lat_w = plan.size[:2]
        figure = plan.phase("vae_encode").vram
        assert figure == mp.encode_vram(frames, lat_h, lat_w, plan.encode_tile)  # the picked tile's figure
        smallest = mp.encode_vram(frames, lat_h, lat_w, mp.encode_tile(frames, lat_h, lat_w, least, None))
        if figure <= budget:
            fitted += 1
        else:
            refused += 1
            assert figure == smallest > budget, budget / GIB  # no tile fits: the smallest is counted
            with pytest.raises(mp.MemoryPlanError) as err:
                mp.check(p, budget)
            assert err.value.phase == "vae_encode"
        assert chunked(budget=budget).encode == figure  # the chunked plan counts the same encode
    assert fitted and refused  # the range crosses the smallest tile's figure


def test_explicit_encode_tile_bounds_the_encode():
    whole = planner(720, 1280, 81, vae_tile=None).plan()
    tiled = planner(720, 1280, 81, vae_tile=(48, 64)).plan()
    big = planner(720, 1280, 81, vae_tile=(200, 200)).plan()  # one tile covering the frame: untiled
    assert tiled.encode_tile == (48, 64) and big.encode_tile is None
    assert big.phase("vae_encode").vram == whole.phase("vae_encode").vram
    enc = tiled.phase("vae_encode").vram
    # the activations shrink to the tile's area; the video, the VAE and the fp32 accumulators stay
    area_share = (48 * 64) / (90 * 160)
    assert enc < whole.phase("vae_encode").vram * 0.5
    assert enc > mp.VAE_BASE + 18 * 81 * 720 * 1280 + area_share * V.ENCODE_BYTES_PER_LATENT_PIXEL * 90 * 160
    # an encode that does not fit untiled is answered with tiling first
    with pytest.raises(mp.MemoryPlanError, match="--vae_tile auto") as err:
        mp.check(planner(720, 1280, 81, vae_tile=None, t5_device="cpu", swap_blocks=40), 16 * GIB)
    assert err.value.phase == "vae_encode"


# --- sequence parallel: per-rank memory ------------------------------------------------------------


def test_ulysses_plan_is_per_rank():
    one = planner(720, 1280, 161, t5_device="cpu").plan()
    tokens, dim = one.tokens, A14B.dim
    previous = one.phase("denoise_high").vram
    for n in (2, 4, 8):
        plan = planner(720, 1280, 161, t5_device="cpu", ulysses_size=n).plan()
        assert plan.ranks == n and plan.tokens == tokens
        den = plan.phase("denoise_high").vram
        # every rank holds the whole expert; activations fall with the share of tokens
        assert mp.expert_vram(NF4, A14B.num_layers, 0) < den < previous
        previous = den
        local = -(-tokens // n)
        act = mp.activation_vram(tokens, A14B, ranks=n)
        # the local tokens' activations, the four all-to-all buffers (q, k, v and the output: the full
        # sequence of H/N heads in bf16) and the camera tokens embedded for the whole sequence
        assert act >= mp.activation_vram(local, A14B) + 4 * local * dim * 2 + (tokens - local) * dim * 2
        assert act >= tokens * dim * 2 * 5  # every rank embeds all tokens before the split
        # rank 0 alone runs the text encoder and the VAE: those phases are the single-device ones
        for name in ("text_encode", "vae_encode", "vae_decode"):
            assert plan.phase(name).vram == one.phase(name).vram
        assert plan.rank_peak_vram == den
        # RAM is the host's: the other ranks' processes beside rank 0's
        assert plan.phase("denoise_low").ram == one.phase("denoise_low").ram + (n - 1) * mp.PROCESS_RAM
        text = plan.table()
        others = "rank 1" if n == 2 else f"ranks 1-{n - 1}"
        assert f"sequence parallel over {n} ranks" in text and f"\n{others}: " in text
        assert f"{local:,} tokens per rank" in text
    assert mp.activation_vram(tokens, A14B, ranks=1) == mp.activation_vram(tokens, A14B)


def test_ulysses_plan_with_block_swap_counts_every_ranks_pinned_blocks():
    """Each rank assembles its expert in host RAM and pins its own copy of its swapped blocks: the denoise
    RAM (the host's) counts N of each."""
    block = NF4 // A14B.num_layers
    one = planner(720, 1280, 81, t5_device="cpu", swap_blocks=10).plan()
    assert one.phase("denoise_high").ram == mp.PROCESS_RAM + NF4 + 10 * block
    resident = planner(720, 1280, 81, t5_device="cpu").plan()  # no swap: loaded straight to the device
    assert resident.phase("denoise_high").ram == mp.PROCESS_RAM
    for n in (2, 4):
        plan = planner(720, 1280, 81, t5_device="cpu", swap_blocks=10, ulysses_size=n).plan()
        den = plan.phase("denoise_high")
        assert den.ram == n * (mp.PROCESS_RAM + NF4 + 10 * block)
        assert (
            den.vram
            == planner(720, 1280, 81, t5_device="cpu", ulysses_size=n).plan().phase("denoise_high").vram
            - 8 * block
        )  # per rank, as one device: 10 swapped, 2 in flight
        assert plan.phase("vae_decode").ram == one.phase("vae_decode").ram + (n - 1) * mp.PROCESS_RAM
        assert (
            f"10 blocks in pinned RAM on each of {n} ranks ({n * 10 * block / GIB:.2f} GiB pinned" in den.note
        )


def test_plan_request_checks_per_rank_memory():
    from lingbot_world.session.request import plan_request
    from lingbot_world.wan.config import SampleConfig

    request = mp.MemoryRequest({"high": NF4, "low": NF4}, t5_device="cpu", vae_tile="auto")
    check = mp.MemoryCheck(request, "cuda", free_vram=22 * GIB)

    from lingbot_world.wan.speed import SpeedOptions

    def plan(n, lean=False):
        return plan_request(
            (720, 1280),
            A14B,
            SampleConfig(),
            frame_num=161,
            max_area=720 * 1280,
            memory=check,
            ulysses_size=n,
            ulysses_world=n,
            speed=SpeedOptions(lean_activations=lean),
        )

    with pytest.raises(mp.MemoryPlanError) as err:
        plan(1)
    assert err.value.phase == "denoise_high"
    one = plan(1, lean="auto")  # lean activations make the one device fit
    assert one.speed.lean_activations is True and one.memory.peak_vram <= 22 * GIB
    assert plan(4, lean="auto").speed.lean_activations is False  # four ranks fit without them
    p4 = plan(4)
    assert p4.ulysses_size == 4 and p4.memory.ranks == 4 and p4.memory.peak_vram <= 22 * GIB
    with pytest.raises(mp.MemoryPlanError) as err:  # two ranks still need more than 22 GiB each
        plan(2)
    assert err.value.phase.startswith("denoise") and "--swap_blocks" in str(err.value)  # swap works with it
    swapped = plan_request(
        (720, 1280),
        A14B,
        SampleConfig(),
        frame_num=161,
        max_area=720 * 1280,
        memory=check,
        ulysses_size=2,
        ulysses_world=2,
        swap_blocks="auto",
        speed=SpeedOptions(lean_activations=False),
    )
    assert 0 < swapped.swap_blocks < 40 and swapped.memory.peak_vram <= 22 * GIB  # 'auto': this rank's fit


def test_plan_subcommand_prints_per_rank_figures(demo_ckpt, capsys):
    assert cli.main(["plan", *generate_argv(demo_ckpt, "--ulysses_size", "2")]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel over 2 ranks" in out and "\nrank 1: " in out and "tokens per rank" in out
    assert "ranks 1-1" not in out
    assert cli.main(["plan", *generate_argv(demo_ckpt, "--ulysses_size", "3")]) == 2  # 4 heads
    assert "does not divide" in capsys.readouterr().err


def test_chunked_tiled_decode_counts_every_tile_cache():
    one_shot, chunked = (mp.decode_vram(21, 90, 160, (90, 88), chunked=c) for c in (False, True))
    # two tiles: the chunked stream keeps the other tile's caches too
    assert chunked - one_shot == 90 * 88 * mp.DECODE_CACHE_PER_LATENT_PIXEL
    assert mp.decode_vram(21, 90, 160, None, chunked=True) == mp.decode_vram(21, 90, 160, None)


def test_chunked_host_ram_counts_block_swap():
    """With --swap_blocks the chunked model is assembled in host RAM beside its swapped blocks' pinned copies,
    as the generate planner counts (planner.swap_host_ram); without swap neither is there."""
    from lingbot_world.session import fast_run
    from lingbot_world.session.planner import swap_host_ram
    from lingbot_world.wan.config import CHUNKED_KINDS
    from lingbot_world.wan.fast import FastConfig

    kind = CHUNKED_KINDS["v2-14b"]
    model, config = fast_run.ChunkedModel.of_kind(kind), FastConfig.for_kind(kind)
    shape = (4, 58, 104)  # one chunk: the loop's RAM, not the first-frame encode's, is the larger
    plain = fast_run.fast_memory(model, shape, config, None, 0)
    swapped = fast_run.fast_memory(model, shape, config, None, 13)
    assembled, pinned = swap_host_ram(model.nbytes, kind.dit.num_layers, 13)
    assert assembled == model.nbytes and pinned == 13 * (model.nbytes // 40)
    assert swapped.ram == plain.ram + assembled + pinned and swap_host_ram(model.nbytes, 40, 0) == (0, 0)


def test_fast_decoder_decode_figure_scales_with_its_dtype():
    """The fast decoder's decode figure: every per-latent-pixel cost (caches and activations, each tile's
    caches in a chunked decode) at the dtype's size, plus its copy of the decoder's weights; fp32 is the
    exact decode's figure as before."""
    from lingbot_world.wan.vae import DECODE_DTYPES, WanVAE

    with torch.device("meta"):
        vae = WanVAE()
    params = sum(p.numel() for p in vae.decoder.parameters())
    assert mp.decoder_params() == params == 73_295_331
    assert mp.decode_per_latent_pixel("fp32") == mp.DECODE_PER_LATENT_PIXEL
    for name, size in (("bf16", 2), ("fp16", 2)):
        # the same ratio as the analytic count the 'auto' tile decides with
        assert (
            vae.decode_bytes_per_latent_pixel(2, DECODE_DTYPES[name]) * 4
            == vae.decode_bytes_per_latent_pixel(2) * size
        )
        assert mp.decode_per_latent_pixel(name) == mp.DECODE_PER_LATENT_PIXEL * size // 4
        for tile, chunked in ((None, False), (None, True), ((58, 60), False), ((58, 60), True)):
            fp32 = mp.decode_vram(4, 58, 104, tile, chunked)
            assert fp32 == mp.decode_vram(4, 58, 104, tile, chunked, vae_dtype="fp32")
            fast = mp.decode_vram(4, 58, 104, tile, chunked, vae_dtype=name)
            fixed = mp.decode_vram(4, 58, 104, (0, 0))  # base, output video and blend weights
            if tile is None:
                fixed = mp.DECODE_BASE + 3 * 13 * 58 * 104 * 64 * 4
            # what scales is halved, what doesn't stays, and the copy of the weights is added
            assert fast - params * size == pytest.approx(fixed + (fp32 - fixed) * size / 4, abs=4)
    # the 464x832 chunk decode (4 latent frames -> 16 frames): ~6.5 GiB exact, ~3.6 GiB with the fast decoder
    assert 6.4 < mp.decode_vram(4, 58, 104, None, True) / mp.GIB < 6.6
    assert 3.5 < mp.decode_vram(4, 58, 104, None, True, vae_dtype="fp16") / mp.GIB < 3.7
    # 'auto' tiles for the smaller figure: a budget the exact decode tiles for, the fast one fits whole
    budget = mp.decode_vram(21, 90, 160, None, vae_dtype="bf16")
    assert mp.auto_tile(21, 90, 160, budget) is not None and mp.auto_tile(21, 90, 160, budget, "bf16") is None
    with pytest.raises(mp.RequestError, match="vae_dtype"):
        mp.MemoryRequest(expert_bytes={"high": 1, "low": 1}, vae_dtype="fp8")


def test_v2_1_3b_fits_8_gib_with_the_fast_decoder():
    """The 1.3B whole chunked run at 464x832, window 18 / sink 6, NF4, fp8 K/V (issue 19): the exact decode
    peaks at 9.75 GiB (measured 9.87 on an H200) and is refused under an 8 GiB cap naming --vae_dtype; with
    it the chunk loop's figure drops by half the decode's per-pixel cost and fits."""
    from lingbot_world.session import fast_run
    from lingbot_world.wan.config import CHUNKED_KINDS

    kind = CHUNKED_KINDS["v2-1.3b"]
    model, shape = fast_run.ChunkedModel.of_kind(kind), (28, 58, 104)  # 7 chunks, 109 frames
    config = fast_run.fast_config(None, 0, None, None, "fp8", kind)
    exact = fast_run.fast_memory(model, shape, config, True, 0, "auto")
    fast = fast_run.fast_memory(model, shape, config, True, 0, "auto", "fp16")
    assert exact == fast_run.fast_memory(model, shape, config, True, 0, "auto", "fp32")
    assert 9.7 < exact.peak / mp.GIB < 9.8  # the figure BENCHMARKS.md recorded before the fast decoder
    assert exact.work == mp.decode_vram(4, 58, 104, None, chunked=True)  # the decode, not the forward
    assert fast.work == mp.decode_vram(4, 58, 104, None, chunked=True, vae_dtype="fp16")
    assert (fast.model, fast.caches, fast.condition) == (exact.model, exact.caches, exact.condition)
    assert fast.peak == fast.loop < 7 * mp.GIB
    free = int(7.8 * mp.GIB)  # an 8 GiB cap less the CUDA context
    issue = functools.partial(fast_run.fast_fit_issue, model, shape, config, True, 0, free, "auto")
    assert issue().endswith("would fit with --vae_dtype fp16")
    assert issue(vae_dtype="fp16") is None and issue(vae_dtype="bf16") is None
    # bf16 K/V: the fast decoder alone is not enough; it is named together with what completes the fit
    bf16_kv = fast_run.fast_config(None, 0, None, None, "bf16", kind)
    message = fast_run.fast_fit_issue(model, shape, bf16_kv, True, 0, free, "auto")
    assert "--vae_dtype fp16 --kv_dtype fp8" in message


def test_chunked_encode_is_predicted_at_the_tile_auto_picks_from_the_free_vram():
    """'auto' tiles the first-frame encode to what is free when it runs (no model loaded yet): given that free
    VRAM the figure is the tile the encode picks (the whole frame with room to spare: measured 7.56 GiB for the
    1.3B's 109 frames under an 8 GiB cap, after 2.96 was predicted at the smallest tile); without it, the
    smallest tile. A bigger budget never predicts less, and a fixed tile ignores the budget."""
    from lingbot_world.session import fast_run
    from lingbot_world.wan.config import CHUNKED_KINDS

    kind = CHUNKED_KINDS["v2-1.3b"]
    model, shape = fast_run.ChunkedModel.of_kind(kind), (28, 58, 104)
    config = fast_run.fast_config(None, 0, None, None, "fp8", kind)
    memory = functools.partial(fast_run.fast_memory, model, shape, config, True, 0)
    least, whole = memory("auto").encode, memory(None).encode
    assert least < whole
    assert memory("auto", budget=whole + mp.GIB).encode == whole  # room: the whole frame, as the encode does
    squeezed = memory("auto", budget=whole // 2).encode
    assert least <= squeezed < whole  # the tile the encode picks for what is free
    assert memory((32, 32), budget=whole + mp.GIB).encode == memory((32, 32)).encode
    assert 7.3 < whole / mp.GIB < 7.8  # the untiled encode measured 7.56 GiB on an H200
    # the fit check plans the encode against the free VRAM it checks: it never refuses for an encode that tiles
    free = int(7.8 * mp.GIB)
    assert fast_run.fast_fit_issue(model, shape, config, True, 0, free, "auto", vae_dtype="fp16") is None


def test_plan_names_the_fast_decoder(demo_ckpt, capsys):
    """`plan --vae_dtype fp16` plans generate's decode with the fast decoder; `plan --model v2-1.3b` at 8 GiB
    is refused naming --vae_dtype and passes with it (exit 2 / 0, nothing loaded either way)."""
    assert cli.main(["plan", *generate_argv(demo_ckpt, "--vae_dtype", "fp16")]) == 0
    assert "fp16 decoder" in capsys.readouterr().out
    argv = ["plan", "--model", "v2-1.3b", "--size", "464*832", "--frame_num", "109", "--vram", "7.8"]
    argv += ["--kv_dtype", "fp8", "--t5_cpu"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().endswith("would fit with --vae_dtype fp16")
    assert cli.main([*argv, "--vae_dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "VAE decoder fp16" in out and "a chunk's work 3.61 GiB" in out


def test_fp8_attention_copies_are_planned():
    """attention 'fp8' quantizes q, k and v beside each block's attention: the base-cam step's plan and the chunk
    loop's (fewer with an fp8 K/V cache, whose keys it reads as stored) grow by `fp8_attention_vram`."""
    from lingbot_world.session import fast_run
    from lingbot_world.session.request import plan_request
    from lingbot_world.wan.config import CHUNKED_KINDS, SampleConfig
    from lingbot_world.wan.fast import FastConfig
    from lingbot_world.wan.speed import SpeedOptions

    base, fp8 = planner().plan(), planner(fp8_attention=True).plan()
    extra = mp.fp8_attention_vram(base.tokens, base.tokens, A14B.dim)
    assert fp8.working_vram == base.working_vram + extra
    assert abs(extra / GIB - 1.06) < 0.01  # measured +0.9 GiB at this size (BENCHMARKS.md)
    # the request path asks for it from the speed options
    check = mp.MemoryCheck(
        mp.MemoryRequest({"high": NF4, "low": NF4}, t5_device="cpu"), "cuda", free_vram=None
    )
    for attn, want in (("sdpa", base), ("fp8", fp8)):
        plan = plan_request(
            (480, 832), A14B, SampleConfig(), max_area=480 * 832, memory=check, speed=SpeedOptions(attn)
        )
        assert plan.memory.working_vram == want.working_vram, attn
    kind = CHUNKED_KINDS["v2-1.3b"]
    model = fast_run.ChunkedModel.of_kind(kind)
    shape = (28, 58, 104)

    def forward(**settings):
        config = FastConfig.for_kind(kind, **settings)
        return fast_run.fast_memory(model, shape, config, None, 0, "auto").work_forward

    tokens, window = 4 * 1508, 18 * 1508
    assert forward(attention="fp8") - forward() == mp.fp8_attention_vram(tokens, window, kind.dit.dim)
    fp8_kv = torch.float8_e4m3fn
    assert forward(attention="fp8", kv_dtype=fp8_kv) - forward(kv_dtype=fp8_kv) == tokens * kind.dit.dim * 5
    assert abs((forward(attention="fp8") - forward()) / GIB - 0.12) < 0.01  # measured +0.12 GiB
