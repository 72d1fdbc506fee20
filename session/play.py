"""Live play: one long-lived chunked model session steered by keys and mouse, frames handed out as they decode.

`PlaySession(files, device, ...)` loads nothing until `start(image, prompt)`; the text encoder's output (cached
per prompt), the VAE, the i2v condition (cached per image) and the DiT stay until `close()`. `step()` makes
one chunk: the input gathered since the last chunk (`controls`, fed by `key`/`look` from any thread) becomes
the chunk's camera poses, the DiT denoises the chunk (`wan.fast.FastSession` in stream mode) and the latent
is decoded one latent frame at a time, each frame handed to `on_frame(PlayFrame)` as soon as it exists: a
rollout's first latent frame gives 1 frame, every later one 4.

A rollout restarts from the image (new caches, same model) on `restart()` or when its latent frames reach the
RoPE table's length; `set_prompt` applies from the next chunk. The attention window bounds the caches of an
endless rollout, so play needs one (`--local_attn_size`; models documented without one play at
`PLAY_WINDOW`), and the memory plan is checked before anything loads on a GPU.

The i2v condition (mask + the VAE latent of the image followed by zero frames) is encoded exactly for the
first `CONDITION_FRAMES` latent frames; later latent frames reuse its last frame (the encoder's causal state
after a long run of zero frames changes less and less from one latent frame to the next).

Timing: `stats()` reports FPS as played (frames after the first chunk divided by their wall time), seconds per
chunk, key->pixel latency (from a key or mouse event's arrival to the hand-out of the first frame of the
latent frame it landed in) as p50/p95, and the device memory. Those are hand-out figures (the frames shown as
they are made); each frame carries the arrival times of the events it answers (`PlayFrame.keys`), so a front end
that paces the frames (session.pacer) measures key->pixel to the frame's show time.
"""

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
from ..wan.pipeline import frames_to_uint8
from ..wan.vae import decode_dtype, decoder_levers
from . import fast_run
from .controls import ChunkCamera, Controls
from .planner import GIB, PROCESS_RAM, free_memory

PLAY_WINDOW = (18, 6)  # (window, sink) for a model documented with an unbounded cache (v1 Fast)
CONDITION_FRAMES = 32  # latent frames of the i2v condition encoded exactly (125 video frames)


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


