"""The standalone play server (session.play_server) and `lingbot-world play` on the tiny Fast checkpoint."""

import asyncio
import contextlib
import json
import os
import re
import socket
import threading
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers import fast_args, headless_chromium
from lingbot_world import cli
from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
from lingbot_world.session import play, play_server


def start_server(fast_ckpt, shipped_example, mode="hold", host="127.0.0.1"):
    """A tiny play session served on a free port from a thread: (server, thread, result dict)."""
    session = play.PlaySession(
        resolve_fast_dir(fast_ckpt), "cpu", area=64 * 112, t5_mode="inprocess", mode=mode, condition_frames=4
    )
    image = cli.load_image(shipped_example / "image.jpg")
    server = play_server.PlayServer(session, image, "a castle", host, 0)
    result = {}

    def serve():
        try:
            result["stats"] = server.serve()
        except BaseException as err:  # the test reads it
            result["error"] = err

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    play_server.wait_port(server)
    return server, thread, result


async def frames_until(ws, count, texts, timeout=600.0):
    """Binary frame messages until `count` arrived; text messages go to `texts`."""
    out = []
    while len(out) < count:
        msg = await ws.receive(timeout=timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            out.append(play_server.parse_frame_message(msg.data))
        elif msg.type == aiohttp.WSMsgType.TEXT:
            texts.append(json.loads(msg.data))
        else:
            raise AssertionError(f"socket ended after {len(out)} frames: {msg}")
    return out


def test_websocket_protocol(fast_ckpt, shipped_example):
    """Frames come in order with their indices and poses (paced); the controller's key reaches the session (hold
    mode: W pressed after the first frame moves the camera forward from a later chunk on) and its key->pixel is
    measured to the show time; a second client is a viewer whose input is refused; /play_client.js and /stats answer; closing the
    controller's socket ends the session."""
    server, thread, result = start_server(fast_ckpt, shipped_example)
    url = f"http://127.0.0.1:{server.port}"

    async def scenario():
        async with aiohttp.ClientSession() as http:
            page = await http.get(url + "/")
            assert page.status == 200 and "LingBot-World Play" in await page.text()
            module = await http.get(url + "/play_client.js")  # the page's script, shared with ComfyUI's panel
            assert module.status == 200 and "javascript" in module.content_type
            assert "export function readFrame" in await module.text()
            ctl = await http.ws_connect(url + "/ws")
            hello = json.loads((await ctl.receive(timeout=60)).data)
            assert hello["type"] == "hello" and hello["role"] == "control" and hello["mode"] == "hold"
            viewer = await http.ws_connect(url + "/ws")
            assert json.loads((await viewer.receive(timeout=60)).data)["role"] == "viewer"
            await viewer.send_str(json.dumps({"type": "key", "key": "KeyS", "down": True}))
            texts, viewer_texts = [], []
            first = await frames_until(ctl, 1, texts)
            await ctl.send_str(json.dumps({"type": "key", "key": "KeyW", "down": True}))
            await ctl.send_str(json.dumps({"type": "key", "key": "KeyZ", "down": True}))  # ignored
            await ctl.send_str("not json")
            frames = first + await frames_until(ctl, 32, texts)  # chunks 0..2: 9 + 12 + 12
            seen = await frames_until(viewer, 1, viewer_texts)
            stats = await (await http.get(url + "/stats")).json()
            await ctl.close()
            rest = []
            async for msg in viewer:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    rest.append(json.loads(msg.data))
            return frames, texts, seen, viewer_texts, stats, rest

    frames, texts, seen, viewer_texts, stats, rest = asyncio.run(scenario())
    thread.join(120)
    assert not thread.is_alive() and "error" not in result
    assert [f[0] for f in frames] == list(range(33))
    assert [f[2] for f in frames] == [0] + [i for i in range(1, 9) for _ in range(4)]
    assert all(f[4][:2] == b"\xff\xd8" for f in frames)  # JPEG
    assert np.allclose(frames[0][3], np.eye(4)[:3])
    z = [f[3][2, 3] for f in frames]
    assert z[-1] > 0 and all(b >= a for a, b in zip(z, z[1:], strict=False))  # W moved it forward only
    assert any(t["type"] == "error" and "JSON" in t["message"] for t in texts)
    assert any(t["type"] == "stats" for t in texts)
    assert any(t["type"] == "error" and "viewer" in t["message"] for t in viewer_texts)
    assert seen[0][0] >= 0 and stats["frames"] >= 1 and stats["ready"] is True
    assert any(t["type"] == "end" for t in rest)
    assert result["stats"]["key_events_measured"] == 1  # W; S came from the viewer, Z drives nothing
    # the frames went through the pacer, which measured W's key->pixel to its frame's show time
    assert result["stats"]["paced"] is True and result["stats"]["pace_interval_s"] > 0
    assert result["stats"]["shown_keys_measured"] == 1 and result["stats"]["shown_key_to_pixel_p50_s"] > 0
    assert any("shown_fps" in t for t in texts if t["type"] == "stats")
    assert server.session.closed and server.session._model is None


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def play_args(fast_ckpt, shipped_example, *extra):
    args = fast_args(fast_ckpt, shipped_example, "unused.mp4", *extra)
    i = args.index("--output")
    return ["play", *args[1:i], *args[i + 2 :]]


def test_busy_port_is_refused_before_loading(fast_ckpt, shipped_example, busy_port, capsys, nothing_loads):
    assert cli.main(play_args(fast_ckpt, shipped_example, "--port", str(busy_port))) == 2
    err = capsys.readouterr().err
    assert f"--port: cannot listen on 127.0.0.1:{busy_port}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:7", "--decode_device cuda:7: "),  # no such GPU (none at all, or fewer)
        ("meta", "--decode_device: only cpu and cuda are supported, got 'meta'"),
        ("gpu:1", "--decode_device: expected cpu, cuda or cuda:N, got 'gpu:1'"),
    ],
)
@pytest.mark.parametrize("command", ["play", "fast"])
def test_bad_decode_device_is_refused_before_loading(
    fast_ckpt, shipped_example, tmp_path, command, device, message, capsys, nothing_loads
):
    out = tmp_path / "never.mp4"
    args = ["--decode_device", device] + (["--port", "0"] if command == "play" else [])
    if command == "play":
        argv = play_args(fast_ckpt, shipped_example, *args)
    else:
        argv = fast_args(fast_ckpt, shipped_example, out, *args)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("--decode_device") == 1 + err.count("or use --decode_device")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert "--decode_device DECODE_DEVICE" in capsys.readouterr().out


