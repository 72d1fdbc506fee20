"""The one preparation path: a user's request -> what `wan.pipeline.sample` needs, every check in one place.

The CLI and the ComfyUI sampler node both go through here, in two stages:

1. `plan_request` checks everything that needs no tensors (sizes, frame count and its bounds, sampler
   settings, the camera path against the experts, the text encoder's width against the experts), so a bad
   request is refused before any model loads;
2. `Plan.inputs` takes the loaded image and text embeddings and returns the keyword arguments of
   `pipeline.sample` (camera tensor packed for the chosen size).

Errors are `RequestError`s (ValueErrors) that carry the parameter's name, so each front end can say it in
its own words (`--sampling_steps` on the command line, `steps` on the node).
"""

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..loaders.camera_files import CameraInput
from ..loaders.formats import meta_model
from ..loaders.lora import LoraSpec, read_loras
from ..wan import attention, i2v
from ..wan.block_swap import resolve_swap_blocks
from ..wan.config import DiTConfig, SampleConfig
from ..wan.parallel import SequenceParallel, world_size
from ..wan.schedulers import SCHEDULERS
from ..wan.speed import SpeedOptions
from .errors import RequestError
from .planner import Planner

# Upper bounds that refuse absurd requests before anything is built. 1601 frames is 100 s at 16 fps;
# 2**20 tokens is past 720p x 961 frames (upstream's longest advertised clip is 961 frames at 480p).
MAX_FRAMES = 1601
MAX_TOKENS = 1 << 20
MAX_STEPS = 1000
MAX_GUIDE_SCALE = 100.0
MAX_FPS = 240


@dataclass(frozen=True)
class Plan:
    """A checked request: sizes, frame count, settings, the experts' config and the camera input."""

    size: tuple  # (lat_h, lat_w, h, w)
    frame_num: int
    settings: SampleConfig
    config: DiTConfig
    camera: CameraInput | None = None
    loras: dict = field(default_factory=dict)  # {'high'|'low': [wan.lora.Lora]}, read and checked
    speed: SpeedOptions = SpeedOptions()  # every option off: today's exact results
    memory: object = None  # session.planner.MemoryPlan when plan_request checked memory, else None
    swap_blocks: int | str = 0  # DiT blocks streamed from pinned host RAM, or 'auto' (see wan.block_swap)
    ulysses_size: int = 1  # ranks sharing each forward's video tokens (sequence parallel, see wan.parallel)

    @property
    def tokens(self) -> int:
        return i2v.seq_len(i2v.latent_frames(self.frame_num), *self.size[:2])

    @property
    def needs_negative(self) -> bool:
        """Whether any step runs CFG (guide scale not 1): only then is the negative prompt used."""
        return any(g != 1 for g in self.settings.guide_scale)

    def check_text(self, context: torch.Tensor, context_null: torch.Tensor | None) -> None:
        """Both embeddings checked; `context_null` may be None when no step runs CFG."""
        if context_null is None and self.needs_negative:
            raise RequestError(
                "context_null",
                f"guide scale {self.settings.guide_scale} runs CFG and needs the negative prompt's embeddings",
            )
        for name, t in (("context", context), ("context_null", context_null)):
            if name == "context_null" and t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < 1:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise RequestError(
                    name, f"expected text embeddings [tokens, {self.config.text_dim}], got {shape}"
                )
            check_text_dim(t.shape[-1], self.config)

    def inputs(self, image: torch.Tensor, context, context_null, device, text=None) -> dict:
        """Keyword arguments for `pipeline.sample` (all but the VAE, the experts and the hooks). `text`:
        instead of the embeddings, a function that waits for (context, context_null) from a background
        encoder (see `pipeline.sample`); they are checked when it returns."""
        if text is None:
            self.check_text(context, context_null)
        else:
            wait = text

            def text():
                pair = wait()
                self.check_text(*pair)
                return pair

        cam = None
        if self.camera is not None:
            cam, frames = self.camera.pack(self.config.control_type, self.frame_num, self.size, device)
            assert frames == self.frame_num, (frames, self.frame_num)  # plan_request already capped it
        return dict(
            image=image,
            context=context,
            context_null=context_null,
            size=self.size,
            frame_num=self.frame_num,
            settings=self.settings,
            cam=cam,
            device=torch.device(device),
            speed=self.speed,
            parallel=SequenceParallel() if self.ulysses_size > 1 else None,
            text=text,
        )


def check_text_dim(width: int, config: DiTConfig, encoder=None, experts=None) -> None:
    """The text encoder's output width against the experts'; `encoder`, `experts`: their files, named."""
    if width != config.text_dim:
        whose = (
            f"the text encoder {encoder} does not belong to the experts {experts}"
            if encoder and experts
            else "this text encoder does not belong to these experts"
        )
        raise RequestError(
            "text", f"embeddings have width {width}, the experts expect {config.text_dim} ({whose})"
        )


