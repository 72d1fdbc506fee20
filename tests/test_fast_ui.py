"""LingBot-World-Fast's front ends on a tiny Fast folder: the CLI `fast` command (whole path, keys steering
from a file and from stdin, bad input), the steering camera's causality, and the ComfyUI nodes."""

import functools
import io
import os
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import fast_args, fast_sample, node_inputs
from lingbot_world import cli
from lingbot_world.loaders.camera_files import CameraInput
from lingbot_world.loaders.fast_checkpoint import FAST_DIR, resolve_fast_dir
from lingbot_world.loaders.stream import load_expert
from lingbot_world.loaders.text_encode import encode_prompts
from lingbot_world.loaders.vae import load_vae
from lingbot_world.loaders.video import read_mp4_info
from lingbot_world.session import fast_run
from lingbot_world.session.controls import KeySteering, keys_camera
from lingbot_world.wan import i2v
from lingbot_world.wan.actions import actions_to_poses
from lingbot_world.wan.camera import camera_conditioning, relative_poses
from lingbot_world.wan.camera_presets import preset_intrinsics
from lingbot_world.wan.config import CHUNKED_KINDS
from lingbot_world.wan.fast import FastConfig, camera_cache_bytes, generate_fast
from lingbot_world.wan.fast_camera import KEY_STEP, parse_keys_line, pose_camera
from lingbot_world.wan.vae import to_comfy_latent
from PIL import Image
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("embedding_cache")
SIZE = (6, 14, 48, 112)  # examples/00's 1280x720 image at 64*112


class Offline:
    """The same pieces the command assembles, put together here by hand for `generate_fast`."""

    def __init__(self, ckpt, example):
        self.files = resolve_fast_dir(ckpt)
        with Image.open(example / "image.jpg") as img:
            self.image = i2v.image_to_tensor(img)
        (self.context,) = encode_prompts(
            self.files.text_encoder, ["a castle"], tokenizer_path=self.files.tokenizer, mode="inprocess"
        )
        self.vae = load_vae(self.files.vae)
        self.model = load_expert(self.files.source, "cpu")

    def latent(self, cam, frames):
        y = fast_run.condition(self.image, self.vae.encode, frames, SIZE, "cpu")
        lat_f = (frames - 1) // 4 + 1
        return generate_fast(self.model, self.context, y, cam, (lat_f, *SIZE[:2]), FastConfig(), "cpu")


@pytest.fixture(scope="module")
def offline(fast_ckpt, shipped_example, tmp_path_factory):
    os.environ.setdefault("LINGBOT_WORLD_CACHE", str(tmp_path_factory.mktemp("cache")))
    return Offline(fast_ckpt, shipped_example)


def test_fast_command_whole_path(fast_ckpt, shipped_example, tmp_path, capsys, offline):
    """Poses up front: 25 frames asked -> 7 latent frames cut to 6 (2 chunks, 21 frames), each chunk
    decoded as it finishes; the saved latent is generate_fast's with upstream Fast's camera."""
    out, saved, frames_dir = tmp_path / "o.mp4", tmp_path / "o.latent", tmp_path / "frames"
    args = fast_args(
        fast_ckpt,
        shipped_example,
        out,
        "--action_path",
        str(shipped_example),
        "--frame_num",
        "25",
        "--save_latent",
        str(saved),
        "--frames_dir",
        str(frames_dir),
    )
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "frames: 25 asked, 21 made (6 latent frames" in printed
    assert "chunk 1/2: denoise" in printed and "chunk 2/2: denoise" in printed and "fps" in printed
    for phase in ("text_encode", "vae_encode", "load_model", "chunks", "write_mp4"):
        assert phase in printed
    assert read_mp4_info(out) == {"frames": 21, "width": 112, "height": 48, "fps": 16.0}
    assert len(list(frames_dir.glob("frame_*.png"))) == 21

    camera = CameraInput.from_dir(shipped_example)
    poses = camera.plan(25)[0][:25]  # the 25 poses, interpolated to 6 latent poses over all of them
    cam = pose_camera(poses, camera.intrinsics, 6, SIZE)
    want = to_comfy_latent(offline.latent(cam, 21))
    assert torch.equal(load_file(str(saved))["latent_tensor"], want)