def test_other_host_warns_loudly(fast_ckpt, shipped_example, capsys, nothing_loads):
    """--host other than loopback: a warning before anything else (here the port is busy on all addresses
    too, so the run stops there)."""
    assert play_server.host_warning("127.0.0.1") is None
    args = play_args(fast_ckpt, shipped_example, "--host", "0.0.0.0", "--port", "0")
    with socket.socket() as other:
        other.bind(("0.0.0.0", 0))
        other.listen(1)
        args[-1] = str(other.getsockname()[1])
        assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "WARNING: --host 0.0.0.0" in err and "no password" in err and "--port: cannot listen" in err


def test_record_needs_a_free_name(fast_ckpt, shipped_example, tmp_path, capsys, nothing_loads):
    taken = tmp_path / "out.mp4"
    taken.write_bytes(b"x")
    assert cli.main(play_args(fast_ckpt, shipped_example, "--record", str(taken), "--port", "0")) == 2
    assert "exists" in capsys.readouterr().err and taken.read_bytes() == b"x"


@pytest.mark.slow
def test_browser_plays_with_keys(fast_ckpt, shipped_example, tmp_path):
    """Headless Chromium opens the page, W then the right arrow are pressed on the picture; frames arrive and
    the page's camera log moves forward, then turns right."""
    with headless_chromium(tmp_path / "chrome") as driver:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        server, thread, result = start_server(fast_ckpt, shipped_example)
        driver.get(server.url)
        log = lambda: driver.execute_script("return window.playLog")  # noqa: E731
        WebDriverWait(driver, 600).until(lambda d: len(log()) >= 1)
        picture = driver.find_element(By.ID, "frame")
        ActionChains(driver).click(picture).key_down("w").perform()
        WebDriverWait(driver, 600, 0.5).until(lambda d: log()[-1]["z"] > 0.1)
        ActionChains(driver).key_up("w").key_down(Keys.ARROW_RIGHT).perform()
        WebDriverWait(driver, 600, 0.5).until(lambda d: log()[-1]["yaw"] > 5)
        entries = log()
        assert [e["index"] for e in entries] == sorted(e["index"] for e in entries)
        stats = lambda: driver.execute_script("return window.playStats")  # noqa: E731
        shown = lambda: driver.execute_script("return window.playShown")  # noqa: E731
        WebDriverWait(driver, 600, 0.5).until(
            lambda d: (
                (stats().get("shown_key_to_pixel_p50_s") or 0) > 0 and (stats().get("shown_fps") or 0) > 0
            )
        )
        before = shown()
        WebDriverWait(driver, 600, 0.5).until(lambda d: shown() > before + 4)
        hud = driver.find_element(By.ID, "hud").text
        key_ms = re.search(r"key→pixel\s+p50 (\d+) ms p95 (\d+) ms", hud)
        assert key_ms and 0 < int(key_ms[1]) <= int(key_ms[2]), hud
        fps = re.search(r"FPS as played ([\d.]+)", hud)
        assert fps and float(fps[1]) > 0, hud
        page = stats()
        print(
            f"browser: key->pixel (shown) p50 {key_ms[1]} ms p95 {key_ms[2]} ms over "
            f"{page['shown_keys_measured']} events, FPS as played {fps[1]}, {shown()} frames shown"
        )
    thread.join(120)  # the tab is gone: the session ends
    assert not thread.is_alive() and "error" not in result
    assert result["stats"]["key_events_measured"] >= 2


