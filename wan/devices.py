"""Where an optional kernel can run: the checks of `fp8`, `fp8_attention` and `fa3_attention` share this, the
optional kernel packages' modules, imported once, and whether the blocks' Triton kernels (`fp8_gelu`, `qk_rope`,
`fp8_inputs`) can take a tensor."""

import importlib
import os
from collections.abc import Callable

import torch

# no Triton, or a broken install (it must not stop the pack from loading): the unfused paths
try:
    import triton
except Exception:
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether this process's Triton kernels can take tensor t: on CUDA, or anywhere under its interpreter."""
    return triton is not None and (t.is_cuda or _INTERPRET)


def power_of_two_blocks(cols: int, count: int) -> tuple[int, ...]:
    """A row's width as up to `count` power-of-two blocks for a Triton kernel (its tiles are powers of two), so few
    lanes idle: each the largest power of two within what is left, the last rounded up (at least 16) to cover the
    rest; a zero is no such block. 3 blocks: 8960 = 8192 + 512 + 256, 13824 = 8192 + 4096 + 1536 in a block of 2048;
    2 blocks: 1536 = 1024 + 512, 5120 = 4096 + 1024, 300 = 256 + 44 in a block of 64."""
    blocks, rest = [], cols
    for _ in range(count - 1):
        block = 1 << (rest.bit_length() - 1) if rest else 0
        blocks.append(block)
        rest -= block
    blocks.append(max(16, 1 << (rest - 1).bit_length()) if rest else 0)
    return tuple(blocks)


def lingbot_op(name: str, fn: Callable, fake: Callable, mutates_args: tuple = ()) -> None:
    """`fn` as the custom op `torch.ops.lingbot.<name>` with its fake (shape) implementation `fake`, registered once
    per process: the pack may be imported under two names, and the second import finds the first's op."""
    try:
        getattr(torch.ops.lingbot, name)
    except (AttributeError, RuntimeError):
        torch.library.custom_op(f"lingbot::{name}", fn, mutates_args=mutates_args).register_fake(fake)


def channels_last_3d_strides(shape) -> tuple[int, ...]:
    """The strides of a dense channels-last-3d tensor of `shape` [n, c, t, h, w] (memory n, t, h, w, c), size-1
    dims' included: what the fast decoder's compiled steps are keyed by and its conv kernel writes."""
    _, c, t, h, w = shape
    return (c * t * h * w, 1, h * w * c, w * c, c)


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
