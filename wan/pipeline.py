"""The one sampling flow: text embeddings + camera conditioning -> VAE encode of the first frame
-> dual-expert sampling -> the final latent (the front ends decode it). Upstream's `WanI2V.generate`,
step for step.

Everything that touches files or a host framework comes in as hooks, so the CLI, the ComfyUI nodes,
the tests and the benchmarks all run this same code:
- `experts(name)` returns the expert for 'high' or 'low' (the provider decides residency: it drops
  or parks the other one before loading, so only one is resident on the device);
- `progress(i, n, latent)` after each step; `interrupted()` before each step and phase;
- `phase(name)` a context manager around each phase (timing, memory accounting).

Sequence parallel (`parallel`, a `wan.parallel.SequenceParallel`): every rank runs this same flow with the
same inputs and seed (so the noise is the same everywhere); the first-frame VAE encode runs on rank 0 only
and its latent is broadcast, each expert forward splits the video tokens across the ranks, and only rank 0
calls the `progress` hook. With the step cache, every rank takes rank 0's skip decision.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention, fp8, i2v
from .config import SampleConfig
from .schedulers import cfg, expert_for_timestep, guide_scale_for, make_scheduler
from .speed import SpeedOptions, SpeedStats, block_runner, check_fp8_loaded
from .speed import prepare as prepare_model
from .step_cache import EasyCache


class Interrupted(Exception):
    """Raised when the `interrupted` hook says stop; models are released on the way out."""


@dataclass
class Hooks:
    progress: Callable[[int, int, torch.Tensor], None] | None = None
    interrupted: Callable[[], bool] | None = None
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None
    current: str | None = None  # the last phase entered: what a front end names when memory runs out

    def check(self):
        if self.interrupted is not None and self.interrupted():
            raise Interrupted("generation interrupted")

    def in_phase(self, name: str):
        self.current = name
        return self.phase(name) if self.phase is not None else contextlib.nullcontext()


def denoise(
    experts: Callable[[str], torch.nn.Module],
    noise: torch.Tensor,
    y: torch.Tensor,
    context: torch.Tensor,
    context_null: torch.Tensor,
    cam: torch.Tensor | None,
    settings: SampleConfig,
    hooks: Hooks | None = None,
    speed: SpeedOptions | None = None,
    stats: SpeedStats | None = None,
    parallel=None,
    text: Callable[[], tuple] | None = None,
) -> torch.Tensor:
    """The dual-expert CFG sampling loop. Returns the final latent [16, lat_f, lat_h, lat_w] (fp32).

    `speed` (default: everything off, today's exact results) picks the attention backend, compiled
    blocks, lean activations and the step cache; `stats`, when given, is filled with the forwards run and skipped.
    A step whose guide scale is 1 runs the cond forward only: its prediction is exactly cond.
    `text`: see `sample`; called once the first expert is loaded.
    """
    hooks = hooks or Hooks()
    speed = speed or SpeedOptions()
    stats = stats if stats is not None else SpeedStats()
    device = noise.device
    scheduler = make_scheduler(settings.solver, settings.sample_steps, settings.sample_shift, device)
    timesteps = scheduler.timesteps
    seq_len = i2v.seq_len(*noise.shape[1:])
    schedule = [expert_for_timestep(t, settings.boundary) for t in timesteps]
    cache = EasyCache(speed.cache_keep_first, speed.cache_keep_last) if speed.cache == "easycache" else None
    agree = (
        None if parallel is None else lambda skip: parallel.agree(skip, device)
    )  # one decision for all ranks
    latent = noise
    with attention.use(speed.attention), fp8.accumulation(speed.fp8_accum), contextlib.ExitStack() as stack:
        runner = block_runner(speed, device)
        model = current = None
        for i, t in enumerate(timesteps):
            hooks.check()
            which = schedule[i]
            if which != current:  # a new phase per expert: its load and its steps
                model = None  # drop our reference, or the old expert stays alive while the new one loads
                stack.close()
                stack.enter_context(hooks.in_phase(f"denoise_{which}"))
                model, current = experts(which), which
                if text is not None:  # embeddings a background encoder made while the expert loaded
                    context, context_null = (None if e is None else e.to(device) for e in text())
                    text = None
                check_fp8_loaded(model, speed)
                prepare_model(model, runner)
                if speed.lean:  # the expert leaves this loop with its normal blocks
                    model.lean_activations = True
                    stack.callback(setattr, model, "lean_activations", False)
                if parallel is not None:  # the expert leaves this loop whole again
                    model.sequence_parallel = parallel
                    stack.callback(setattr, model, "sequence_parallel", None)
                if runner is not None:  # the expert leaves this loop uncompiled (parked, reused, freed)
                    stack.callback(prepare_model, model, None)
                if cache is not None:  # never carried across the switch
                    cache.start(schedule.count(which), speed.threshold_for(which))
            g = guide_scale_for(t, settings.boundary, settings.guide_scale)
            timestep = t.reshape(1).to(device)
            branches = (("cond", context),) if g == 1 else (("cond", context), ("uncond", context_null))
            with torch.no_grad():
                skip = cache is not None and cache.should_skip(latent, agree)
                out = {}
                for branch, ctx in branches:
                    if skip:
                        out[branch] = cache.reuse(branch, latent)
                    else:
                        out[branch] = model(latent, timestep, ctx, seq_len, y=y, cam=cam)
                        if cache is not None:
                            cache.store(branch, latent, out[branch])
                stats.forwards[which] += 0 if skip else len(branches)
                stats.skipped[which] += len(branches) if skip else 0
                stats.skipped_steps[which] += int(skip)
                if g == 1:
                    pred = out["cond"]
                else:
                    pred = cfg(out["cond"], out["uncond"], g)
                del out
                latent = scheduler.step(pred, t, latent)
            if hooks.progress is not None and (parallel is None or parallel.rank == 0):
                hooks.progress(i + 1, len(timesteps), latent)
        stats.compiled = runner is not None and not runner.failed
    return latent


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [-1, 1] -> [F, H, W, 3] uint8 on the CPU, as upstream's save_video (clamp, scale,
    truncate)."""
    return uint8_frames(video).cpu()


def uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """`frames_to_uint8` on `video`'s device (a view of [F, H, W, 3])."""
    return ((video.clamp(-1, 1) + 1) / 2 * 255).to(torch.uint8).permute(1, 2, 3, 0)


def sample(
    image: torch.Tensor,
    context: torch.Tensor,
    context_null: torch.Tensor,
    vae,
    experts: Callable[[str], torch.nn.Module],
    release_experts: Callable[[], None],
    size: tuple[int, int, int, int],
    frame_num: int,
    settings: SampleConfig,
    cam: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    hooks: Hooks | None = None,
    speed: SpeedOptions | None = None,
    stats: SpeedStats | None = None,
    parallel=None,
    text: Callable[[], tuple] | None = None,
) -> torch.Tensor:
    """Image [3, H, W] in [-1, 1] + text embeddings (+ packed camera tensor) -> final latent.

    `size` is (lat_h, lat_w, h, w) from `wan.i2v.latent_size`/`explicit_size`; `frame_num` must
    already be 4n+1 and fit the camera path. `vae.encode(video) -> latent` encodes the first frame
    (+ zero frames) for the i2v condition. The experts are released before this returns, also on
    errors and interrupts, so the decode that follows has the device to itself. `parallel`: see the module
    docstring (ranks other than 0 may pass `vae=None`). `text`: embeddings still being encoded, instead of
    `context`/`context_null`: a function that waits for them and returns that pair; it is called once the
    first expert is loaded, so the encoder's run overlaps the first-frame encode and that load.
    """
    hooks = hooks or Hooks()
    device = torch.device(device)
    if text is not None and (context is not None or context_null is not None or parallel is not None):
        raise ValueError(
            "text: a background encode stands for context and context_null, and not under parallel"
        )
    if speed is not None:
        attention.resolve(speed.attention)  # a missing backend fails before any work
    lat_h, lat_w, h, w = size
    lat_f = i2v.latent_frames(frame_num)
    try:
        hooks.check()
        noise = i2v.make_noise(settings.seed, lat_f, lat_h, lat_w, device)
        mask = i2v.first_frame_mask(frame_num, lat_h, lat_w, device)
        with hooks.in_phase("vae_encode"):
            if parallel is None:
                latent_image = vae.encode(i2v.vae_input(image, frame_num, h, w).to(device))
            else:  # rank 0 encodes, every rank receives its latent (the noise's shape, fp32)
                if parallel.rank == 0:
                    latent_image = vae.encode(i2v.vae_input(image, frame_num, h, w).to(device))
                    latent_image = latent_image.to(device, torch.float32)
                else:
                    latent_image = torch.empty_like(noise)
                latent_image = parallel.broadcast(latent_image)
        y = torch.cat([mask, latent_image.to(device)])
        del latent_image
        if text is None:
            context = context.to(device)
            context_null = None if context_null is None else context_null.to(device)  # None: no step runs CFG
        cam = None if cam is None else cam.to(device)
        return denoise(
            experts, noise, y, context, context_null, cam, settings, hooks, speed, stats, parallel, text
        )
    finally:
        release_experts()