def test_fast_camera_equals_base_camera_when_nothing_is_cut(shipped_example):
    """With a length that is already whole chunks, upstream Fast's camera is base-cam's (same interpolation)."""
    camera = CameraInput.from_dir(shipped_example)
    poses, intr = camera.poses[:9], camera.intrinsics
    base, frames = camera_conditioning(poses, intr, 9, 48, 112, 6, 14)
    assert frames == 9 and torch.equal(pose_camera(poses, intr, 3, SIZE), base)


KEYS = ["w", "wj", "none"]


def test_steering_camera_is_causal_and_matches_act2cam():
    intr = preset_intrinsics(np.ones(1), SIZE[2:])
    full = keys_camera(KEYS + ["sl"], SIZE, intr)
    other = keys_camera(KEYS[:2] + ["il", "a"], SIZE, intr)
    steering = KeySteering(SIZE, intr)
    for k, line in enumerate(KEYS):
        steering.add(parse_keys_line(line))
        part = steering.camera(k)  # built from the keys of chunks 0..k only
        assert torch.equal(part, full[:, :, 3 * k : 3 * k + 3])
        if k < 2:
            assert torch.equal(part, other[:, :, 3 * k : 3 * k + 3])
    assert not torch.equal(full[:, :, 6:9], other[:, :, 6:9])  # chunk 2's own keys do count

    # latent frame i sits on act2cam's pose at video frame 4i: 8 key rows for chunk 0, then 12
    rows = np.repeat(
        np.array([[1, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0], [0] * 8], np.float32),
        [8, 12, 12],
        axis=0,
    )
    poses = actions_to_poses(rows[:, :4], rows[:, 4:])
    np.testing.assert_allclose(steering.latent_poses().numpy(), poses[::4], atol=1e-6)
    # a path whose fastest step is one held key: the fixed step gives upstream's whole-path normalisation
    walk = KeySteering(SIZE, intr)
    for _ in range(3):
        walk.add(parse_keys_line("w"))
    upstream = relative_poses(walk.latent_poses(), framewise=True)
    ours = relative_poses(walk.latent_poses(), framewise=True, normalize_trans=False)
    ours[:, :3, 3] /= KEY_STEP
    torch.testing.assert_close(ours, upstream)


def test_keys_file_steers_chunk_by_chunk(fast_ckpt, shipped_example, tmp_path, capsys, offline, monkeypatch):
    """3 key lines -> 3 chunks (9 + 12 + 12 frames) written as each chunk is decoded; the latent equals
    generate_fast with the camera built afterwards from the same keys."""
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    out, saved, frames_dir = tmp_path / "k.mp4", tmp_path / "k.latent", tmp_path / "live"
    written = []
    real_add = fast_run.FrameSink.add

    def add(self, video):
        real_add(self, video)
        written.append(len(list(frames_dir.glob("frame_*.png"))))

    monkeypatch.setattr(fast_run.FrameSink, "add", add)
    args = fast_args(
        fast_ckpt,
        shipped_example,
        out,
        "--keys",
        str(keys),
        "--save_latent",
        str(saved),
        "--frames_dir",
        str(frames_dir),
    )
    assert cli.main(args) == 0
    assert written == [9, 21, 33]
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines() if line.startswith("chunk ")] == [
        "chunk 1/3",
        "chunk 2/3",
        "chunk 3/3",
    ]
    assert read_mp4_info(out)["frames"] == 33

    cam = keys_camera(KEYS, SIZE, preset_intrinsics(np.ones(1), SIZE[2:]))
    want = to_comfy_latent(offline.latent(cam, 33))
    assert torch.equal(load_file(str(saved))["latent_tensor"], want)


def test_keys_from_stdin_skip_a_bad_line_and_end_with_the_input(
    fast_ckpt, shipped_example, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "stdin", io.StringIO("d\nwx\nl\n"))
    out = tmp_path / "s.mp4"
    assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--keys", "-", "--frame_num", "49")) == 0
    captured = capsys.readouterr()
    assert "ignored: --keys stdin line 2: 'wx' is not a keys line" in captured.err
    assert "chunk 2/4:" in captured.out and "chunk 3/4" not in captured.out  # input ended after 2 chunks
    assert read_mp4_info(out)["frames"] == 21


