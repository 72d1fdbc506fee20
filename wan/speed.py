"""Speed settings of the sampling loop, in one place, and what they do to an expert.

`SpeedOptions()` (every option off) is today's code path, bit for bit. The options:
- ``attention``: a backend of `wan.attention` ('sdpa' default, 'sage', 'fp8', 'fa3', 'fa3_fp8', or one a host
  registered);
- ``compile``: regional `torch.compile` of the DiT blocks: one compiled function runs every block,
  so all 40 blocks (and both experts) share its graphs; no recompiles per block or per step. Falls
  back to eager with one log line when the compiler toolchain is missing or fails;
- ``cache``: None or 'easycache' (`wan.step_cache`), with ``cache_threshold`` (a number or a
  (low-noise, high-noise) pair, like guide_scale) and ``cache_keep_first``/``cache_keep_last``
  (steps always computed at each end of each expert's stretch);
- ``lean_activations``: True runs each DiT block chunk by chunk with only the full-length tensors alive
  (`wan.dit.WanAttentionBlock.forward_lean`: ~14 instead of ~35 [dim] vectors per token); values equal
  the normal path up to GEMM row blocking. 'auto' (the default) is decided by the run planner
  (`session.request.plan_request`): on only when the run would not fit otherwise, before any block
  swap; an 'auto' no planner resolved runs as off. Not with ``compile`` (refused when both are on;
  'auto' never picks it under compile).
- ``fp8``: the DiT blocks' Linears in fp8 e4m3 with row-wise scales (`wan.fp8`; CUDA compute capability
  8.9+). A load setting: the front ends load the experts with ``quantize='fp8'`` (lossy; the deviation from
  the exact path is in benchmarks/bench_fp8.py). Compiles with the blocks (torch's own scaled matmul).
- ``fp8_accum``: their accumulation, 'exact' (the default) or 'fast' (`wan.fp8.accumulation`: faster GEMMs, a
  little more rounding); 'fast' needs ``fp8``.
- ``camera_cache``: the chunked samplers' kept camera injections (`wan.fast.FastConfig.camera_cache`: each
  block's made once per chunk, the same values). 'auto' (the default): on where the memory check fits it; the
  base-cam sampler has no chunks and refuses True.
Guide scale 1 always runs one forward per step (the cond prediction, exactly); no option needed.
"""

import logging
import math
import os
import shutil
from dataclasses import dataclass, field

import torch

from . import attention
from .fp8 import ACCUMULATIONS

log = logging.getLogger("LingBot-World")

CACHES = (None, "easycache")


