"""The standalone play page: an aiohttp server around one `PlaySession`.

GET / serves the page (web/play/index.html; GET /play_client.js its module, web/comfyui's), GET /stats the
session's numbers as JSON, GET /ws the stream:
- down, binary: a 64-byte header, little endian: uint32 frame index, uint32 rollout, uint32 latent frame,
  float32 send time offset (unused, 0), the latent frame's c2w as 12 float32 (3 rows of 4), then one JPEG;
- down, text JSON: {"type": "hello", "role": "control"|"viewer", ...}, {"type": "stats", ...} after each chunk,
  {"type": "error", "message": ...}, {"type": "end", "reason": ...};
- up, text JSON: {"type": "key", "key": "KeyW", "down": true}, {"type": "look", "dx": 3, "dy": -1},
  {"type": "prompt", "text": "..."}, {"type": "restart"}, {"type": "stop"}.
Frames are paced (session.pacer): they leave one interval apart at the recent production rate, a small buffer
ahead, instead of in a burst per chunk; text messages keep their place among them. The stats add the pacer's
figures (`shown_*`: FPS, frame gaps and key->pixel as shown, i.e. sent; `pace_delay_*`) to the session's
(hand-out figures). The first client controls the session; later ones are viewers (frames only; their input
is refused with an error message). The controlling client's socket closing (tab closed) or "stop" ends the
session: the loop stops after the chunk in progress and the model and caches are freed.
"""

import asyncio
import contextlib
import io
import json
import struct
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np
from aiohttp import WSMsgType, web

from ..wan.config import VAE_STRIDE
from .pacer import Pacer
from .play import PlayFrame, PlaySession

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
HEADER = struct.Struct("<IIIf12f")
JPEG_QUALITY = 85


def page_dir() -> Path:
    return Path(str(resources.files(__package__.rpartition(".")[0]).joinpath("web", "play")))


def frame_message(frame: PlayFrame, quality: int = JPEG_QUALITY) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame.image.numpy()).save(buf, format="JPEG", quality=quality)
    pose = np.asarray(frame.pose, dtype=np.float32)[:3].reshape(12)
    return HEADER.pack(frame.index, frame.rollout, frame.latent, 0.0, *pose.tolist()) + buf.getvalue()


def parse_frame_message(data: bytes) -> tuple[int, int, int, np.ndarray, bytes]:
    """(index, rollout, latent frame, c2w [3, 4], JPEG bytes) of a binary frame message (clients, tests)."""
    index, rollout, latent, _, *pose = HEADER.unpack_from(data)
    return index, rollout, latent, np.array(pose, dtype=np.float32).reshape(3, 4), data[HEADER.size :]


def host_warning(host: str) -> str | None:
    if host in LOCAL_HOSTS:
        return None
    return (
        f"WARNING: --host {host}: the play page, and with it control of this machine's GPU, is open to anyone "
        "who can reach this address; there is no password. Leave --host out to serve 127.0.0.1 only."
    )