@pytest.fixture
def nothing_loads(monkeypatch):
    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(fast_run.ExpertSwitcher, "__call__", loaded)
    monkeypatch.setattr(cli.text_encode, "encode_prompts", loaded)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--keys", "KEYS"], "line 2: 'wq' is not a keys line"),
        (["--keys", "KEYS", "--action_string", "w-5"], "--keys steers the camera"),
        (["--local_attn_size", "4", "--sink_size", "3"], "--local_attn_size: must leave room"),
        (["--frame_num", "5"], "frame_num: Fast needs at least 9 frames"),
        (["--kv_dtype", "fp8", "--swap_blocks", "9"], "--swap_blocks"),
    ],
    ids=["bad-keys-line", "keys-and-string", "window", "too-short", "swap"],
)
def test_bad_input_exits_2_before_loading(
    fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads, extra, needle
):
    keys = tmp_path / "keys.txt"
    keys.write_text("w\nwq\nnone\n")
    extra = [str(keys) if a == "KEYS" else a for a in extra]
    out = tmp_path / "never.mp4"
    assert cli.main(fast_args(fast_ckpt, shipped_example, out, *extra)) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_nodes_give_the_cli_latent(fast_ckpt, shipped_example, tmp_path, fake_comfy, capsys):
    saved = tmp_path / "cli.latent"
    args = fast_args(
        fast_ckpt,
        shipped_example,
        tmp_path / "o.mp4",
        "--action_path",
        str(shipped_example),
        "--frame_num",
        "21",
        "--seed",
        "5",
        "--local_attn_size",
        "3",
        "--save_latent",
        str(saved),
    )
    assert cli.main(args) == 0

    nodes = fake_comfy(fast_ckpt, tmp_path)
    assert {"LingBotFastLoader", "LingBotFastSampler"} <= nodes.NODE_CLASS_MAPPINGS.keys()
    assert nodes.LingBotFastSampler.VALIDATE_INPUTS("64*112", 5).startswith("frame_num: Fast needs")
    assert "must leave room" in nodes.LingBotFastSampler.VALIDATE_INPUTS(local_attn_size=4, sink_size=3)
    # the model is not known when the prompt is queued: what one kind takes waits for the run's check
    assert nodes.LingBotFastSampler.VALIDATE_INPUTS(length=4101) is True  # v2's chunk of 4, not v1's 3
    assert nodes.LingBotFastSampler.VALIDATE_INPUTS(local_attn_size=5, sink_size=2) is True  # v1's, not v2's
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    (out,) = fast_sample(nodes, model, vae, image, camera=camera, text=text)
    assert out["samples"].shape == (1, 16, 6, 6, 14)
    assert torch.equal(out["samples"], load_file(str(saved))["latent_tensor"])
    with pytest.raises(ValueError, match="connect LingBot Text Encode"):
        fast_sample(nodes, model, vae, image, window=-1)


