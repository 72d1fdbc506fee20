"""Where an optional kernel can run: the checks of `fp8`, `fp8_attention` and `fa3_attention` share this."""

from collections.abc import Callable

import torch


def cuda_index(device) -> int:
    """The GPU index of a CUDA `device` (plain 'cuda': the current one)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def card_problem(device, off_card: Callable[[str], str], on_card: Callable[[int], str | None]) -> str | None:
    """Why a kernel cannot run on `device`: `off_card(device type)` off CUDA, else `on_card(GPU index)` (None:
    it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return off_card(device.type)
    return on_card(cuda_index(device))
