"""The single bridge between the pack and ComfyUI's runtime: devices, memory, interrupts, progress.

Our models are not ComfyUI ModelPatchers (an NF4 expert is loaded, used for its steps and dropped
by `loaders.experts.ExpertSwitcher`), so ComfyUI's model management never sees them. Instead we
ask it to unload its own models before each of our loads, and hand the allocator cache back after
each release, so a workflow mixing core nodes and ours never holds both at once.
"""

import contextlib
import logging

import comfy.model_management as mm
import comfy.utils
import torch

from ..loaders.experts import module_bytes
from ..loaders.monitor import PhaseLog
from ..wan.pipeline import Hooks

log = logging.getLogger("LingBot-World")

GIB = 1 << 30


def torch_device() -> torch.device:
    return mm.get_torch_device()


def intermediate_device() -> torch.device:
    """Where node outputs live between nodes (CPU unless --gpu-only), as core nodes do."""
    return mm.intermediate_device()


def vae_device() -> torch.device:
    return mm.vae_device()


def text_encoder_device() -> torch.device:
    return mm.text_encoder_device()


def make_room(nbytes: int, device) -> None:
    """Unload ComfyUI's own models until `nbytes` are free on `device` (no-op if they already are)."""
    device = torch.device(device)
    mm.free_memory(int(nbytes), device)
    mm.soft_empty_cache()


def device_budget(device) -> int | None:
    """VRAM a run may plan on: the card's total (ComfyUI unloads its own models to make room), None on CPU."""
    device = torch.device(device)
    return None if device.type == "cpu" else int(mm.get_total_memory(device))


def after_release() -> None:
    """Give the allocator cache back once one of our models is dropped."""
    mm.soft_empty_cache()


def check_interrupt() -> bool:
    """For `Hooks.interrupted`: raises ComfyUI's InterruptProcessingException when the user cancels,
    so the executor reports an interruption, not an error. Our models are released on the way out."""
    mm.throw_exception_if_processing_interrupted()
    return False


def _previewer():
    """ComfyUI's latent previewer for Wan2.1 latents as the user configured it (--preview-method), or None."""
    try:
        import comfy.latent_formats
        import latent_preview

        return latent_preview.get_previewer(torch.device("cpu"), comfy.latent_formats.Wan21())
    except Exception as e:  # previews are a nicety; never fail a run for them
        log.debug("no latent preview: %s", e)
        return None


def sampling_hooks(total_steps: int) -> tuple[Hooks, PhaseLog]:
    """pipeline.Hooks wired to a ComfyUI progress bar (with a preview of the last latent frame when
    previews are enabled), to the interrupt flag and to a phase log (time, peak RAM/VRAM)."""
    bar = comfy.utils.ProgressBar(total_steps)
    previewer = _previewer()
    phases = PhaseLog()

    def progress(i: int, n: int, latent: torch.Tensor) -> None:
        preview = None
        if previewer is not None:
            # the normalised latent is the model-space x the Wan21 RGB factors were fitted on
            last = latent[:, -1:].detach().float().cpu()[None]
            preview = previewer.decode_latent_to_preview_image("JPEG", last)
        bar.update_absolute(i, n, preview)  # ComfyUI's progress hook also checks for interrupts

    return Hooks(progress=progress, interrupted=check_interrupt, phase=phases.phase), phases


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device, working_bytes: int = 0):
    """Move `module` to `device` for the block (after making room), then back to the CPU."""
    device = torch.device(device)
    if device.type != "cpu":
        size = module_bytes(module)
        make_room(size + working_bytes, device)
    module.to(device)
    try:
        yield module
    finally:
        if device.type != "cpu":
            module.to("cpu")
            after_release()