def test_ctrl_c_between_chunks_writes_no_mp4(fast_ckpt, shipped_example, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second chunk: exit 130, the model released, no MP4; the PNGs of chunk 1 stay."""
    from lingbot_world.wan.fast import FastSession

    real = FastSession.next_chunk

    def next_chunk(self, cam=None):
        if self.done == 1:
            raise KeyboardInterrupt
        return real(self, cam)

    monkeypatch.setattr(FastSession, "next_chunk", next_chunk)
    out, frames_dir = tmp_path / "never.mp4", tmp_path / "live"
    args = fast_args(fast_ckpt, shipped_example, out, "--frame_num", "21", "--frames_dir", str(frames_dir))
    assert cli.main(args) == 130
    assert "9 frames were written to" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".*partial*"))
    assert len(list(frames_dir.glob("frame_*.png"))) == 9


def test_memory_check_names_what_would_fit(fast_ckpt):
    """The Fast memory prediction grows with the cache and shrinks with a window, fp8 K/V and block swap;
    a budget between them gets a message naming the settings that fit, and none when it fits."""
    from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
    from lingbot_world.wan.fast import FastConfig

    files = resolve_fast_dir(fast_ckpt)
    shape = (30, 58, 104)  # 464x832, 30 latent frames: the caches dominate ('auto' tiles the encode)
    full = fast_run.fast_memory(files, shape, FastConfig(), None, 0, "auto")
    window = fast_run.fast_memory(files, shape, FastConfig(local_attn_size=6, sink_size=3), None, 0, "auto")
    fp8 = fast_run.fast_memory(files, shape, FastConfig(kv_dtype=torch.float8_e4m3fn), None, 0, "auto")
    swapped = fast_run.fast_memory(files, shape, FastConfig(), None, files.config.num_layers, "auto")
    assert window.caches < fp8.caches < full.caches
    assert swapped.model <= full.model and swapped.caches == full.caches
    assert full.peak == full.model + full.caches + full.work + full.condition > full.encode
    issue = functools.partial(fast_run.fast_fit_issue, files, shape, FastConfig(), None, 0, tile="auto")
    assert issue(full.peak) is None
    assert issue(None) is None  # CPU: nothing to check
    message = issue(full.peak - 1)
    assert "predicted peak" in message and "--local_attn_size" in message and "--kv_dtype fp8" in message
    assert issue(1).endswith("fewer frames or a smaller --size")


def test_fast_vae_dtype_decodes_with_the_fast_decoder(fast_ckpt, shipped_example, tmp_path, offline):
    """--vae_dtype bf16 changes only the decode: the same latent, frames close to the exact decode's, not
    equal; fp32 (the default) is the exact decode."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        out, saved, frames_dir = tmp_path / f"{dtype}.mp4", tmp_path / f"{dtype}.latent", tmp_path / dtype
        extra = ["--frame_num", "9", "--save_latent", str(saved), "--frames_dir", str(frames_dir)]
        assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--vae_dtype", dtype, *extra)) == 0
        frames = [np.asarray(Image.open(p), dtype=np.int16) for p in sorted(frames_dir.glob("frame_*.png"))]
        runs[dtype] = load_file(str(saved))["latent_tensor"], np.stack(frames)
    (latent, exact), (fast_latent, fast) = runs["fp32"], runs["bf16"]
    assert torch.equal(fast_latent, latent) and exact.shape == fast.shape == (9, 48, 112, 3)
    diff = np.abs(fast - exact)
    assert diff.max() > 0 and diff.mean() < 2  # uint8 levels


def test_fast_vae_dtype_refusals(fast_ckpt, shipped_example, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.mp4"
    with pytest.raises(SystemExit) as err:
        cli.main(fast_args(fast_ckpt, shipped_example, out, "--vae_dtype", "fp8"))
    assert err.value.code == 2 and "--vae_dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    # a card without bf16 is refused before anything loads, naming the flag and the fallback
    from lingbot_world.wan import vae as V

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"vae_dtype: Tesla T4 has no bf16 .*use fp16"):
        V.decode_dtype("bf16", "cuda")
    assert V.decode_dtype("fp16", "cuda") == torch.float16 and V.decode_dtype("fp32", "cuda") is None
    assert V.decode_dtype("bf16", "cpu") == torch.bfloat16  # runs on the CPU (slowly)
    monkeypatch.setattr(cli, "resolve_device", lambda text: torch.device("cuda"))
    from lingbot_world.session import chunked

    monkeypatch.setattr(chunked, "load_vae", lambda *a, **k: pytest.fail("loaded the VAE"))
    assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--vae_dtype", "bf16")) == 2
    assert "error: --vae_dtype: Tesla T4 has no bf16" in capsys.readouterr().err
    assert not out.exists()


def test_vae_decode_node_fast_decoder(fast_ckpt, tmp_path, fake_comfy):
    """LingBot VAE Decode's optional vae_dtype: left out or fp32 is the exact decode; fp16 decodes close to
    it with the fast decoder; a bad value is refused naming the input."""
    nodes = fake_comfy(fast_ckpt, tmp_path)
    assert nodes.LingBotVAEDecode.INPUT_TYPES()["optional"]["vae_dtype"][0] == ["fp32", "bf16", "fp16"]
    (vae,) = nodes.LingBotVAELoader().load("Wan2.1_VAE.pth", "fp32")
    samples = {
        "samples": vae.model.to_comfy_latent(
            torch.randn(16, 2, 4, 6, generator=torch.Generator().manual_seed(3))
        )
    }
    decode = functools.partial(nodes.LingBotVAEDecode().decode, vae, samples, "none", 64, 64)
    (exact,) = decode()
    assert torch.equal(decode(vae_dtype="fp32")[0], exact)
    (fast,) = decode(vae_dtype="fp16")
    assert fast.shape == exact.shape == (5, 32, 48, 3) and not torch.equal(fast, exact)
    assert (fast - exact).abs().max() < 0.01
    with pytest.raises(ValueError, match="vae_dtype: expected one of fp32, bf16, fp16, got 'fp8'"):
        decode(vae_dtype="fp8")


def test_fast_node_asks_comfyui_for_the_planners_figure(fast_ckpt, shipped_example, tmp_path, fake_comfy):
    """The Fast sampler node asks ComfyUI's free_memory for what the planner predicts the run allocates on
    the device (the CLI's `fast_memory`: the resident model, the caches, a chunk's work, the condition), so
    a window or fp8 K/V asks for less by exactly the caches they save."""
    nodes = fake_comfy(fast_ckpt, tmp_path)
    calls = nodes.memory.mm.free_memory_calls
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    files = resolve_fast_dir(fast_ckpt)
    asked, caches = {}, {}
    for window, kv in ((-1, "bf16"), (3, "fp8")):
        calls.clear()
        fast_sample(nodes, model, vae, image, window=window, kv=kv, camera=camera, text=text)
        # LingBot Speed's default camera_cache 'auto' keeps the camera injections where they fit: here (no VRAM)
        config = fast_run.fast_config(10.0, 5, window, 0, kv, camera_cache=True)
        need = fast_run.fast_memory(files, (6, *SIZE[:2]), config, None, 0, "auto", decode=False)
        assert calls == [(need.model + need.caches + need.work + need.condition, torch.device("cpu"))], window
        asked[window], caches[window] = calls[0][0], need.caches
        # the node decodes nothing (the VAE Decode node does): a chunk's decode is not asked for
        cli = fast_run.fast_memory(files, (6, *SIZE[:2]), config, None, 0, "auto")
        assert (
            need.work == need.work_forward < cli.work_decode == cli.work
            and asked[window] < cli.loop - cli.model
        )
    assert asked[-1] - asked[3] == caches[-1] - caches[3] > 0
    # camera_cache off: asked for less by exactly the kept injections
    (off,) = nodes.LingBotSpeed().options("sdpa", False, "none", 0.05, 7, 1, camera_cache="off")
    assert off.camera_cache is False
    calls.clear()
    fast_sample(nodes, model, vae, image, window=3, kv="fp8", camera=camera, text=text, speed=off)
    config = fast_run.fast_config(10.0, 5, 3, 0, "fp8", camera_cache=True)
    assert asked[3] - calls[0][0] == camera_cache_bytes(files.config, (6, *SIZE[:2]), config) > 0


def test_fast_node_turns_cuda_oom_into_a_clear_error(
    fast_ckpt, shipped_example, tmp_path, fake_comfy, monkeypatch
):
    """A CUDA out-of-memory during the chunks: the node's error names the phase as the CLI's does, and the
    model is released (not kept for the next run)."""
    nodes = fake_comfy(fast_ckpt, tmp_path)
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    text, vae, camera, image = node_inputs(nodes, shipped_example)
    loaded = []

    def run_chunks(session, *args):
        loaded.append(model._switcher.resident)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(fast_run, "run_chunks", run_chunks)
    with pytest.raises(RuntimeError) as err:
        fast_sample(nodes, model, vae, image, camera=camera, text=text)
    assert not isinstance(err.value, torch.OutOfMemoryError)
    assert str(err.value) == "LingBot-World-Fast: CUDA ran out of memory during chunks; models released"
    assert loaded == ["high"] and model._switcher is None


def test_fast_node_fit_check_names_the_widgets_that_fit(fast_ckpt, tmp_path, fake_comfy):
    """The node's fit check (run on CUDA with the free VRAM after ComfyUI made room) is the planner's for what
    the node runs (the chunks' forwards; the VAE Decode node decodes): None when the predicted peak fits, else
    its message with the settings that fit, as the node's widgets. Sized as the real v1 Fast model in NF4."""
    from dataclasses import replace

    nodes = fake_comfy(fast_ckpt, tmp_path)
    (model,) = nodes.LingBotFastLoader().load(FAST_DIR, False, 0.0)
    real = fast_run.ChunkedModel.of_kind(CHUNKED_KINDS["fast"])
    model = replace(model, config=real.config, nbytes={"high": real.nbytes, "low": real.nbytes})
    shape, config = (30, 58, 104), fast_run.fast_config(10.0, 5, -1, 0, "bf16")
    peak = fast_run.fast_memory(real, shape, config, None, 0, "auto", decode=False).peak
    with_decode = fast_run.fast_memory(real, shape, config, None, 0, "auto")
    assert peak < with_decode.peak  # at 464x832 a chunk's decode (which the node does not run) is the larger
    assert nodes.fast.fit_issue(model, shape, config, with_decode.peak - 1) is None  # no refusal for it
    assert nodes.fast.fit_issue(model, shape, config, peak) is None
    assert nodes.fast.fit_issue(model, shape, config, None) is None  # CPU: nothing to check
    message = nodes.fast.fit_issue(model, shape, config, peak - 1)
    assert message.startswith(f"predicted peak {peak / (1 << 30):.1f} GiB") and "--" not in message
    assert "would fit with local_attn_size" in message and " or kv_dtype fp8" in message
    assert nodes.fast.fit_issue(model, shape, config, 1).endswith(
        "fewer frames or a smaller max_area (or width/height)"
    )


# ------------------------------------------------------------------------- the decode worker (--decode_device)


def decode_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "lingbot-decode" and t.is_alive()]