@dataclass(frozen=True)
class SpeedOptions:
    attention: str = "sdpa"
    compile: bool = False
    cache: str | None = None
    # EasyCache's reference setting for Wan i2v: threshold 0.05, the first 7 steps and the last
    # step computed; here applied to each expert's stretch.
    cache_threshold: float | tuple = 0.05
    cache_keep_first: int = 7
    cache_keep_last: int = 1
    lean_activations: bool | str = "auto"
    fp8: bool = False
    camera_cache: bool | str = "auto"
    fp8_accum: str = "exact"

    def __post_init__(self):
        if not isinstance(self.attention, str):
            raise ValueError(f"attention must be a backend name, got {self.attention!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {list(CACHES)}, got {self.cache!r}")
        pair = self.cache_threshold if isinstance(self.cache_threshold, (tuple, list)) else None
        values = pair if pair is not None else (self.cache_threshold,)
        if (pair is not None and len(pair) != 2) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf for v in values
        ):
            raise ValueError(
                f"cache_threshold must be a finite number >= 0 or a (low, high) pair of them, got {self.cache_threshold!r}"
            )
        if not isinstance(self.fp8, bool):
            raise ValueError(f"fp8 must be True or False, got {self.fp8!r}")
        if self.fp8_accum not in ACCUMULATIONS:
            raise ValueError(f"fp8_accum must be one of {', '.join(ACCUMULATIONS)}, got {self.fp8_accum!r}")
        if self.fp8_accum != "exact" and not self.fp8:
            raise ValueError(f"fp8_accum {self.fp8_accum!r} is the fp8 linears' accumulation: turn fp8 on")
        if not (isinstance(self.camera_cache, bool) or self.camera_cache == "auto"):
            raise ValueError(f"camera_cache must be True, False or 'auto', got {self.camera_cache!r}")
        if not (isinstance(self.lean_activations, bool) or self.lean_activations == "auto"):
            raise ValueError(f"lean_activations must be True, False or 'auto', got {self.lean_activations!r}")
        if self.compile and self.lean_activations is True:
            raise ValueError(
                "lean_activations: the lean blocks do not run compiled; turn off compile or lean_activations"
            )
        if self.attention in attention.QUANTIZED and self.lean_activations is True:
            raise ValueError(
                "lean_activations: the lean blocks' memory plan has no room for fp8 attention's quantized q/k/v "
                "copies; turn off lean_activations or use attention sdpa (or fa3)"
            )
        for name in ("cache_keep_first", "cache_keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    @property
    def lean(self) -> bool:
        """Whether the blocks run lean ('auto' that no planner resolved runs as off)."""
        return self.lean_activations is True

    def threshold_for(self, which: str) -> float:
        """The cache threshold of expert 'high' or 'low'."""
        if isinstance(self.cache_threshold, (tuple, list)):
            return float(self.cache_threshold[1] if which == "high" else self.cache_threshold[0])
        return float(self.cache_threshold)


@dataclass
class SpeedStats:
    """What one sampling run did: transformer forwards run and skipped (by the step cache), per
    expert and in total, and whether the blocks ran compiled."""

    forwards: dict = field(default_factory=lambda: {"high": 0, "low": 0})
    skipped: dict = field(default_factory=lambda: {"high": 0, "low": 0})
    skipped_steps: dict = field(default_factory=lambda: {"high": 0, "low": 0})
    compiled: bool = False

    @property
    def total_forwards(self) -> int:
        return sum(self.forwards.values())

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line for logs: forwards run and skipped per expert, compiled or not."""
        per = ", ".join(f"{e} {self.forwards[e]} run / {self.skipped[e]} skipped" for e in ("high", "low"))
        return (
            f"transformer forwards: {self.total_forwards} run, {self.total_skipped} skipped by the step cache "
            f"({per}); blocks {'compiled' if self.compiled else 'eager'}"
        )

    def as_dict(self) -> dict:
        return {
            "forwards": dict(self.forwards),
            "skipped_forwards": dict(self.skipped),
            "skipped_steps": dict(self.skipped_steps),
            "total_forwards": self.total_forwards,
            "total_skipped_forwards": self.total_skipped,
            "compiled": self.compiled,
        }


def run_block(block, *args):
    """The one function that gets compiled: a DiT block's forward."""
    return block(*args)


def run_chunk_block(block, x, e0, grid, freqs, context, cam, dtype, keys, **deferral):
    """The chunk loop's compiled function (its own graphs and recompile budget): a DiT block with one block's
    chunk-causal keys (`wan.fast.LayerKeys`, which reads no layer index)."""
    return block(x, e0, grid, freqs, context, cam, dtype, 0, keys, **deferral)


def run_growing_chunk_block(block, x, e0, grid, freqs, context, cam, dtype, keys, **deferral):
    """`run_chunk_block` for the chunks before the attention window is full, whose key lengths grow chunk by
    chunk: compiled with the cache's placement as symbols (dynamic shapes), so one set of graphs serves them all."""
    return run_chunk_block(block, x, e0, grid, freqs, context, cam, dtype, keys, **deferral)


def run_camera(block, cam, dtype, cam_input=None):
    """The kept camera injections' compiled function (`wan.fast.FastConfig.camera_cache`): a block's camera
    injection alone, once per chunk."""
    return block.camera(cam, dtype, cam_input)


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile's default backend cannot build kernels for `device`, or None if it can."""
    if not hasattr(torch, "compile"):
        return "this PyTorch has no torch.compile"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is not installed (torch.compile needs it for CUDA kernels)"
    elif device.type == "cpu":
        names = [os.environ.get("CXX"), "c++", "g++", "clang++", "cl"]
        if not any(n and shutil.which(n) for n in names):
            return "no C++ compiler found (torch.compile needs one for CPU kernels)"
    return None


# graphs one shared runner may hold: the decoder's are about 10 per frame size (one per block shape); the chunk
# loop's one per residual dtype, camera form, attention backend and fp8 accumulation a process has run. Dynamo's
# default (8) would send the next setting to eager, silently.
RECOMPILE_LIMIT = 64


class CompiledBlocks:
    """`run(block, *args)` through one torch.compile'd function (dynamic=False: every block has the
    same shapes, so the graphs traced for block 0 serve all blocks). Graphs are keyed by what varies
    between calls: the residual stream's dtype (bf16 into block 0, fp32 after) and whether a camera
    tensor is given, so a run traces at most a handful, all in its first forward. If the backend
    compiler fails, logs one line and runs the blocks eagerly from then on. `dynamic`: shapes and integers
    as symbols (the growing chunks' runner)."""

    def __init__(self, backend="inductor", fn=run_block, what="the DiT blocks", dynamic=False):
        self.fn, self.what = fn, what
        self.compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
        self.failed = False
        # the limit's name, looked up once: torch < 2.7 calls it cache_size_limit
        config = torch._dynamo.config
        self._limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    def __call__(self, block, *args, **deferral):
        if not self.failed:
            try:
                with torch._dynamo.config.patch(self._limit_name, RECOMPILE_LIMIT):
                    return self.compiled(block, *args, **deferral)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                self.failed = True
                cause = getattr(err, "inner_exception", None) or err
                text = (str(cause).strip().splitlines() or [""])[0]
                log.warning(
                    "torch.compile failed (%s: %s); running %s eagerly",
                    type(cause).__name__,
                    text[:300],
                    self.what,
                )
        return self.fn(block, *args, **deferral)


_shared_runners: dict = {}  # the compiled function (`run_block`, `run_chunk_block`, ...) -> its shared runner


def shared_runner(fn, device, what="the DiT blocks", dynamic=False) -> CompiledBlocks | None:
    """The shared compiled runner of `fn` (a fresh one after a compiler failure), or None (eager) with one log
    line when the compiler is unavailable for `device`."""
    reason = compiler_missing(torch.device(device))
    if reason is not None:
        log.warning("compile requested but unavailable: %s; running %s eagerly", reason, what)
        return None
    runner = _shared_runners.get(fn)
    if runner is None or runner.failed:
        runner = _shared_runners[fn] = CompiledBlocks(fn=fn, what=what, dynamic=dynamic)
    return runner


def block_runner(options: SpeedOptions, device) -> CompiledBlocks | None:
    """The shared compiled block runner when `options.compile` asks for it and the compiler is there;
    otherwise None (eager), with one log line when compile was asked for but is unavailable."""
    return shared_runner(run_block, device) if options.compile else None


def chunk_block_runner(device, growing: bool = False) -> CompiledBlocks | None:
    """The chunk loop's shared compiled runner of `run_chunk_block` (`wan.fast.FastConfig.compile`; `growing`: of
    `run_growing_chunk_block`, dynamic), or None (eager) with one log line when the compiler is unavailable."""
    if growing:
        return shared_runner(run_growing_chunk_block, device, "the growing chunks' DiT blocks", dynamic=True)
    return shared_runner(run_chunk_block, device)


def check_fp8_loaded(model: torch.nn.Module, options: SpeedOptions) -> None:
    """`options.fp8` asks for fp8 linears, which the loader makes: refuse an expert loaded without them
    rather than run it in bf16 unnoticed."""
    from .fp8 import is_fp8

    if options.fp8 and not any(is_fp8(m) for m in model.modules()):
        raise ValueError(
            "fp8: the expert was loaded without fp8 linears; load it with quantize='fp8' (CLI --fp8, LingBot "
            "Speed fp8_linears) or from an fp8 folder"
        )


def prepare(model: torch.nn.Module, runner: CompiledBlocks | None) -> None:
    """Make an expert run its blocks through `runner` (None: plain calls). Idempotent."""
    if not hasattr(model, "block_runner"):
        if runner is not None:
            raise ValueError(f"compile=True needs a wan.dit.WanModel expert, got {type(model).__name__}")
        return
    model.block_runner = runner
