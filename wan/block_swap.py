"""Block swap: keep some DiT blocks' weights in (pinned) host RAM and stream them in just ahead of use.

`BlockSwapper(model, n)` takes the last `n` blocks of a loaded `WanModel`: every tensor of such a block
(parameters, including bitsandbytes' packed 4-bit data and the tensors of its quant state, nested
statistics included; buffers, including the LoRA side paths of `wan.lora`) is packed into one flat
host buffer per block (pinned when the model runs on CUDA) and the module's tensors become views of
it, so the device copy is freed. During `WanModel.forward` the model calls `before(i)` / `after(i)`
around block i: a swapped block is copied to the device in one transfer on a side CUDA stream, one
block ahead (double-buffered: block i+1's copy overlaps block i's compute), the compute stream waits
for its copy, and after the block ran its device copy is dropped. The bytes are the same, so results
are bit-identical to no swap. On CPU (no streams) the copy is a plain CPU copy.

Under sequence parallel (`wan.parallel`) every rank runs its own swapper over its own copy of the expert,
from its own pinned RAM, to its own GPU: the side-stream copies touch only block weights, never a buffer
of the all-to-all, and add no communication, so they need nothing from the other ranks.

The swapper holds the only host copy of the swapped blocks: `close()` (or `unpin()` to keep the
model usable in pageable RAM) frees the pinned buffers. Tensors added to a swapped block after the
swapper was made (a LoRA attached later) are not swapped: close the swapper first.
"""

from __future__ import annotations

import torch
from torch import nn

_ALIGN = 64  # bytes; every tensor's view starts on this boundary in the flat buffers


def _quant_state_slots(qs, seen: set) -> list:
    """[(object, attribute)] for the tensors of a bitsandbytes QuantState (and its nested state2)."""
    if qs is None or id(qs) in seen:
        return []
    seen.add(id(qs))
    slots = [(qs, k) for k, v in vars(qs).items() if isinstance(v, torch.Tensor)]
    return slots + _quant_state_slots(getattr(qs, "state2", None), seen)