@pytest.fixture
def chunks_seen(monkeypatch):
    """Every chunk the run hands on: (latent, video, ChunkTiming, the thread that handed it on)."""
    seen, real = [], fast_run.run_chunks

    def run_chunks(session, cameras, decoder, on_chunk, *decode_on):
        def record(latent, video, timing):
            seen.append((latent.clone(), video.clone(), timing, threading.current_thread().name))
            on_chunk(latent, video, timing)

        return real(session, cameras, decoder, record, *decode_on)

    monkeypatch.setattr(fast_run, "run_chunks", run_chunks)
    return seen


def ask_for_overlap(monkeypatch) -> None:
    """On the CPU no memory plan turns the overlap on: the run asks for it (as play's tests pass overlap=True)."""
    real = fast_run.check_devices
    monkeypatch.setattr(fast_run, "check_devices", lambda *a, **k: real(*a, **{**k, "overlap": True}))


@pytest.fixture
def overlap_asked(monkeypatch):
    ask_for_overlap(monkeypatch)


def test_fast_decode_worker_writes_the_serial_frames(
    fast_ckpt, shipped_example, tmp_path, capsys, offline, chunks_seen, monkeypatch
):
    """The decode in the worker (its own thread, beside the next chunk's DiT) hands on the serial decode's
    chunks, frames and MP4; with every option off (the CPU's default) the chunks are decoded in the run's
    thread, their frames the whole latent's exact decode."""
    runs = {}
    for name, extra in (("serial", []), ("worker", ["--decode_device", "cpu"])):
        if name == "worker":
            ask_for_overlap(monkeypatch)
        out = tmp_path / f"{name}.mp4"
        chunks_seen.clear()
        assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--frame_num", "33", *extra)) == 0
        runs[name] = list(chunks_seen), read_mp4_info(out), capsys.readouterr().out
    (serial, serial_mp4, serial_out), (worker, worker_mp4, worker_out) = runs["serial"], runs["worker"]
    assert serial_mp4 == worker_mp4 and serial_mp4["frames"] == 33
    assert [v.shape[1] for _, v, _, _ in worker] == [9, 12, 12]
    for (lat_a, video_a, t_a, _), (lat_b, video_b, t_b, _) in zip(serial, worker, strict=True):
        assert torch.equal(lat_a, lat_b) and torch.equal(video_a, video_b) and t_a.frames == t_b.frames
    assert {thread for *_, thread in serial} == {"MainThread"} and not any(t.overlap for _, _, t, _ in serial)
    assert {thread for *_, thread in worker} == {"lingbot-decode"} and all(t.overlap for _, _, t, _ in worker)
    assert "each chunk decodes while the next one is made" in worker_out
    assert "each chunk decodes while" not in serial_out and "chunk 3/3: denoise" in worker_out
    assert not decode_threads()
    whole = torch.cat([lat for lat, *_ in serial], dim=1)
    assert torch.equal(torch.cat([v for _, v, _, _ in serial], dim=1), offline.vae.decode(whole))