def _number(param: str, value, lo: float, hi: float, integer: bool = False):
    ok = isinstance(value, (int, np.integer)) if integer else isinstance(value, (int, float, np.number))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise RequestError(param, f"expected {kind} in [{lo:g}, {hi:g}], got {value!r}")
    return value


def check_settings(settings: SampleConfig) -> SampleConfig:
    """Every sampler setting in range, named on failure. Returns the settings unchanged."""
    _number("sample_steps", settings.sample_steps, 1, MAX_STEPS, integer=True)
    shift = _number("sample_shift", settings.sample_shift, 0, 1e4)
    if shift <= 0:
        raise RequestError("sample_shift", f"expected a number > 0, got {shift!r}")
    _number("boundary", settings.boundary, 0, 1)
    if len(settings.guide_scale) != 2:
        raise RequestError(
            "guide_scale", f"expected (low-noise, high-noise), got {len(settings.guide_scale)} values"
        )
    for g in settings.guide_scale:
        _number("guide_scale", g, 0, MAX_GUIDE_SCALE)
    _number("sample_fps", settings.sample_fps, 1, MAX_FPS, integer=True)
    if settings.solver not in SCHEDULERS:
        raise RequestError("solver", f"expected one of {', '.join(SCHEDULERS)}, got {settings.solver!r}")
    issue = i2v.seed_issue(settings.seed)
    if issue:
        raise RequestError("seed", issue)
    return settings


def plan_size(image_hw: tuple, max_area=None, width=None, height=None) -> tuple:
    """(lat_h, lat_w, h, w) for an image of (H, W): within the pixel budget `max_area` at its aspect ratio,
    or `width` x `height` (RequestError 'max_area' or 'size')."""
    if max_area is not None:
        if width is not None or height is not None:
            raise RequestError(
                "size", "give a pixel budget (max_area) or an explicit width x height, not both"
            )
        try:
            return i2v.latent_size(image_hw[0], image_hw[1], max_area)
        except ValueError as e:
            raise RequestError("max_area", str(e)) from None
    try:
        return i2v.explicit_size(width, height)
    except ValueError as e:
        raise RequestError("size", str(e)) from None


def _frames(frame_num, camera: CameraInput | None) -> int:
    if frame_num is not None:
        issue = i2v.frame_num_issue(frame_num)
        if issue:
            raise RequestError("frame_num", issue.removeprefix("frame_num "))
        if frame_num > MAX_FRAMES:
            raise RequestError("frame_num", f"at most {MAX_FRAMES} frames (100 s at 16 fps), got {frame_num}")
    if camera is None:
        return SampleConfig.frame_num if frame_num is None else frame_num
    # Action strings fix the length; pose files cap it (upstream's rules). Keys are bounded here too,
    # before the pose path is built.
    if camera.action_string is not None and (driven := camera.frames()) > MAX_FRAMES:
        raise RequestError("action_string", f"drives {driven} frames; at most {MAX_FRAMES} (100 s at 16 fps)")
    return camera.plan(frame_num)[2]


