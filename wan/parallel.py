"""Sequence parallelism (Ulysses) for the DiT over a `torch.distributed` process group.

Every rank holds the whole expert and the whole (replicated) latent; the transformer's video tokens are
split across the ranks:

- after the patch embedding the [L, C] tokens are padded with zeros to a multiple of the world size N
  (as `wan.i2v.seq_len(..., sp_size)` rounds) and each rank keeps its contiguous L_pad/N slice; the
  camera tokens are split the same way;
- every per-token layer (norms, q/k/v/o, FFN, camera injection, cross-attention against the replicated
  text, the head) runs on the local slice with no communication;
- inside self-attention one all-to-all turns [L_pad/N, H, d] (all heads, local tokens) into
  [L_pad, H/N, d] (all tokens, local heads); RoPE is applied there, where every token sits at its global
  position of the global (f, h, w) grid, the padding is dropped, attention runs on H/N heads over the
  true sequence, and a second all-to-all scatters the output back to [L_pad/N, H, d];
- the head's per-token output is all-gathered so every rank unpatchifies the same full prediction, and
  the scheduler steps the replicated latent identically everywhere.

What else runs under it, and why it needs nothing of the collectives:
- block swap (`wan.block_swap`): each rank is a process with its own GPU and its own copy of the expert,
  and streams its swapped blocks from its own pinned RAM. The copies run on the swapper's side stream and
  touch only that rank's block weights, never a tensor a collective reads or writes; the compute stream
  waits for a block's copy before the block runs, and NCCL's collectives are ordered after the compute
  stream's work as usual, so the prefetch of block i+1 overlaps block i's all-to-alls without
  sharing a buffer with them. No rank waits on another's swap (ranks may even swap different counts).
- LoRA side paths (`wan.lora`): per-token linear layers on the local slice, like the weights they patch.
- the step cache (`wan.step_cache`): it decides from the replicated latent and the gathered prediction,
  the same bytes on every rank; the decision is still taken from rank 0 (`agree`), so the ranks skip the
  same forwards and their collectives stay paired even where a reduction rounds differently on unlike GPUs.
- compile (`--compile`): the compiled blocks trace the all-to-all as torch's functional collective, one graph
  per block with the communication inside (the base-cam step and the chunk loop alike).
- chunked generation (`wan.fast`): each chunk's forward splits its tokens like any other; the chunk-causal
  keys are written inside `attention`'s core, where the rank holds the whole chunk for its H/N heads, so each
  rank's K/V cache keeps its heads only (1/N of it) and its placement (token counts) is the same on every rank.

The heads must split evenly (the A14B's 40 heads: N in 1, 2, 4, 5, 8, 10, 20, 40).

Why the all-to-all glue is written here rather than taken from `yunchang` or `xfuser`: both packages'
Ulysses layers own the attention call and dispatch it to their own kernels (flash-attn, their SageAttention
wrappers), which would bypass this pack's attention registry (`wan.attention`: upstream's SDPA casting,
SageAttention, the host's ComfyUI kernel), and their process-group set-up targets CUDA/NCCL; what this
model needs from them is two `all_to_all_single` calls and an `all_gather`, which `torch.distributed`
provides on NCCL and gloo alike (so the same code is tested on the CPU).
"""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class SequenceParallel:
    """Ulysses over `group` (default: the whole world). Inference only (no autograd through the collectives)."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("sequence parallelism needs an initialized torch.distributed process group")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def check_heads(self, num_heads: int) -> None:
        if num_heads % self.world:
            raise ValueError(heads_issue(self.world, num_heads))

    def padded(self, length: int) -> int:
        return -(-length // self.world) * self.world

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[L, ...] (the same on every rank) -> this rank's slice [L_pad/N, ...] of the zero-padded tokens."""
        pad = self.padded(x.shape[0]) - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.chunk(self.world, dim=0)[self.rank]

    def gather(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Each rank's [L_pad/N, ...] -> the full [length, ...] on every rank (padding dropped)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts)[:length]

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if torch.compiler.is_compiling():  # the functional op traces into the compiled block's graph
            return funcol.all_to_all_single(x, None, None, self.group or dist.group.WORLD)
        out = torch.empty_like(x)  # after .contiguous(): empty_like keeps a transposed input's strides
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[L_pad/N, H, d] -> [L_pad, H/N, d]: the full sequence of this rank's heads."""
        s, h, d = x.shape
        n = self.world
        # rank r sends head group j to rank j; what arrives is stacked by source rank = token slice order
        send = x.view(s, n, h // n, d).transpose(0, 1)  # [N, s, H/N, d]
        return self._all_to_all(send).reshape(n * s, h // n, d)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L_pad, H/N, d] -> [L_pad/N, H, d]: this rank's tokens, all heads (inverse of the above)."""
        length, hn, d = x.shape
        n = self.world
        recv = self._all_to_all(x.view(n, length // n, hn, d))  # [N source ranks (head groups), s, H/N, d]
        return recv.transpose(0, 1).reshape(length // n, n * hn, d)

    def attention(
        self,
        core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        length: int,
    ) -> torch.Tensor:
        """Self-attention on the local token slices: `core(q, k, v)` gets the true `length` tokens of H/N heads
        (RoPE and the attention kernel run inside it) and returns [length, H/N, d]."""
        q, k, v = (self.heads_to_sequence(t)[:length] for t in (q, k, v))
        out = core(q, k, v)
        del q, k, v
        pad = self.padded(length) - length
        if pad:
            out = torch.cat([out, out.new_zeros(pad, *out.shape[1:])])
        return self.sequence_to_heads(out)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` from rank `src` into every rank's `x` (same shape and dtype on every rank), returned."""
        x = x.contiguous()
        dist.broadcast(x, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return x

    def agree(self, flag: bool, device) -> bool:
        """Rank 0's `flag` on every rank (a one-element tensor on `device`, which NCCL needs on the GPU)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        return bool(self.broadcast(t).item())


def degrees(num_heads: int) -> list[int]:
    """The sequence-parallel degrees a model of `num_heads` attention heads runs at: the divisors of its heads."""
    return [n for n in range(1, num_heads + 1) if num_heads % n == 0]


def heads_issue(size: int, num_heads: int) -> str | None:
    """Why `size` ranks cannot split a model of `num_heads` heads (None: they can)."""
    if num_heads % size == 0:
        return None
    works = ", ".join(map(str, degrees(num_heads)))
    return f"ulysses_size {size} must divide the model's {num_heads} attention heads ({works})"


def world_size() -> int:
    """The initialized torch.distributed world's size, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_current: SequenceParallel | None = None


def current() -> SequenceParallel | None:
    """The sequence-parallel group of the forward now running (None: one device, no communication)."""
    return _current


@contextlib.contextmanager
def use(sp: SequenceParallel | None):
    """Run the enclosed DiT forward with `sp` active (None: unchanged); the previous one is restored."""
    global _current
    previous, _current = _current, sp
    try:
        yield sp
    finally:
        _current = previous