def test_fast_decode_worker_error_stops_the_run(
    fast_ckpt, shipped_example, tmp_path, capsys, chunks_seen, overlap_asked, monkeypatch
):
    """An error in the decode worker (the second chunk's frames cannot be written) is the run's one error:
    exit 2 with one line, the DiT at most one chunk ahead, no MP4 and no decode thread left."""
    real_add = fast_run.FrameSink.add

    def add(self, video):
        if self.count:
            raise OSError(28, "No space left on device")
        real_add(self, video)

    monkeypatch.setattr(fast_run.FrameSink, "add", add)
    made = []
    real_next = fast_run.FastSession.next_chunk

    def next_chunk(self, cam=None):
        made.append(self.done)
        return real_next(self, cam)

    monkeypatch.setattr(fast_run.FastSession, "next_chunk", next_chunk)
    out = tmp_path / "never.mp4"
    args = fast_args(fast_ckpt, shipped_example, out, "--frame_num", "45", "--decode_device", "cpu")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and len(err.strip().splitlines()) == 1, err
    assert (
        made == [0, 1, 2] and len(chunks_seen) == 2
    )  # of 4 chunks: chunk 2's hand-over raised chunk 1's error
    assert not out.exists() and not list(tmp_path.glob(".*partial*")) and not decode_threads()