def plan_request(
    image_hw: tuple,
    config: DiTConfig,
    settings: SampleConfig,
    camera: CameraInput | None = None,
    frame_num: int | None = None,
    max_area: int | None = None,
    width: int | None = None,
    height: int | None = None,
    text_dim: int | None = None,
    loras: tuple = (),
    allow_unmatched_lora_keys: bool = False,
    speed: SpeedOptions | None = None,
    memory=None,
    swap_blocks: int | str = 0,
    ulysses_size: int = 1,
    ulysses_world: int | None = None,
) -> Plan:
    """Check a request from sizes alone (nothing loaded): the image's (H, W), the experts' config, the
    sampler settings (their frame_num/max_area are ignored in favour of the arguments), the camera input,
    the frame count (None: the camera's or the default), the sizing (`max_area`, or `width` and `height`)
    and, when known, the text encoder's output width. `loras` (LoraSpecs) are read and checked against
    the experts' layers here, once, so a wrong file is refused before any expert streams in. `speed`: the
    sampling loop's speed options (attention backend checked for availability here). `memory`: a
    `session.planner.MemoryCheck` (device, free memory, stored bytes): each phase's peak is predicted
    and a request that does not fit is refused (MemoryPlanError) before anything loads. `swap_blocks`:
    how many DiT blocks of the resident expert stream from pinned host RAM (0..num_layers, or 'auto').
    `ulysses_size`: ranks of the initialized torch.distributed world that split each forward's tokens (1: one
    device); it must equal the world size and divide the heads. `ulysses_world`: the world size to check it
    against (default: the initialized process group's); `lingbot.py plan` passes `ulysses_size` to plan
    for ranks it does not start. With `memory`, the memory checked is each rank's (see session.planner).
    `speed.lean_activations` 'auto' is resolved here: True only when `memory` found the normal blocks would
    not fit the device's free memory (before any 'auto' swap); the Plan's `speed` carries the result."""
    check_settings(settings)
    size = plan_size(image_hw, max_area, width, height)
    if camera is not None and config.control_type is None:
        raise RequestError(
            "camera", "these experts have no camera layers (plain Wan2.2 i2v); give no camera input"
        )
    frames = _frames(frame_num, camera)
    tokens = i2v.seq_len(i2v.latent_frames(frames), *size[:2])
    if tokens > MAX_TOKENS:
        raise RequestError(
            "size",
            f"{frames} frames at {size[3]}x{size[2]} make {tokens:,} tokens, more than the {MAX_TOKENS:,} "
            "this pack accepts; use fewer frames or a smaller size",
        )
    if text_dim is not None:
        check_text_dim(text_dim, config)
    speed = speed or SpeedOptions()
    try:
        attention.resolve(speed.attention)
    except (ValueError, ImportError, RuntimeError) as e:
        raise RequestError("attention", str(e)) from None
    try:
        resolve_swap_blocks(swap_blocks, config.num_layers)
    except ValueError as e:
        raise RequestError("swap_blocks", str(e).removeprefix("swap_blocks: ")) from None
    if isinstance(swap_blocks, str):
        swap_blocks = swap_blocks.strip().lower()
        swap_blocks = swap_blocks if swap_blocks == "auto" else int(swap_blocks)
    check_ulysses(ulysses_size, config, ulysses_world)
    settings = replace(settings, frame_num=frames)
    memory_plan = None
    if memory is not None:
        request = replace(
            memory.request,
            compile=bool(speed.compile),
            swap_blocks=swap_blocks,
            ulysses_size=ulysses_size,
            # 'auto' never picks the lean blocks under fp8 attention (their plan has no room for its copies)
            lean_activations=False if speed.attention in attention.QUANTIZED else speed.lean_activations,
            fp8_attention=speed.attention in attention.QUANTIZED,
        )
        memory_plan = memory.run(Planner(config, size, frames, request, tuple(image_hw), max_area))
        if swap_blocks == "auto" and memory.free_vram is not None:  # the least swapping that fits
            swap_blocks = memory_plan.swap_blocks
        if speed.lean_activations == "auto":  # on only where the plan needed it (never without a budget)
            speed = replace(speed, lean_activations=memory_plan.lean_activations)
    if speed.lean_activations == "auto":  # no memory check: the normal blocks, today's exact results
        speed = replace(speed, lean_activations=False)
    return Plan(
        size=size,
        frame_num=frames,
        settings=settings,
        config=config,
        camera=camera,
        loras=read_expert_loras(loras, config, allow_unmatched_lora_keys),
        speed=speed,
        memory=memory_plan,
        swap_blocks=swap_blocks,
        ulysses_size=ulysses_size,
    )


def check_ulysses(size, config: DiTConfig, world: int | None = None) -> None:
    """Sequence parallel: a head count it divides and the world it runs in (`world`, default: the initialized
    process group's size). Block swap, LoRAs, the step cache, lean activations and compile all run under it:
    each rank swaps its own copy of the expert, the side paths and the cache's decision are per token or on
    the replicated latent, and the compiled blocks trace the all-to-all as a functional collective."""
    _number("ulysses_size", size, 1, 1024, integer=True)
    if size == 1:
        return
    if config.num_heads % size:
        raise RequestError(
            "ulysses_size", f"{size} does not divide the experts' {config.num_heads} attention heads"
        )
    world = world_size() if world is None else world
    if world != size:
        raise RequestError(
            "ulysses_size",
            f"{size} ranks asked for, but this process group has {world} (launch with "
            f"`torchrun --nproc_per_node {size} ...`)",
        )


def check_lora_merge(sources: dict, quantize, loras, quantize_setting: str = "--quantize") -> None:
    """Merging LoRAs before quantization needs original bf16/fp32 experts (`sources`: their
    `ExpertSource`s) that are quantized while they stream in (the NF4 repack's 4-bit weights cannot
    take a dense delta). `quantize_setting`: how the front end names the quantize switch."""
    if not loras:
        raise RequestError("lora_merge", "no LoRA given to merge")
    if not quantize:
        raise RequestError("lora_merge", f"merging happens before quantization: it needs {quantize_setting}")
    stored_nf4 = [str(s.path) for s in sources.values() if s.quantized]
    if stored_nf4:
        raise RequestError(
            "lora_merge",
            f"these experts are stored as NF4 ({', '.join(stored_nf4)}); merging needs the original "
            "bf16/fp32 experts (upstream's folders) — NF4 experts take LoRAs as a side path",
        )


def read_expert_loras(specs, config: DiTConfig, allow_unmatched: bool = False) -> dict:
    """{'high': [Lora], 'low': [Lora]} for LoraSpecs, checked against the experts' structure (meta)."""
    specs = tuple(specs)
    for spec in specs:
        if not isinstance(spec, LoraSpec):
            raise RequestError("lora", f"expected LoraSpec entries, got {type(spec).__name__}")
    if not specs:
        return {}
    model = meta_model(config)
    return {e: read_loras(specs, model, e, allow_unmatched) for e in ("high", "low")}
