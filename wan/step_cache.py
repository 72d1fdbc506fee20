"""EasyCache (Zhou et al. 2025, "Less is Enough: Training-Free Video Diffusion Acceleration via
Runtime-Adaptive Caching"): skip whole transformer forwards while the model's output is predicted
to change little, reusing the last computed output as a residual on the current input.

The rule, per sampling step t with input latent x_t and model output v_t:
- transformation rate k = mean|v_a - v_b| / mean|x_a - x_b| over the two most recent fully computed
  steps a > b (the output's change per unit of input change; it varies slowly along the trajectory,
  which is what makes it usable as a predictor without calibration);
- at every step after the last computed one, the predicted relative output change
  k * mean|x_t - x_{t-1}| / mean|v_a| is added to an accumulator;
- while the accumulator stays below the threshold the step reuses the cache: v_t = x_t + (v_a - x_a),
  per CFG branch (cond and uncond keep their own residual; the cond branch decides for both);
- once it reaches the threshold the step is computed and the accumulator restarts from 0.
The first `keep_first` and last `keep_last` steps are always computed (the trajectory's warm-up and
its final refinement), and a new rate needs two computed steps.

Here the state lives for one expert's stretch of steps: `start` resets it at every expert switch,
since the other expert's outputs say nothing about this one's. With threshold 0 the accumulator (a
sum of non-negative terms) is never below it, so every step is computed and the result is exactly
the uncached one.
"""

import torch


def _mean_abs(t: torch.Tensor) -> float:
    return t.abs().float().mean().item()


class EasyCache:
    def __init__(self, keep_first: int, keep_last: int):
        for name, value in (("cache_keep_first", keep_first), ("cache_keep_last", keep_last)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.keep_first = keep_first
        self.keep_last = keep_last
        self.start(0, 0.0)

    def start(self, steps: int, threshold: float) -> None:
        """Begin a stretch of `steps` steps of one expert with this threshold; forget everything."""
        if not threshold >= 0:
            raise ValueError(f"cache_threshold must be >= 0, got {threshold!r}")
        self.steps = steps
        self.threshold = float(threshold)
        self.index = -1  # step within the stretch
        self.accumulated = 0.0
        self.rate = None  # k
        self.x_prev = None  # input of the previous step (computed or not)
        self.x_done = None  # input and cond output of the last computed step
        self.v_done = None
        self.v_done_norm = None
        self.residual: dict[str, torch.Tensor] = {}
        self.skipping = False

    def should_skip(self, x: torch.Tensor, agree=None) -> bool:
        """Decide for the next step (call once per step, before its forwards). `agree(skip) -> skip`:
        replaces the decision with a shared one (sequence parallel: rank 0's), so every process skips alike."""
        self.index += 1
        j, x_prev, self.x_prev = self.index, self.x_prev, x
        skip = False
        if self.keep_first <= j < self.steps - self.keep_last and self.rate is not None:
            self.accumulated += self.rate * _mean_abs(x - x_prev) / self.v_done_norm
            skip = self.accumulated < self.threshold
        if agree is not None:
            skip = agree(skip)
        if not skip:
            self.accumulated = 0.0
        self.skipping = skip
        return skip

    def reuse(self, branch: str, x: torch.Tensor) -> torch.Tensor:
        """The cached output of `branch` carried to input `x`."""
        if branch not in self.residual:
            raise RuntimeError(f"step cache: no cached output for the {branch!r} branch")
        return x + self.residual[branch]

    def store(self, branch: str, x: torch.Tensor, v: torch.Tensor) -> None:
        """Record a computed output; the 'cond' branch also updates the rate."""
        self.residual[branch] = v - x
        if branch != "cond":
            return
        if self.v_done is not None:
            dx = _mean_abs(x - self.x_done)
            self.rate = _mean_abs(v - self.v_done) / dx if dx > 0 else None
        self.x_done, self.v_done = x, v
        norm = _mean_abs(v)
        self.v_done_norm = norm if norm > 0 else None
        if self.v_done_norm is None:
            self.rate = None  # a zero output gives no relative change to predict from