def test_fast_plans_the_decode_device_apart(
    fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads, monkeypatch
):
    """--decode_device on another GPU: the DiT's device is planned without the VAE, the decode device with it
    (`fast_run.check_devices`, play's check); a refusal names the device that would not fit, before anything
    loads. Without it the first-frame encode and the decode count on the DiT's GPU."""
    from lingbot_world.session import planner

    monkeypatch.setattr(cli, "resolve_device", lambda text, flag="--device": torch.device(text))
    free = {}
    monkeypatch.setattr(planner, "free_memory", lambda device: (free[torch.device(device).index], None))
    out = tmp_path / "never.mp4"
    base = ["--device", "cuda:0", "--frame_num", "21", "--vae_tile", "none"]

    def refusal(*extra):
        assert cli.main(fast_args(fast_ckpt, shipped_example, out, *base, *extra)) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and not out.exists(), err
        return err

    free.update({0: 1 << 40, 1: 1})
    err = refusal("--decode_device", "cuda:1")
    assert "error: memory on cuda:1 (the decode device, where the VAE runs): predicted peak" in err
    free.update({0: 1, 1: 1 << 40})
    err = refusal("--decode_device", "cuda:1")
    assert "error: memory on cuda:0 (the DiT): predicted peak" in err and "first-frame encode" not in err
    err = refusal()  # the VAE on the DiT's GPU
    assert "error: memory: predicted peak" in err and "first-frame encode of 21 frames" in err

    # the figures: the decode device holds the VAE and a chunk's decode or the encode; the DiT's does not
    files = resolve_fast_dir(fast_ckpt)
    config = fast_run.fast_config(None, 0, None, None, "bf16", files.kind)
    shape, dit, vae = (6, 6, 14), torch.device("cuda:0"), torch.device("cuda:1")
    need = fast_run.fast_memory(files, shape, config, None, 0, None, **fast_run.vae_where(True, True))
    decode = fast_run.decode_memory(shape, config.chunk_frames)
    assert need.encode == need.work_decode == 0 and decode > 0
    check = functools.partial(fast_run.check_devices, files, shape, config, None, 0, None, "fp32", dit, vae)
    free.update({0: need.peak, 1: decode})
    assert check(planner.free_memory) == (True, config)  # apart: the decode overlaps the next chunk
    free[1] = decode - 1
    with pytest.raises(ValueError, match=r"^memory on cuda:1 \(the decode device"):
        check(planner.free_memory)
    free.update({0: need.peak - 1, 1: decode})
    with pytest.raises(ValueError, match=r"^memory on cuda:0 \(the DiT\)"):
        check(planner.free_memory)


def test_fast_camera_cache_on_with_swapped_blocks_is_one_clear_error(
    fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads
):
    out = tmp_path / "never.mp4"
    args = fast_args(fast_ckpt, shipped_example, out, "--camera_cache", "on", "--swap_blocks", "1")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and not out.exists(), err
    assert "--camera_cache on" in err and "--swap_blocks 1" in err, err


def test_fast_without_a_camera_keeps_no_camera_injections(
    fast_ckpt, shipped_example, tmp_path, capsys, monkeypatch
):
    """No camera (no path, preset or keys): nothing to keep, so 'auto' and on are planned and run as off."""
    asked = []

    def check_devices(files, lat_shape, config, *args, **kwargs):
        asked.append(config.camera_cache)
        raise ValueError("stop here")

    monkeypatch.setattr(fast_run, "check_devices", check_devices)
    out = tmp_path / "never.mp4"
    for extra, want in (
        ((), False),
        (("--camera_cache", "on"), False),
        (("--action_path", str(shipped_example)), "auto"),
    ):
        assert cli.main(fast_args(fast_ckpt, shipped_example, out, "--frame_num", "9", *extra)) == 2
        assert "stop here" in capsys.readouterr().err
        assert asked.pop() == want, extra