class PlayServer:
    """Serve `session` (not started yet) from `image` + `prompt` on host:port until the controlling client
    leaves. `record`: a callable taking each PlayFrame (the CLI's MP4 recorder), called in the play thread.
    `pace`: False sends each frame as soon as it is made (the shown figures are still reported)."""

    def __init__(
        self, session: PlaySession, image, prompt: str, host="127.0.0.1", port=8765, record=None, pace=True
    ):
        self.session, self.image, self.prompt = session, image, prompt
        self.host, self.port, self.record = host, port, record
        self.error: BaseException | None = None
        self.ready = threading.Event()  # the model is loaded and the first rollout set up
        self.bound = threading.Event()
        self.end_reason = None
        self._stop = threading.Event()
        self._controller = None
        self._controller_here = threading.Event()
        self._clients: dict = {}  # ws -> asyncio.Queue
        self._loop = None
        self._done = None
        self.check = None  # called between chunks and while waiting (a front end's interrupt check)
        self.stats = None
        per_chunk = session.chunk * VAE_STRIDE[0]
        self.pacer = Pacer(self._broadcast, per_chunk, pace=pace, clock=session.clock)
        session.on_frame = self._on_frame

    # --- the play thread ---------------------------------------------------------------------------------

    def _on_frame(self, frame: PlayFrame) -> None:
        if self.record is not None:
            self.record(frame)
        self.pacer.push(frame_message(frame), keys=frame.keys)

    def _broadcast(self, payload) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for queue in list(self._clients.values()):
            loop.call_soon_threadsafe(queue.put_nowait, payload)

    def stats_now(self) -> dict:
        """The session's figures and the pacer's."""
        return {**self.session.stats(), **self.pacer.stats()}

    def _work(self) -> None:
        self.pacer.start()
        try:
            self.session.start(self.image, self.prompt)
            self.ready.set()
            self.pacer.push(json.dumps({"type": "ready"}), frame=False)
            while not self._stop.is_set():
                if self.check is not None:
                    self.check()
                if not self._controller_here.wait(0.1):
                    self.session.idle()  # sequence parallel: the other ranks hear from rank 0 while it waits
                    continue
                made = self.session.step()
                self.pacer.produced(self.session.chunk_seconds[-1], made)
                self.pacer.push(json.dumps({"type": "stats", **self.stats_now()}), frame=False)
            self.session.flush()  # the last chunk's frames, still in the decoder, go out before the pacer stops
        except BaseException as err:  # reported by serve(); the clients are told
            self.error = err
            self.pacer.push(
                json.dumps({"type": "error", "message": f"{type(err).__name__}: {err}"}), frame=False
            )
        finally:
            self.pacer.close()
            self.stats = self.stats_now()
            self.session.close()
            self._broadcast(json.dumps({"type": "end", "reason": self.end_reason or "error"}))
            loop = self._loop
            if loop is not None and not loop.is_closed() and self._done is not None:
                loop.call_soon_threadsafe(self._done.set)

    def run_here(self, loop) -> dict:
        """Play in this thread, the clients served by `loop` (another thread's running event loop, e.g.
        ComfyUI's, whose routes call `handle_ws`); returns the final stats (raises what stopped the session)."""
        self._loop = loop
        self._work()
        with contextlib.suppress(Exception):  # a closed loop: the clients went with it
            asyncio.run_coroutine_threadsafe(self._close_clients(), loop).result(timeout=30)
        if self.error is not None:
            raise self.error
        return self.stats

    def stop(self, reason: str = "stopped") -> None:
        """End the session (any thread)."""
        self.end_reason = self.end_reason or reason
        self._stop.set()

    # --- the web side ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        pages = page_dir()
        app.router.add_get("/", lambda r: web.FileResponse(pages / "index.html"))
        shared = (
            pages.parent / "comfyui" / "play_client.js"
        )  # the page's module, shared with the ComfyUI panel
        app.router.add_get("/play_client.js", lambda r: web.FileResponse(shared))
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/ws", self.handle_ws)
        app.router.add_static("/static", pages)
        return app

    async def _stats(self, request) -> web.Response:
        return web.json_response(
            {**self.stats_now(), "ready": self.ready.is_set(), "clients": len(self._clients)}
        )

    async def handle_ws(self, request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        control = self._controller is None and not self._stop.is_set()
        if control:
            self._controller = ws
        queue: asyncio.Queue = asyncio.Queue()
        self._clients[ws] = queue
        size = self.session.size
        await ws.send_str(
            json.dumps(
                {
                    "type": "hello",
                    "role": "control" if control else "viewer",
                    "mode": self.session.controls.mode,
                    "ready": self.ready.is_set(),
                    "size": None if size is None else list(size[2:]),
                    "prompt": self.prompt,
                }
            )
        )
        sender = asyncio.create_task(self._send(ws, queue))
        if control:
            self._controller_here.set()
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                reply = self._handle(msg.data, control)
                if reply is not None:
                    await ws.send_str(json.dumps(reply))
        finally:
            self._clients.pop(ws, None)
            sender.cancel()
            if control:
                self.stop("the controlling client left")
        return ws

    async def _send(self, ws, queue) -> None:
        while True:
            payload = await queue.get()
            if ws.closed:
                return
            try:
                if isinstance(payload, bytes):
                    await ws.send_bytes(payload)
                else:
                    await ws.send_str(payload)
            except ConnectionError:
                return

    def _handle(self, text: str, control: bool) -> dict | None:
        try:
            msg = json.loads(text)
            kind = msg["type"]
        except (ValueError, KeyError, TypeError):
            return {"type": "error", "message": "expected a JSON object with a 'type'"}
        if not control:
            return {"type": "error", "message": "viewer: another client controls this session"}
        s = self.session
        if kind == "key":
            if not s.key(msg.get("key"), bool(msg.get("down"))):
                return None  # unknown keys are ignored
        elif kind == "look":
            try:
                s.look(float(msg.get("dx", 0)), float(msg.get("dy", 0)))
            except (TypeError, ValueError):
                return {"type": "error", "message": "look: dx and dy must be numbers"}
        elif kind == "prompt":
            try:
                s.set_prompt(msg.get("text"))
            except ValueError as err:
                return {"type": "error", "message": str(err)}
        elif kind == "restart":
            s.restart()
        elif kind == "stop":
            self.stop("stop asked by the client")
        else:
            return {"type": "error", "message": f"unknown message type {kind!r}"}
        return None

    # --- run --------------------------------------------------------------------------------------------

    async def _main(self, on_bound=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            raise OSError(
                f"--port: cannot listen on {self.host}:{self.port} ({err.strerror or err}); is another "
                "server using it? Pick another --port"
            ) from None
        self.port = site._server.sockets[0].getsockname()[1]
        self.bound.set()
        if on_bound is not None:
            on_bound(self)
        worker = threading.Thread(target=self._work, name="play", daemon=True)
        worker.start()
        try:
            await self._done.wait()
        finally:
            self.stop("server shut down")
            await self._loop.run_in_executor(None, worker.join)
            await self._close_clients()
            await runner.cleanup()

    async def _close_clients(self) -> None:
        for _ in range(200):  # let the clients' queues (the "end" message last) drain, 2 s at most
            if all(q.empty() for q in self._clients.values()):
                break
            await asyncio.sleep(0.01)
        for ws in list(self._clients):
            await ws.close()

    def serve(self, on_bound=None) -> dict:
        """Run until the session ends; returns its final stats (raises what stopped the session)."""
        try:
            asyncio.run(self._main(on_bound))
        except KeyboardInterrupt:
            self.stop("interrupted")
            raise
        if self.error is not None:
            raise self.error
        return self.stats

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def announce(server: PlayServer) -> None:
    print(f"play: open {server.url} (loading the model; Ctrl-C or closing the tab stops)", flush=True)


def wait_port(server: PlayServer, timeout: float = 60.0) -> int:
    """The bound port once the server listens (tests and scripted clients running serve() in a thread)."""
    end = time.monotonic() + timeout
    while not server.bound.wait(0.05):
        if time.monotonic() > end or server.error is not None:
            raise RuntimeError(f"the play server did not start: {server.error}")
    return server.port
