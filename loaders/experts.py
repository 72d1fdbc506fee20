"""Expert residency for the dual-expert loop: only one expert on the device at a time.

On a switch the resident expert is either dropped (and streamed again from disk when next needed)
or parked in host RAM while the parked total stays under `ram_budget` bytes, which makes repeated
runs in one process (the ComfyUI node's `keep_in_ram_gb`) skip the disk read at the cost of that RAM.

With `swap_blocks` > 0 the resident expert's last that many DiT blocks live in pinned host RAM and stream
through the device block by block (`wan.block_swap`); only the resident expert is pinned: its pinned
buffers are freed when it is released (dropped, or copied to pageable RAM when parked).
"""

from pathlib import Path

import torch

from ..wan.block_swap import BlockSwapper, resolve_swap_blocks
from ..wan.lora import attach_lora
from .formats import ExpertSource
from .monitor import free_memory
from .stream import load_expert, release


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _to_device_except(model: torch.nn.Module, swapped: set, device) -> None:
    """Move everything of a WanModel but the swapped blocks (which the BlockSwapper holds) to `device`."""
    for name, child in model.named_children():
        if name == "blocks":
            for i, block in enumerate(child):
                if i not in swapped:
                    block.to(device)
        else:
            child.to(device)


class ExpertSwitcher:
    """Callable `switcher('high'|'low') -> WanModel` for `wan.pipeline`."""

    def __init__(
        self,
        paths: dict,
        device,
        quantize: bool | None = None,
        ram_budget: int = 0,
        on_load=None,
        loras=None,
        swap_blocks=0,
        merge_loras: bool | dict = False,
    ):
        missing = {"high", "low"} - set(paths)
        if missing:
            raise ValueError(f"expert paths: missing {sorted(missing)}; expected keys 'high' and 'low'")
        # a path, or an ExpertSource already read (a folder without config.json, e.g. LingBot-World-Fast)
        self.paths = {k: v if isinstance(v, ExpertSource) else Path(v) for k, v in paths.items()}
        self.device = torch.device(device)
        self.quantize = quantize
        self.ram_budget = ram_budget
        self.on_load = on_load  # optional callback(name, model) after a load, e.g. for logging
        # {'high'|'low': [wan.lora.Lora]}: attached after each load from disk (parked experts keep theirs)
        self.loras = loras or {}
        # {'high'|'low': [Lora]} added into the dense weights as they stream in, before quantizing: True takes
        # all of `loras` (none attached then); a dict gives these apart from `loras`, which stay side paths
        self.merged = merge_loras if isinstance(merge_loras, dict) else self.loras if merge_loras else {}
        if merge_loras is True:
            self.loras = {}
        self.loads = 0  # how many times an expert was streamed from disk
        self._name = None
        self._model = None
        self._parked: dict[str, torch.nn.Module] = {}
        self.swap_blocks = swap_blocks  # int or 'auto', resolved against each loaded expert's depth
        self._swapper: BlockSwapper | None = None

    def __call__(self, name: str) -> torch.nn.Module:
        if name not in self.paths:
            raise ValueError(f"expert must be 'high' or 'low', got {name!r}")
        if name == self._name:
            return self._model
        self.release()
        # With swap the expert is assembled in host RAM and only its resident part goes to the device,
        # so the device never holds the whole expert (the point of swapping on a small card).
        staging = self.device if self.swap_blocks in (0, "0", None) else torch.device("cpu")
        model = self._parked.pop(name, None)
        if model is not None:
            model = model.to(staging)
        else:
            merge = self.merged.get(name, ())
            model = load_expert(self.paths[name], staging, quantize=self.quantize, merge_loras=merge)
            self.loads += 1
            try:
                for lora in self.loras.get(name, ()):
                    attach_lora(model, lora)
            except BaseException:
                release(model)
                raise
        try:
            self._swapper = self._swap(model)
            if staging != self.device:
                swapped = set() if self._swapper is None else set(self._swapper.indices)
                _to_device_except(model, swapped, self.device)
        except BaseException:
            if self._swapper is not None:
                self._swapper.close()
                self._swapper = None
            release(model)
            raise
        self._name, self._model = name, model
        if self.on_load is not None:
            self.on_load(name, model)
        return model

    def _swap(self, model) -> BlockSwapper | None:
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            return None
        n = resolve_swap_blocks(self.swap_blocks, len(blocks))
        if not n:
            return None
        swapper = BlockSwapper(model, n, self.device)
        free_memory()  # the swapped blocks' device copies go back to the card now
        return swapper

    @property
    def resident(self) -> str | None:
        return self._name

    def release(self):
        """Take the resident expert off the device: park it in RAM if the budget allows, else drop it."""
        if self._model is None:
            return
        model, name, swapper = self._model, self._name, self._swapper
        self._model = self._name = self._swapper = None
        parked = sum(module_bytes(m) for m in self._parked.values())
        if parked + module_bytes(model) <= self.ram_budget:
            if swapper is not None:
                swapper.unpin()  # parked in pageable RAM: only the resident expert is pinned
            self._parked[name] = model.to("cpu")
            free_memory()
        else:
            if swapper is not None:
                swapper.close()
            release(model)  # frees its weights now, whoever else still holds the module

    def close(self):
        """Release everything, parked experts included."""
        self.release()
        for model in self._parked.values():
            release(model)
        self._parked.clear()