def test_check_devices_decides_the_camera_cache(fast_ckpt, monkeypatch):
    """--camera_cache auto: on where the plan fits it beside the overlap, off where it fits only without it (the
    overlap kept first) and with blocks swapped; on the CPU (no plan) on with none swapped. Asked for on, it is
    counted (a refusal says so) and refused with blocks swapped."""
    monkeypatch.setattr(fast_run, "first_frame_encode", lambda *a: 0)  # the tiny model's peak: the chunk loop
    files = resolve_fast_dir(fast_ckpt)
    auto = fast_run.fast_config(None, 0, None, None, "bf16", files.kind, camera_cache="auto")
    shape, gpu, cpu = (6, 6, 14), torch.device("cuda:0"), torch.device("cpu")

    def need(camera, overlap, swap=0):
        config = replace(auto, camera_cache=camera)
        return fast_run.fast_memory(
            files, shape, config, None, swap, None, **fast_run.vae_where(False, overlap)
        ).peak

    cams = need(True, True) - need(False, True)
    assert cams == camera_cache_bytes(files.config, shape, replace(auto, camera_cache=True)) > 0

    def check(vram, config=auto, swap=0, device=gpu):
        free = lambda device: (vram, None)  # noqa: E731
        overlap, decided = fast_run.check_devices(
            files, shape, config, None, swap, None, "fp32", device, device, free
        )
        assert replace(decided, camera_cache=config.camera_cache) == config  # nothing else changes
        return overlap, decided.camera_cache

    # (overlap, camera cache): the first of these that fits
    tries = [(True, True), (True, False), (False, True), (False, False)]
    for vram in sorted({need(c, o) for o, c in tries}):
        assert check(vram) == next((o, c) for o, c in tries if need(c, o) <= vram)
    assert check(need(False, True)) == (True, False)  # the overlap before the camera cache
    with pytest.raises(ValueError, match="predicted peak"):
        check(min(need(c, o) for o, c in tries) - 1)
    assert check(1 << 50, swap=1) == (True, False)
    assert check(None, device=cpu) == (False, True)
    on = replace(auto, camera_cache=True)
    with pytest.raises(
        ValueError, match="attention and camera caches .* would fit with .*--camera_cache off"
    ):
        check(need(True, False) - 1, on)
    with pytest.raises(ValueError, match=r"--camera_cache on: .* --swap_blocks 2"):
        fast_run.check_camera_cache(on, 2)
    fast_run.check_camera_cache(auto, 2)


def test_fast_decode_worker_takes_the_compile_warm_up_one_chunk_at_a_time():
    """With compiled blocks the DiT traces at the first chunk that rolls the window (v1 Fast, window 6: chunk
    2); a compiled decoder must not run beside that trace, so the worker decodes chunks 0..2 before the next
    chunk starts, and only later chunks beside the next one's DiT."""
    config = fast_run.fast_config(None, 0, 6, 0, "bf16", compile=True)
    assert fast_run.compile_warm_chunks(config, 5) == 3 and fast_run.compile_warm_chunks(config, 2) == 2
    assert fast_run.compile_warm_chunks(fast_run.fast_config(None, 0, -1, 0, "bf16", compile=True), 5) == 0
    started = [threading.Event() for _ in range(6)]  # chunk k's DiT has started
    beside = {}  # chunk k's decode: whether chunk k + 1's DiT ran beside it

    class Session:
        device, num_chunks, done = torch.device("cpu"), 5, 0

        def __init__(self):
            self.config = config

        def next_chunk(self, cam):
            started[self.done].set()
            self.done += 1
            return torch.full((16, 3, 2, 2), float(self.done - 1))

        def kv_cache_bytes(self):
            return 0

    class Decoder:
        def decode(self, latent):
            k = int(latent[0, 0, 0, 0])
            beside[k] = started[k + 1].wait(600 if k == 3 else 0)
            return torch.zeros(3, 12, 16, 16)

    seen = []
    made = fast_run.run_chunks(Session(), iter([None] * 5), Decoder(), lambda *a: seen.append(a[2]), "cpu")
    assert made == 5 and [t.index for t in seen] == list(range(5)) and not decode_threads()
    assert beside == {0: False, 1: False, 2: False, 3: True, 4: False}
    assert [t.overlap for t in seen] == [False, False, False, True, True]
