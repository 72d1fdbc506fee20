"""Live play: one long-lived chunked model session steered by keys and mouse, frames handed out as they decode.

`PlaySession(files, device, ...)` loads nothing until `start(image, prompt)`; the text encoder's output (cached
per prompt), the VAE, the i2v condition (cached per image) and the DiT stay until `close()`. `step()` makes
one chunk: the input gathered since the last chunk (`controls`, fed by `key`/`look` from any thread) becomes
the chunk's camera poses, the DiT denoises the chunk (`wan.fast.FastSession` in stream mode) and the latent
is decoded one latent frame at a time, each frame handed to `on_frame(PlayFrame)` as soon as it is on the host
(on a GPU, once the next latent frame's decode is queued): a rollout's first latent frame gives 1 frame, every
later one 4.

With compiled blocks (`compile`), `start` first plays the chunks up to the attention window's first roll unseen
(the blocks compile there) and then starts the rollout over, so the picture never stops mid-play to compile.

A rollout restarts from the image (new caches, same model) on `restart()` or when its latent frames reach the
RoPE table's length; `set_prompt` applies from the next chunk. The attention window bounds the caches of an
endless rollout, so play needs one (`--local_attn_size`; models documented without one play at
`PLAY_WINDOW`), and the memory plan is checked before anything loads on a GPU.

The i2v condition (mask + the VAE latent of the image followed by zero frames) is encoded exactly for the
first `CONDITION_FRAMES` latent frames; later latent frames reuse its last frame (the encoder's causal state
after a long run of zero frames changes less and less from one latent frame to the next).

Decoding runs in a worker thread (`DecodeWorker`, its own CUDA stream) on `decode_device` (default: the DiT's
device), where the VAE lives: `step()` hands the chunk's latent over and returns, and with `overlap` the next
chunk's input and DiT run while it decodes (at most one chunk in the decoder; the next one's hand-over waits for
it). On one GPU the two share its memory: `overlap` None (the default) turns it on there when the memory plan
fits the forward and the decode side by side (`check_memory`), else `step()` waits for its frames.
Either way the frames, their poses and key stamps are the same. The latent goes to the decoder once the chunk's
last step is queued, so its decode can start beside the commit pass (which only refreshes the cache from it). The
worker queues each latent frame's decode before it hands out the previous one's frames (copied to pinned host
memory; the front end's JPEG encoding runs then), so the GPU's decode does not wait on the host. A
chunk reads its input only once the previous chunk's DiT, commit included, is done on the GPU (the host would
otherwise run ahead and queue it behind that DiT, and every key would wait that much longer).

Timing: `stats()` reports FPS as played (frames after the first chunk divided by their wall time), seconds per
chunk (with `overlap`: the slower of the DiT and the decode) and the decode's, key->pixel latency (from a key
or mouse event's arrival to the hand-out of the first frame of the latent frame it landed in) as p50/p95,
`read_to_frame` (per chunk, from its input's read to the hand-out of the first frame a key can land in: in hold
mode a key's key->pixel is its wait for the next read plus this), and the device memory. Those are hand-out
figures (the frames shown as they are made); each frame carries the arrival times of the events it answers
(`PlayFrame.keys`), so a front end that paces the frames (session.pacer) measures key->pixel to the frame's show
time.

Sequence parallel (`ranks` > 1, every rank in a `session.distributed.process_group`): rank 0 is the session
above (text encoder, VAE, condition, keys, camera, decode, the front end); every rank holds the DiT with its
share of the heads (`wan.parallel`) and runs each chunk's forwards in lockstep. Before each chunk rank 0 sends
the others their order (`distributed.broadcast_message`): the chunk's camera, a new rollout's seed and text
context, a changed prompt's context; the others run `follow()`, which ends on rank 0's stop (sent by
`close()`). While no chunk is asked for, rank 0's `idle()` sends a keep-alive, so the others' wait stays
within the process group's timeout; a follower whose rank 0 vanished raises `distributed.PeerLost`.
"""

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..loaders import text_encode
from ..loaders.vae import load_vae
from ..wan import i2v
from ..wan.camera_presets import DEFAULT_HFOV_DEG
from ..wan.config import ROPE_FRAMES, VAE_STRIDE
from ..wan.fast import FastSession
from ..wan.parallel import SequenceParallel
from ..wan.vae import ChunkDecoder, decode_dtype, decoder_levers
from . import distributed, fast_run
from .controls import ChunkCamera, Controls
from .decode_worker import DecodeWorker, frames_to_host, hand_over, queued_end, same_device
from .planner import GIB, free_memory