def percentile(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


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
        on_frame: Callable[[PlayFrame], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
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
        self.config = fast_run.fast_config(shift, seed, local_attn_size, sink_size, kv_dtype, kind, compile)
        self.files, self.device = files, torch.device(device)
        self.quantize, self.swap, self.tile, self.area = quantize, swap, tile, area
        self.vae_dtype, self._decode_dtype = vae_dtype, decode_dtype(vae_dtype, self.device)
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
        self._session = self._camera = self._decoder = None
        self._prompt = self._pending_prompt = None
        self._restart = False
        self.image = None
        self.size = None
        self.frames = 0
        self.rollouts = 0
        self.chunks = 0
        self.chunk_seconds: list[float] = []
        self.latencies: list[float] = []
        self._landed: dict[
            int, list[float]
        ] = {}  # latent frame of the rollout -> arrival times of its events
        self._played_from = None  # (time, frames) at the end of the first chunk
        self._last_frame_t = None
        self.poses: list[np.ndarray] = []  # the current rollout's latent poses
        self.paths: list[np.ndarray] = []  # each finished rollout's c2w per played video frame
        self.intrinsics_used = None
        self.closed = False

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

    def memory(self, image: torch.Tensor) -> fast_run.FastMemory:
        """The predicted memory (the condition's encode of `condition_frames` latent frames; the caches at the
        window)."""
        lat_f, lat_h, lat_w = self.lat_shape(image)
        return fast_run.fast_memory(
            self.files,
            (self._plan_frames(), lat_h, lat_w),
            self.config,
            self.quantize,
            self.swap,
            self.tile,
            self.vae_dtype,
        )

    def check_memory(self, image: torch.Tensor) -> None:
        """ValueError naming what would fit when the planner's figure is more than the device has free."""
        if self.device.type != "cuda":
            return
        _, lat_h, lat_w = self.lat_shape(image)
        vram, ram = free_memory(self.device)
        issue = fast_run.fast_fit_issue(
            self.files,
            (self._plan_frames(), lat_h, lat_w),
            self.config,
            self.quantize,
            self.swap,
            vram,
            self.tile,
            free_ram=None if ram is None else ram + PROCESS_RAM,  # this process's share is counted
            vae_dtype=self.vae_dtype,
        )
        if issue is not None:
            raise ValueError(f"memory: {issue}")

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
            self._conditions = {key: fast_run.condition(self.image, encode, frames, self.size, self.device)}
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
        if self._dit is None:
            self._dit = self._load_dit()
        self._new_rollout(context, y)

    # what a front end with its own model management replaces (the ComfyUI node)
    def _load_vae(self):
        return load_vae(self.files.vae, self.device)

    def _load_dit(self):
        self._model = fast_run.FastModel(
            self.files, self.device, quantize=self.quantize, swap_blocks=self.swap
        )
        return self._model()

    def _release(self) -> None:
        if self._model is not None:
            self._model.close()

    def _new_rollout(self, context=None, y=None) -> None:
        self._end_rollout()
        context = self._context(self._prompt) if context is None else context
        y = self._condition() if y is None else y
        lat_shape = (rollout_latent_frames(self.chunk), *self.size[:2])
        config = replace(self.config, seed=(self.config.seed + self.rollouts) % 2**32)
        y = y[:, : lat_shape[0]]
        self._session = FastSession(self._dit, context, y, lat_shape, config, self.device, stream=True)
        intr = self.intrinsics
        if intr is None:
            intr = fast_run.steering_intrinsics(None, self.size, DEFAULT_HFOV_DEG)
        self._camera = ChunkCamera(self.size, intr, self.chunk, device=self.device)
        self.intrinsics_used = self._camera.intrinsics
        levers = decoder_levers(self._decode_dtype, self.config.compile)
        self._decoder = self._vae.chunk_decoder(self.tile, dtype=self._decode_dtype, **levers)
        self._landed = {}
        self.poses = []
        self.rollouts += 1

    def _end_rollout(self) -> None:
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
        if prompt is not None and prompt != self._prompt:
            self._prompt = prompt
            if not restart:
                self._session.set_context(self._context(prompt))
        if restart or self._session.done >= self._session.num_chunks:
            self._new_rollout()
        t0 = self.clock()
        first_latent = len(self._camera.track.poses)
        n = self._camera.slots_needed()
        slots = self.controls.slots(t0, n)
        for t, slot in self.controls.landed:
            self._landed.setdefault(first_latent + (first_latent == 0) + slot, []).append(t)
        cam, poses = self._camera.next(slots)
        self.poses.extend(poses)
        latent = self._session.next_chunk(cam)
        made = 0
        for i in range(latent.shape[1]):
            video = self._decoder.decode(latent[:, i : i + 1])
            pose = poses[i]
            for frame in frames_to_uint8(video):
                self._hand_out(first_latent + i, frame, pose)
                made += 1
        self.chunks += 1
        now = self.clock()
        self.chunk_seconds.append(now - t0)
        if self._played_from is None:
            self._played_from = (now, self.frames)
        return made

    def _hand_out(self, latent: int, frame: torch.Tensor, pose: np.ndarray) -> None:
        keys = tuple(self._landed.pop(latent, ()))
        if self.on_frame is not None:
            self.on_frame(PlayFrame(self.frames, self.rollouts - 1, latent, frame, pose, keys))
        now = self.clock()
        self.latencies.extend(now - t for t in keys)
        self.frames += 1
        self._last_frame_t = now

    def run(self, stop: threading.Event) -> None:
        """Chunk after chunk until `stop` is set."""
        while not stop.is_set():
            self.step()

    # --- report and teardown ----------------------------------------------------------------------------

    def stats(self) -> dict:
        fps = None
        if self._played_from is not None and self._last_frame_t is not None:
            t, frames = self._played_from
            if self._last_frame_t > t and self.frames > frames:
                fps = (self.frames - frames) / (self._last_frame_t - t)
        steady = self.chunk_seconds[1:] or self.chunk_seconds
        vram = None
        if self.device.type == "cuda":
            vram = {
                "allocated_gib": torch.cuda.memory_allocated(self.device) / GIB,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
            }
        return {
            "frames": self.frames,
            "chunks": self.chunks,
            "rollouts": self.rollouts,
            "fps_played": fps,
            "s_per_chunk": float(np.mean(steady)) if steady else None,
            "key_to_pixel_p50_s": percentile(self.latencies, 50),
            "key_to_pixel_p95_s": percentile(self.latencies, 95),
            "key_events_measured": len(self.latencies),
            "vram": vram,
            "window": [self.config.local_attn_size, self.config.sink_size],
        }

    def close(self) -> None:
        """Free the caches, the model and the VAE (idempotent)."""
        self.closed = True
        self._end_rollout()
        if self._dit is not None or self._vae is not None:
            self._release()
        self._model = self._dit = self._vae = None
        self._conditions = {}
        self._contexts = {}
        if self.device.type == "cuda":
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
