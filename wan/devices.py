"""Where an optional kernel can run: the checks of `fp8`, `fp8_attention` and `fa3_attention` share this, and
the optional kernel packages' modules, imported once."""

import importlib
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


_imported: dict = {}  # optional kernel packages' modules, by name (`kept_import`)


def kept_import(name: str):
    """`importlib.import_module(name)`, kept after the first success. Attention backends look their package up on
    every call; torch.compile does not trace the import machinery, so an import inside a compiled block split its
    graph at every attention call (FlashAttention-3's blocks ran as eleven graph calls each, unfused across
    the splits). A kept module is a plain lookup it traces through. Raises what the import raises."""
    module = _imported.get(name)
    if module is None:
        module = _imported[name] = importlib.import_module(name)
    return module