PLAY_WINDOW = (18, 6)  # (window, sink) for a model documented with an unbounded cache (v1 Fast)
CONDITION_FRAMES = 32  # latent frames of the i2v condition encoded exactly (125 video frames)
# longest rank 0 stays silent while idle: well within the process group's timeout the followers wait under
KEEPALIVE_S = min(60.0, distributed.TIMEOUT.total_seconds() / 4)


@dataclass(frozen=True)
class PlayFrame:
    index: int  # frames handed out since start, over all rollouts
    rollout: int
    latent: int  # latent frame of the rollout it belongs to
    image: torch.Tensor  # uint8 [H, W, 3] on the CPU
    pose: np.ndarray  # the latent frame's c2w [4, 4] in the rollout's world frame
    keys: tuple = ()  # arrival times of the input events that landed in this frame's latent frame (its first)


def rollout_latent_frames(chunk: int) -> int:
    """A rollout's length in latent frames: the RoPE table's, in whole chunks."""
    return ROPE_FRAMES - ROPE_FRAMES % chunk


def keyed_latent(first_latent: int, slot: int = 0) -> int:
    """The rollout's latent frame that input slot `slot` of a chunk starting at latent frame `first_latent` lands
    in: a rollout's first latent frame is the image, so its first chunk's slots start at latent frame 1."""
    return first_latent + (first_latent == 0) + slot