class _Slot:
    """One tensor of a block: where it lives (a parameter, a buffer or an attribute) and how to swap it."""

    __slots__ = ("kind", "owner", "name", "shape", "dtype", "offset", "nbytes")

    def __init__(self, kind: str, owner, name: str, t: torch.Tensor, offset: int):
        self.kind, self.owner, self.name = kind, owner, name
        self.shape, self.dtype, self.offset = t.shape, t.dtype, offset
        self.nbytes = t.numel() * t.element_size()

    def get(self) -> torch.Tensor:
        if self.kind == "param":
            return self.owner._parameters[self.name].data
        if self.kind == "buffer":
            return self.owner._buffers[self.name]
        return getattr(self.owner, self.name)

    def set(self, t: torch.Tensor) -> None:
        if self.kind == "param":
            self.owner._parameters[self.name].data = t
        elif self.kind == "buffer":
            self.owner._buffers[self.name] = t
        else:
            setattr(self.owner, self.name, t)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _block_slots(block: nn.Module) -> tuple[list, int]:
    slots, seen_qs, offset = [], set(), 0

    def add(kind, owner, name, t):
        nonlocal offset
        if t is None or t.is_meta:
            raise ValueError(f"block swap: {name} has no weights (meta); swap a loaded model")
        slots.append(_Slot(kind, owner, name, t, offset))
        offset += -(-slots[-1].nbytes // _ALIGN) * _ALIGN

    for module in block.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            add("param", module, name, p.data)
            for qs in (getattr(p, "quant_state", None), getattr(module, "quant_state", None)):
                for owner, attr in _quant_state_slots(qs, seen_qs):
                    add("attr", owner, attr, getattr(owner, attr))
        for name, b in module._buffers.items():
            if b is not None:
                add("buffer", module, name, b)
    return slots, offset


class BlockSwapper:
    """Streams the last `n` blocks of `model` (a loaded `wan.dit.WanModel`) from host RAM; see module doc.

    `device`: where the blocks run (default: the device of the model's first resident parameter).
    """

    def __init__(self, model: nn.Module, n: int, device=None):
        blocks = getattr(model, "blocks", None)
        if blocks is None or not hasattr(model, "block_swap"):
            raise ValueError(f"block swap needs a wan.dit.WanModel, got {type(model).__name__}")
        total = len(blocks)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= total:
            raise ValueError(f"swap_blocks: expected an integer in [0, {total}], got {n!r}")
        if model.block_swap is not None:
            raise ValueError("block swap: this model already has a swapper; close it first")
        if device is None:
            device = next(model.patch_embedding.parameters()).device
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.model = model
        self.indices = list(range(total - n, total))
        self._swapped = set(self.indices)
        self._slots: dict[int, list] = {}
        self._host: dict[int, torch.Tensor] = {}  # block index -> flat host buffer (pinned on CUDA)
        self._live: dict[int, tuple] = {}  # block index -> (device flat buffer, copy-done event or None)
        self._stream = torch.cuda.Stream(self.device) if self.cuda and n else None
        try:
            for i in self.indices:
                self._offload(i)
        except BaseException:
            self.unpin()  # the blocks offloaded so far stay usable, in pageable RAM
            raise
        model.block_swap = self if n else None

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self._host.values())

    def _offload(self, i: int) -> None:
        slots, nbytes = _block_slots(self.model.blocks[i])
        flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self._slots[i], self._host[i] = slots, flat
        for s in slots:
            src = s.get()
            dst = s.view(flat)
            dst.copy_(src)
            s.set(dst)  # the device copy is freed here (its last reference)
            del src

    def _fetch(self, i: int) -> None:
        host = self._host[i]
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                dev = torch.empty(host.shape, dtype=torch.uint8, device=self.device)
                dev.copy_(host, non_blocking=True)
                event = self._stream.record_event()
            dev.record_stream(compute)  # not reused by the side stream until compute is done with it
        else:
            dev, event = host.clone(), None
        for s in self._slots[i]:
            s.set(s.view(dev))
        self._live[i] = (dev, event)

    def _drop(self, i: int) -> None:
        if self._live.pop(i, None) is None:
            return
        host = self._host[i]
        for s in self._slots[i]:
            s.set(s.view(host))

    def before(self, i: int) -> None:
        """Called by the model before block i: its weights are on the device once this returns (in
        stream order), and the next swapped block's copy is under way."""
        if i in self._swapped:
            if i not in self._live:
                self._fetch(i)
            event = self._live[i][1]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        nxt = next((j for j in self.indices if j > i), None)
        if nxt is not None and nxt not in self._live and len(self._live) < 2:
            self._fetch(nxt)

    def after(self, i: int) -> None:
        if i in self._swapped:
            self._drop(i)

    def finish(self) -> None:
        """End of a forward (or an error in it): no swapped block stays on the device."""
        for i in list(self._live):
            self._drop(i)

    def unpin(self) -> None:
        """Detach from the model leaving each swapped tensor in its own pageable host copy (parking)."""
        self.finish()
        for slots in self._slots.values():
            for s in slots:
                s.set(s.get().clone())
        self._forget()

    def close(self) -> None:
        """Detach and free the host buffers. The swapped blocks' weights go with them (meta), so the
        model is unusable after this unless `unpin` ran first; use it when the model is released."""
        self.finish()
        for slots in self._slots.values():
            for s in slots:
                meta = torch.empty(s.shape, dtype=s.dtype, device="meta")
                if s.kind == "param":  # a tensor of another device type cannot become a parameter's data
                    s.owner._parameters[s.name] = nn.Parameter(meta, requires_grad=False)
                else:
                    s.set(meta)
        self._forget()

    def _forget(self) -> None:
        if getattr(self.model, "block_swap", None) is self:
            self.model.block_swap = None
        self._slots.clear()
        self._host.clear()
        self._live.clear()
        if self._stream is not None:
            self._stream.synchronize()
        self._stream = None
        if self.cuda:
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:
                host_empty()  # pinned blocks go back to the system, not to torch's host cache


def resolve_swap_blocks(value, num_layers: int) -> int:
    """The `swap_blocks` setting as a block count: an integer in [0, num_layers], or 'auto' (all
    blocks until a planner picks the least swapping that fits). Raises ValueError naming it."""
    if value is None:
        return 0
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return num_layers
        if v.isdigit():
            value = int(v)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= num_layers:
        raise ValueError(f"swap_blocks: expected an integer in [0, {num_layers}] or 'auto', got {value!r}")
    return value