def test_cli_play_records_the_clip_and_a_replayable_camera(fast_ckpt, shipped_example, tmp_path, monkeypatch):
    """`play --record`: a client plays 2 chunks with W held (hold mode) and stops; the MP4 holds every played
    frame and out_camera/ a pose per played frame whose latent frames (as `fast --action_path` spreads them)
    are the poses that were played."""
    from lingbot_world.loaders.camera_files import load_camera_dir
    from lingbot_world.loaders.video import read_mp4_info
    from lingbot_world.wan.camera import interpolate_poses

    servers = []
    monkeypatch.setattr(play_server, "announce", servers.append)
    monkeypatch.setattr(play, "CONDITION_FRAMES", 4)
    out = tmp_path / "out.mp4"
    args = play_args(fast_ckpt, shipped_example, "--port", "0", "--mode", "hold", "--record", str(out))
    rc = []
    thread = threading.Thread(target=lambda: rc.append(cli.main(args)), daemon=True)
    thread.start()
    for _ in range(600):
        if servers or not thread.is_alive():
            break
        thread.join(0.1)
    assert servers, "the server did not start"
    server = servers[0]

    async def client():
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(server.url + "ws")
            await ws.receive(timeout=60)
            await ws.send_str(json.dumps({"type": "key", "key": "KeyW", "down": True}))
            texts = []
            frames = await frames_until(ws, 21, texts)
            await ws.send_str(json.dumps({"type": "stop"}))
            async for _ in ws:
                pass
            return frames

    frames = asyncio.run(client())
    thread.join(300)
    assert rc == [0]
    played = server.session.frames
    assert played >= 21 and [f[0] for f in frames] == list(range(21))
    assert read_mp4_info(out)["frames"] == played
    camera = load_camera_dir(tmp_path / "out_camera")
    poses = camera["poses"]
    assert poses.shape == (played, 4, 4) and camera["intrinsics"].shape == (1, 4)
    latent = (played - 1) // 4 + 1
    want = np.stack(server.session.poses)
    np.testing.assert_allclose(interpolate_poses(poses, latent).numpy(), want, atol=1e-5)
    assert want[-1][2, 3] > 0  # W walked forward


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--port", "70000"], "--port: expected 0..65535, got 70000"),
        (["--local_attn_size", "-1"], "play runs without end, so its attention cache needs a window"),
        (["--mode", "toggle"], "argument --mode: invalid choice"),
    ],
)
def test_bad_play_flags_fail_before_loading(fast_ckpt, shipped_example, capsys, nothing_loads, extra, needle):
    with pytest.raises(SystemExit) if extra[0] == "--mode" else contextlib.nullcontext():
        assert cli.main(play_args(fast_ckpt, shipped_example, *extra)) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_play_refuses_a_degree_that_does_not_split_the_heads(
    fast_ckpt, shipped_example, capsys, nothing_loads
):
    """--ulysses_size is checked as `fast` checks it, before anything loads: a degree that does not divide the
    tiny DiT's 4 heads names those that do; a good one outside torchrun says how to launch it."""
    assert cli.main(play_args(fast_ckpt, shipped_example, "--ulysses_size", "3")) == 2
    err = capsys.readouterr().err
    assert "--ulysses_size 3 must divide the model's 4 attention heads (1, 2, 4)" in err, err
    assert len(err.strip().splitlines()) == 1
    assert cli.main(play_args(fast_ckpt, shipped_example, "--ulysses_size", "2")) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc_per_node 2 lingbot.py play" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_play_under_torchrun_stops_every_rank(fast_ckpt, shipped_example, tmp_path):
    """`torchrun --nproc_per_node 2 lingbot.py play ... --ulysses_size 2`: rank 0 alone announces the page and
    serves frames (of chunks both ranks ran); closing the controlling socket ends both ranks cleanly."""
    import subprocess
    import sys

    from helpers import free_port

    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    args = play_args(fast_ckpt, shipped_example, "--port", "0", "--ulysses_size", "2")
    script = str(Path(cli.__file__).resolve().parent / "lingbot.py")
    env = {**os.environ, "LINGBOT_WORLD_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [*launch, str(free_port()), script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = None
        for line in proc.stdout:
            found = re.search(r"play: open (http://\S+/)", line)
            if found:
                url = found[1]
                break
        assert url, proc.stderr.read()[-3000:]

        async def client():
            async with aiohttp.ClientSession() as http:
                ws = await http.ws_connect(url + "ws")
                await ws.send_str(json.dumps({"type": "key", "key": "KeyW", "down": True}))
                frames = await frames_until(ws, 21, [])
                await ws.close()
                return frames

        frames = asyncio.run(client())
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert [f[0] for f in frames] == list(range(21))
    assert out.count("play ended (the controlling client left)") == 1 and "Traceback" not in err