def percentile(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


@dataclass(frozen=True)
class DecodeJob:
    """A chunk for the decode worker: its latent on the decode device (`decode_worker.hand_over`)."""

    decoder: ChunkDecoder
    latent: torch.Tensor  # [16, n, h, w]
    rollout: int
    first_latent: int  # the latent frame of the rollout its first one is
    poses: list
    keys: dict  # latent frame of the rollout -> arrival times of the events that landed in it
    read: float  # when the chunk's input was read


class PlaySession:
    def __init__(
        self,
        files,
        device,
        *,
        seed: int = 42,
        shift: float | None = None,
        local_attn_size: int | None = None,
        sink_size: int | None = None,
        kv_dtype: str = "bf16",
        compile: bool = False,
        attention: str = "sdpa",
        camera_cache: bool | str = "auto",
        fp8_accum: str = "exact",
        quantize: bool | None = None,
        swap: int = 0,
        tile=None,
        vae_dtype: str = "fp32",
        area: int = 480 * 832,
        mode: str = "history",
        intrinsics=None,
        t5_mode: str = "subprocess",
        t5_device: str | None = None,
        condition_frames: int | None = None,
        decode_device=None,
        overlap: bool | None = None,
        on_frame: Callable[[PlayFrame], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        ranks: int = 1,
    ):
        kind = files.kind
        if local_attn_size is None and kind.local_attn_size == -1:
            local_attn_size, sink_size = PLAY_WINDOW if sink_size is None else (PLAY_WINDOW[0], sink_size)
        if local_attn_size == -1:
            raise ValueError(
                "local_attn_size: play runs without end, so its attention cache needs a window "
                f"(e.g. --local_attn_size {PLAY_WINDOW[0]} --sink_size {PLAY_WINDOW[1]}), got -1"
            )
        control = files.config.control_type
        if control != "cam":
            raise ValueError(f"play steers a camera model; this model's control type is {control}")
        self.config = fast_run.fast_config(
            shift,
            seed,
            local_attn_size,
            sink_size,
            kv_dtype,
            kind,
            compile,
            attention,
            camera_cache,
            fp8_accum,
        )
        fast_run.check_camera_cache(self.config, swap)
        self._camera_cache = camera_cache  # as asked: 'auto' is decided at each `check_memory`
        self.ranks, self.lead = ranks, distributed.rank() == 0  # rank 0 leads; the others follow()
        self._sent = time.monotonic()  # rank 0's last message to the others
        self._mid_chunk = False  # rank 0 ordered a chunk that has not finished (no stop can follow it)
        self._y = None  # a follower's copy of rank 0's condition
        self.files, self.device = files, torch.device(device)
        # the VAE (encode and decode) lives on decode_device
        self.decode_device = self.device if decode_device is None else torch.device(decode_device)
        self.apart = not same_device(self.device, self.decode_device)
        # overlap None: on another device always; on the same GPU when the plan fits both (`check_memory`)
        self.overlap, self._overlap_auto = self.apart if overlap is None else bool(overlap), overlap is None
        self.quantize, self.swap, self.tile, self.area = quantize, swap, tile, area
        self.vae_dtype, self._decode_dtype = vae_dtype, decode_dtype(vae_dtype, self.decode_device)
        self.t5_mode, self.t5_device = (
            t5_mode,
            t5_device or ("cpu" if self.device.type == "cpu" else str(device)),
        )
        self.intrinsics, self.on_frame, self.clock = intrinsics, on_frame, clock
        self.controls = Controls(mode, t0=clock())
        self.chunk = self.config.chunk_frames
        self.condition_frames = CONDITION_FRAMES if condition_frames is None else condition_frames
        self._lock = threading.Lock()
        self._contexts: dict[str, torch.Tensor] = {}
        self._conditions: dict = {}
        self._vae = self._model = self._dit = None
        self._session = self._camera = self._decoder = self._worker = None
        self._decoding = 0  # frames of the chunk in the decoder, not yet counted by step()
        self._dit_done = None  # the event marking the end of the last chunk's DiT, its commit pass included
        self._prompt = self._pending_prompt = None
        self._restart = False
        self.image = None
        self.size = None
        self._warmed = self._quiet = False
        self._reset_counters()
        self.intrinsics_used = None
        self.closed = False

    def _reset_counters(self) -> None:
        self.frames = 0
        self.rollouts = 0
        self.chunks = 0
        self.chunk_seconds: list[float] = []
        self.decode_seconds: list[float] = []
        self.latencies: list[float] = []
        # per chunk: from its input's read to the hand-out of the first frame a key can land in
        self.read_to_frame: list[float] = []
        self._played_from = None  # (time, frames) at the end of the first chunk
        self._last_frame_t = None
        self.poses: list[np.ndarray] = []  # the current rollout's latent poses
        self.paths: list[np.ndarray] = []  # each finished rollout's c2w per played video frame

    # --- input (any thread) -------------------------------------------------------------------------------

    def key(self, name, down: bool, t: float | None = None) -> bool:
        return self.controls.key(name, down, self.clock() if t is None else t)

    def look(self, dx: float, dy: float, t: float | None = None) -> None:
        self.controls.look(dx, dy, self.clock() if t is None else t)

    def set_prompt(self, prompt: str) -> None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt: expected a non-empty text")
        with self._lock:
            self._pending_prompt = prompt

    def restart(self) -> None:
        with self._lock:
            self._restart = True

    # --- setup ----------------------------------------------------------------------------------------------

    def lat_shape(self, image: torch.Tensor) -> tuple:
        self.size = i2v.latent_size(*image.shape[1:], self.area)
        return (rollout_latent_frames(self.chunk), *self.size[:2])

    def _plan_frames(self) -> int:
        """Latent frames the memory plan counts: the condition's, or the window's if longer (caches)."""
        return max(self.condition_frames, self.config.local_attn_size)

    def _plan(self, image: torch.Tensor) -> tuple:
        """The planner's view of the session: files, latent shape (the condition's encode of `condition_frames`
        latent frames; the caches at the window), config, quantize, swap, tile, VAE dtype."""
        _, lat_h, lat_w = self.lat_shape(image)
        shape = (self._plan_frames(), lat_h, lat_w)
        return self.files, shape, self.config, self.quantize, self.swap, self.tile, self.vae_dtype

    @property
    def _vae_device(self) -> torch.device | None:
        """Where this process holds the VAE: `decode_device` on rank 0, nowhere on a sequence-parallel follower."""
        return self.decode_device if self.lead else None

    def memory(self, image: torch.Tensor) -> fast_run.FastMemory:
        """The predicted memory of the DiT's device; `decode_memory` gives the decode device's when it is
        another."""
        elsewhere = self._vae_device is None or self.apart
        return fast_run.fast_memory(
            *self._plan(image), **fast_run.vae_where(elsewhere, self.overlap), ranks=self.ranks
        )

    def decode_memory(self, image: torch.Tensor) -> int | None:
        """The decode device's predicted peak (bytes), None when it is the DiT's (counted in `memory`) or this
        process holds no VAE (a sequence-parallel follower)."""
        if not self.apart or self._vae_device is None:
            return None
        return fast_run.decode_memory(self._plan(image)[1], self.chunk, self.tile, self.vae_dtype)

    def check_memory(self, image: torch.Tensor) -> None:
        """ValueError naming the device and what would fit when the planner's figure is more than it has free;
        `overlap` and a camera cache left to the plan are decided here (`fast_run.check_devices`), each time
        from what was asked."""
        files, shape, _, *rest = self._plan(image)
        self.overlap, self.config = fast_run.check_devices(
            files,
            shape,
            replace(self.config, camera_cache=self._camera_cache),
            *rest,
            self.device,
            self._vae_device,
            free_memory,
            None if self._overlap_auto else self.overlap,
            self.ranks,
        )

    def _context(self, prompt: str) -> torch.Tensor:
        if prompt not in self._contexts:
            (context,) = text_encode.encode_prompts(
                self.files.text_encoder,
                [prompt],
                tokenizer_path=self.files.tokenizer,
                mode=self.t5_mode,
                device=self.t5_device,
            )
            self._contexts[prompt] = context
        return self._contexts[prompt].to(self.device)

    def _condition(self) -> torch.Tensor:
        key = id(self.image)
        if key not in self._conditions:
            if self._vae is None:
                self._vae = self._load_vae()
            frames = (self.condition_frames - 1) * VAE_STRIDE[0] + 1
            encode = functools.partial(self._vae.encode, tile=self.tile)
            y = fast_run.condition(self.image, encode, frames, self.size, self.decode_device)
            self._conditions = {key: y.to(self.device)}
        return self._conditions[key]

    def start(self, image: torch.Tensor, prompt: str) -> None:
        """Load what is missing (text encoding, VAE, condition, DiT) and begin a rollout from `image`."""
        if self.closed:
            raise RuntimeError("this PlaySession is closed")
        self.lat_shape(image)
        self.check_memory(image)
        self.image, self._prompt = image, prompt
        context = self._context(prompt)
        y = self._condition()
        if self.ranks > 1:
            self._send({"op": "start", "size": self.size}, [y])  # the others load their DiT meanwhile
        if self._dit is None:
            self._dit = self._parallel(self._load_dit())
        if self._worker is None and self.lead:
            self._worker = DecodeWorker(self.decode_device, self._decode)
        self._new_rollout(context, y)
        if self.warm_chunks:
            self._warm_up(context, y)

    @property
    def warm_chunks(self) -> int:
        """Chunks `start` plays unseen first with compiled blocks: they compile at the first chunk that rolls
        the attention window, which would otherwise freeze the picture mid-play."""
        if self._warmed:
            return 0
        return fast_run.compile_warm_chunks(self.config, rollout_latent_frames(self.chunk) // self.chunk)

    def _warm_up(self, context, y) -> None:
        # one chunk at a time: the decode worker must not run a compiled decoder while the DiT traces
        # (or trace while the DiT runs compiled), which fails; after the warm-up nothing traces again
        overlap, self.overlap, self._quiet = self.overlap, False, True
        try:
            for _ in range(self.warm_chunks):
                self.step()
            self.flush()
        finally:
            self.overlap, self._quiet = overlap, False
        self._warmed = True
        self._end_rollout()
        self._reset_counters()  # then the rollout, its seed and the figures start as in a session without it
        self.controls = Controls(self.controls.mode, t0=self.clock())
        self._new_rollout(context, y)

    # what a front end with its own model management replaces (the ComfyUI node)
    def _load_vae(self):
        return load_vae(self.files.vae, self.decode_device)

    def _load_dit(self):
        self._model = fast_run.FastModel(
            self.files, self.device, quantize=self.quantize, swap_blocks=self.swap
        )
        return self._model()

    def _parallel(self, dit):
        if self.ranks > 1:
            dit.sequence_parallel = SequenceParallel()
        return dit

    def _release(self) -> None:
        if self._model is not None:
            self._model.close()

    def _new_rollout(self, context=None, y=None, seed=None) -> None:
        self._end_rollout()
        context = self._context(self._prompt) if context is None else context
        y = self._condition() if y is None else y
        lat_shape = (rollout_latent_frames(self.chunk), *self.size[:2])
        seed = (self.config.seed + self.rollouts) % 2**32 if seed is None else seed
        config = replace(self.config, seed=seed)
        y = y[:, : lat_shape[0]]
        self._session = FastSession(self._dit, context, y, lat_shape, config, self.device, stream=True)
        self.rollouts += 1
        if not self.lead:  # the camera, the decoder and the input are rank 0's
            return
        intr = self.intrinsics
        if intr is None:
            intr = fast_run.steering_intrinsics(None, self.size, DEFAULT_HFOV_DEG)
        self._camera = ChunkCamera(self.size, intr, self.chunk, device=self.device)
        self.intrinsics_used = self._camera.intrinsics
        levers = decoder_levers(self._decode_dtype, self.config.compile)
        self._decoder = self._vae.chunk_decoder(self.tile, dtype=self._decode_dtype, **levers)
        self.poses = []

    def _end_rollout(self) -> None:
        if self._worker is not None:
            self._worker.wait()  # the rollout's last chunk is handed out before its decoder goes
        if self._camera is not None and self._camera.track.video:
            self.paths.append(np.stack(self._camera.track.video))
        if self._session is not None:
            self._session.close()
        if self._decoder is not None:
            self._decoder.close()
        self._session = self._camera = self._decoder = None

    # --- the loop -------------------------------------------------------------------------------------------

    @property
    def rollout_chunk(self) -> int:
        """Chunks done in the current rollout."""
        return 0 if self._session is None else self._session.done

    @torch.no_grad()
    def step(self) -> int:
        """One chunk: returns the frames handed out."""
        if self._session is None:
            raise RuntimeError("call start(image, prompt) first")
        with self._lock:
            restart, self._restart = self._restart, False
            prompt, self._pending_prompt = self._pending_prompt, None
        changed = prompt is not None and prompt != self._prompt
        if changed:
            self._prompt = prompt
            if not restart:
                self._session.set_context(self._context(prompt))
        if restart or self._session.done >= self._session.num_chunks:
            self._new_rollout()
        t0 = self.clock()  # a chunk's seconds include the wait below
        if self._dit_done is not None:
            # the input is read once the GPU is free to act on it: queued behind the previous chunk's DiT (the host
            # runs ahead of the GPU), a key would wait that long again before its chunk even started
            self._dit_done.synchronize()
        read = self.clock()
        first_latent = len(self._camera.track.poses)
        n = self._camera.slots_needed()
        slots = self.controls.slots(read, n)
        keys: dict[int, list[float]] = {}
        for t, slot in self.controls.landed:
            keys.setdefault(keyed_latent(first_latent, slot), []).append(t)
        cam, poses = self._camera.next(slots)
        self.poses.extend(poses)
        if self.ranks > 1:
            self._order(cam, changed)
        self._mid_chunk = True
        handed = []  # the latent goes to the decoder after the last step: the commit pass runs beside its decode
        self._session.next_chunk(cam, lambda x0: handed.extend(hand_over(x0, self.decode_device)))
        latent, ready = handed
        self._mid_chunk, self._dit_done = False, queued_end(self.device)
        job = DecodeJob(self._decoder, latent, self.rollouts - 1, first_latent, poses, keys, read)
        self._worker.submit(job, ready)  # waits while the previous chunk is in the decoder
        count = VAE_STRIDE[0] * latent.shape[1] - (VAE_STRIDE[0] - 1) * (first_latent == 0)
        made, self._decoding = self._decoding, count  # with overlap: the previous chunk's frames
        if not self.overlap:
            self._worker.wait()
            made, self._decoding = count, 0
        self.chunks += 1
        self.chunk_seconds.append(self.clock() - t0)
        return made

    def _decode(self, job: DecodeJob) -> None:
        """The worker's part of a chunk: decode it latent frame by latent frame and hand each frame out. The next
        latent frame's decode is queued before a frame is handed out (the front end's JPEG encoding runs then),
        so the GPU does not wait for the host between latent frames."""
        t0 = self.clock()
        queued = []
        for i in range(job.latent.shape[1]):
            queued.append((i, *frames_to_host(job.decoder.decode(job.latent[:, i : i + 1]))))
            if len(queued) > 1 or queued[-1][2] is None:  # None: decoded on the CPU, nothing left in flight
                self._hand_out_latent(job, *queued.pop(0))
        for item in queued:
            self._hand_out_latent(job, *item)
        now = self.clock()
        self.decode_seconds.append(now - t0)
        if self._played_from is None:
            self._played_from = (now, self.frames)

    def _hand_out_latent(self, job: DecodeJob, i: int, frames: torch.Tensor, filled) -> None:
        if filled is not None:
            filled.synchronize()
            # out of pinned memory: a front end may keep every frame (the node's clip)
            frames = frames.clone()
        for n, frame in enumerate(frames):
            now = self._hand_out(job, job.first_latent + i, frame, job.poses[i])
            if n == 0 and job.first_latent + i == keyed_latent(job.first_latent):
                self.read_to_frame.append(now - job.read)

    def _hand_out(self, job: DecodeJob, latent: int, frame: torch.Tensor, pose: np.ndarray) -> float:
        """Hand one frame out; returns when."""
        keys = tuple(job.keys.pop(latent, ()))
        if self.on_frame is not None and not self._quiet:
            self.on_frame(PlayFrame(self.frames, job.rollout, latent, frame, pose, keys))
        now = self.clock()
        self.latencies.extend(now - t for t in keys)
        self.frames += 1
        self._last_frame_t = now
        return now

    def run(self, stop: threading.Event) -> None:
        """Chunk after chunk until `stop` is set; returns once the last chunk's frames are handed out."""
        while not stop.is_set():
            self.step()
        self.flush()

    def flush(self) -> None:
        """Wait until the chunk in the decoder is handed out (raises the decode's exception)."""
        if self._worker is not None:
            self._worker.wait()

    # --- sequence parallel: rank 0 orders, the others follow ----------------------------------------------

    def _send(self, message: dict, tensors=()) -> None:
        distributed.broadcast_message(message, list(tensors), self.device)
        self._sent = time.monotonic()

    def _order(self, cam: torch.Tensor, changed: bool) -> None:
        """The chunk rank 0 is about to run: its camera, with a new rollout's seed (its first chunk) and the
        text context where the rollout is new or the prompt changed."""
        seed = self._session.config.seed if self._session.done == 0 else None
        context = [self._context(self._prompt)] if seed is not None or changed else []
        self._send({"op": "chunk", "seed": seed}, [cam, *context])

    def idle(self) -> None:
        """Rank 0 while no chunk is asked for (no client yet): a keep-alive now and then, so the others'
        wait for the next order stays within the process group's timeout."""
        if self.ranks > 1 and self.lead and not self.closed and time.monotonic() - self._sent > KEEPALIVE_S:
            self._send({"op": "wait"})

    @torch.no_grad()
    def follow(self) -> None:
        """A rank other than 0 (`ranks` > 1): load the DiT, then run each chunk rank 0 orders, in lockstep with
        it, until it says stop; the session is closed on the way out. Raises distributed.PeerLost when rank 0
        ends without a stop (failed, killed, timed out)."""
        if self.lead or self.ranks < 2:
            raise RuntimeError("follow() runs on the ranks other than 0 of a sequence-parallel play")
        try:
            if self._dit is None:
                self._dit = self._parallel(self._load_dit())
            while True:
                try:
                    order, tensors = distributed.broadcast_message(None, None, self.device)
                except RuntimeError as err:
                    raise distributed.PeerLost(
                        f"play, rank {distributed.rank()}: rank 0 ended without a stop (it failed, was "
                        f"stopped or timed out); stopping too ({str(err).splitlines()[0]})"
                    ) from None
                if order["op"] == "stop":
                    return
                if order["op"] == "start":
                    self.size, (self._y,) = order["size"], tensors
                elif order["op"] == "chunk":
                    cam, *context = tensors
                    if order["seed"] is not None:
                        self._new_rollout(context[0], self._y, order["seed"])
                    elif context:
                        self._session.set_context(context[0])
                    self._session.next_chunk(cam)
                    self.chunks += 1
        finally:
            self.close()

    # --- report and teardown ----------------------------------------------------------------------------

    def stats(self) -> dict:
        fps = None
        if self._played_from is not None and self._last_frame_t is not None:
            t, frames = self._played_from
            if self._last_frame_t > t and self.frames > frames:
                fps = (self.frames - frames) / (self._last_frame_t - t)
        steady = self.chunk_seconds[1:] or self.chunk_seconds
        decode = self.decode_seconds[1:] or self.decode_seconds
        vram = None
        if self.device.type == "cuda":
            vram = {
                "allocated_gib": torch.cuda.memory_allocated(self.device) / GIB,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
            }
            if self.apart and self.decode_device.type == "cuda":
                vram["decode_peak_gib"] = torch.cuda.max_memory_allocated(self.decode_device) / GIB
        return {
            "frames": self.frames,
            "chunks": self.chunks,
            "rollouts": self.rollouts,
            "fps_played": fps,
            "s_per_chunk": float(np.mean(steady)) if steady else None,
            "decode_s_per_chunk": float(np.mean(decode)) if decode else None,
            "key_to_pixel_p50_s": percentile(self.latencies, 50),
            "key_to_pixel_p95_s": percentile(self.latencies, 95),
            "key_events_measured": len(self.latencies),
            "read_to_frame_p50_s": percentile(self.read_to_frame, 50),
            "read_to_frame_p95_s": percentile(self.read_to_frame, 95),
            "vram": vram,
            "window": [self.config.local_attn_size, self.config.sink_size],
        }

    def close(self) -> None:
        """Hand out the chunk in the decoder, stop the worker, free the caches, the model and the VAE on both
        devices (idempotent; raises the decode's exception once everything is freed). Rank 0 of a
        sequence-parallel play tells the others to stop (unless a chunk it ordered failed: they are in its
        collectives, which its exit ends)."""
        if self.ranks > 1 and self.lead and not self.closed and not self._mid_chunk:
            with contextlib.suppress(RuntimeError):  # a follower already gone
                self._send({"op": "stop"})
        self.closed = True
        worker, self._worker = self._worker, None
        try:
            if worker is not None:
                worker.close()
        finally:
            self._end_rollout()
            if self._dit is not None or self._vae is not None:
                self._release()
            self._model = self._dit = self._vae = None
            self._conditions = {}
            self._contexts = {}
            self._y = None
            for device in {self.device, self.decode_device}:
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        torch.cuda.empty_cache()


class PlayRecorder:
    """`--record out.mp4`: the played frames as an MP4 (16 fps, written as they come) and, per rollout, a camera
    folder `generate`/`fast` replay with --action_path: poses.npy (c2w per played video frame, the rollout's
    first camera at the identity) and intrinsics.npy. Replayed, the path's translations are normalised by its
    largest step (upstream's per-clip rule) instead of play's fixed walk step."""

    def __init__(self, path, overwrite: bool = False):
        from ..loaders.video import Mp4Writer, check_output

        self.path = check_output(path, overwrite)
        self.overwrite = overwrite
        self.writer = Mp4Writer(self.path, fps=fast_run.REAL_TIME_FPS, overwrite=overwrite)
        self.frames = 0

    def add(self, frame: PlayFrame) -> None:
        self.writer.add(frame.image[None])
        self.frames += 1

    def camera_dir(self, rollout: int):
        stem = self.path.with_suffix("")
        return stem.with_name(f"{stem.name}_camera" + (f"_{rollout + 1}" if rollout else ""))

    def close(self, session: PlaySession) -> list:
        """Finish the MP4 and write the camera folders; returns [(folder, frames)]."""
        from ..loaders.camera_authoring import save_camera_dir
        from ..wan.camera import MIN_POSE_FRAMES

        if not self.frames:
            self.writer.abort()
            return []
        self.writer.close()
        written = []
        for r, path in enumerate(session.paths):
            if len(path) >= MIN_POSE_FRAMES:
                folder = save_camera_dir(self.camera_dir(r), path, session.intrinsics_used, self.overwrite)
                written.append((folder, len(path)))
        return written

    def abort(self) -> None:
        self.writer.abort()
