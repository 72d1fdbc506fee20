"""Flow-matching samplers and the two-expert schedule of LingBot-World i2v.

`FlowUniPCScheduler` is a compact re-implementation of the single path upstream's
FlowUniPCMultistepScheduler takes at inference (solver_order 2, UniC corrector + UniP predictor,
B(h) = expm1 ('bh2'), x0 prediction from flow velocity, lower order at the first and last step, final
sigma 0). Scalars are computed as float32 0-dim tensors and combined in the same order as upstream, so
the arithmetic matches it step for step. `FlowEulerScheduler` is a first-order alternative on the same
sigmas.

Flow convention: x_sigma = (1 - sigma) * x0 + sigma * noise, the model predicts v = noise - x0.
"""

import numpy as np
import torch

from .config import NUM_TRAIN_TIMESTEPS

# Upstream builds a 1000-step training schedule sigma = 1 - linspace(1, 1/1000, 1000)[::-1] in float32 and
# samples between its ends: sigma_max = float32(0.999) and sigma_min = 0. Starting below 1 keeps the
# log-SNR finite at the first step.
SIGMA_MAX = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))
SIGMA_MIN = 0.0


def sampling_sigmas(steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps int64 [steps], sigmas float32 [steps + 1] ending in 0) as upstream's set_timesteps."""
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    sigmas = np.linspace(SIGMA_MAX, SIGMA_MIN, steps + 1).copy()[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)  # float64, upstream's operation order
    timesteps = torch.from_numpy(sigmas * NUM_TRAIN_TIMESTEPS).to(torch.int64)  # truncates
    sigmas = torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))
    return timesteps, sigmas


class _FlowScheduler:
    """Shared schedule and step counter. Call `step` once per entry of `.timesteps`, in order."""

    def __init__(self, steps: int, shift: float, device=None):
        timesteps, self.sigmas = sampling_sigmas(steps, shift)  # sigmas stay on CPU like upstream
        self.timesteps = timesteps.to(device)
        self.num_inference_steps = len(timesteps)
        self.shift = shift
        self.step_index = 0

    def _advance(self, timestep) -> int:
        k = self.step_index
        if k >= self.num_inference_steps:
            raise ValueError(f"step() called {k + 1} times but the schedule has {k} steps")
        # Upstream only uses the timestep to find its start index; here it guards against a loop out of sync.
        t = int(timestep.item() if isinstance(timestep, torch.Tensor) else timestep)
        if t != int(self.timesteps[k]):
            raise ValueError(
                f"timestep {t} does not match step {k} of the schedule (expected {int(self.timesteps[k])})"
            )
        return k


class FlowEulerScheduler(_FlowScheduler):
    """x_next = x + (sigma_next - sigma) * v on upstream's UniPC sigmas."""

    def step(
        self, model_output: torch.Tensor, timestep, sample: torch.Tensor, generator=None
    ) -> torch.Tensor:
        k = self._advance(timestep)
        dt = self.sigmas[k + 1] - self.sigmas[k]
        prev = (sample + dt * model_output).to(sample.dtype)
        self.step_index += 1
        return prev


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    """Log-SNR of the flow path (alpha = 1 - sigma); +inf at sigma = 0."""
    return torch.log(1 - sigma) - torch.log(sigma)


class FlowUniPCScheduler(_FlowScheduler):
    """UniPC-bh2, order 2, predicting x0, as upstream runs it (see module docstring)."""

    order = 2

    def __init__(self, steps: int, shift: float, device=None):
        super().__init__(steps, shift, device)
        self.model_outputs = [None] * self.order  # x0 predictions, newest last
        self.last_sample = None  # sample the last predictor started from
        self.this_order = 1

    def _coeffs(self, k_t: int, k_s0: int):
        """Per-interval scalars from sigma[k_s0] to sigma[k_t] (all float32 0-dim tensors)."""
        sigma_t, sigma_s0 = self.sigmas[k_t], self.sigmas[k_s0]
        alpha_t = 1 - sigma_t
        h = _lambda(sigma_t) - _lambda(sigma_s0)
        hh = -h  # predict_x0
        h_phi_1 = torch.expm1(hh)
        b_h = torch.expm1(hh)  # bh2
        return sigma_t, sigma_s0, alpha_t, h, hh, h_phi_1, b_h

    def _rk(self, k_i: int, k_s0: int, h: torch.Tensor) -> torch.Tensor:
        return (_lambda(self.sigmas[k_i]) - _lambda(self.sigmas[k_s0])) / h

    def _predict(self, sample: torch.Tensor, order: int) -> torch.Tensor:
        """UniP: from sigma[k] to sigma[k+1] using the newest (and, for order 2, previous) x0."""
        k = self.step_index
        m0 = self.model_outputs[-1]
        sigma_t, sigma_s0, alpha_t, h, _, h_phi_1, b_h = self._coeffs(k + 1, k)
        x_t = sigma_t / sigma_s0 * sample - alpha_t * h_phi_1 * m0
        if order == 2:
            d1 = (self.model_outputs[-2] - m0) / self._rk(k - 1, k, h)
            x_t = x_t - alpha_t * b_h * (0.5 * d1)  # order 2 uses the fixed rho_p = 1/2
        return x_t.to(sample.dtype)

    def _correct(self, x0_t: torch.Tensor, order: int) -> torch.Tensor:
        """UniC: redo the last interval sigma[k-1] -> sigma[k] with the new x0 at sigma[k]."""
        k = self.step_index
        x = self.last_sample
        m0 = self.model_outputs[-1]
        sigma_t, sigma_s0, alpha_t, h, hh, h_phi_1, b_h = self._coeffs(k, k - 1)
        x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
        d1_t = x0_t - m0
        if order == 1:
            res = 0.5 * d1_t
        else:
            rk = self._rk(k - 2, k - 1, h)
            d1 = (self.model_outputs[-2] - m0) / rk
            # rho from R rho = b with R = [[1, 1], [rk, 1]], b_i = i! * h_phi_{i+1}(hh) / B(h).
            h_phi_k = h_phi_1 / hh - 1
            b1 = h_phi_k * 1 / b_h
            h_phi_k = h_phi_k / hh - 1 / 2
            b2 = h_phi_k * 2 / b_h
            one = torch.ones((), device=x.device)
            R = torch.stack([torch.stack([one, one]), torch.stack([rk.to(x.device), one])])
            rhos = torch.linalg.solve(R, torch.stack([b1, b2]).to(x.device)).to(x.dtype)
            res = rhos[0] * d1 + rhos[1] * d1_t
        return (x_t - alpha_t * b_h * res).to(x.dtype)

    def step(
        self, model_output: torch.Tensor, timestep, sample: torch.Tensor, generator=None
    ) -> torch.Tensor:
        """One sampler step: model_output is the (guided) velocity at `sample`; returns the next sample.

        `generator` is accepted for interface parity and unused (the solver is deterministic).
        """
        k = self._advance(timestep)
        x0 = sample - self.sigmas[k] * model_output  # from the uncorrected sample, as upstream
        if k > 0 and self.last_sample is not None:
            sample = self._correct(x0, self.this_order)
        self.model_outputs = self.model_outputs[1:] + [x0]
        # Warm-up: order 1 at step 0; lower_order_final: order 1 at the last step.
        self.this_order = min(self.order, self.num_inference_steps - k, k + 1)
        self.last_sample = sample
        prev = self._predict(sample, self.this_order)
        self.step_index += 1
        return prev


SCHEDULERS = {"unipc": FlowUniPCScheduler, "euler": FlowEulerScheduler}


def make_scheduler(name: str, steps: int, shift: float, device=None) -> _FlowScheduler:
    """'unipc' (upstream default) or 'euler', with timesteps on `device`."""
    if name not in SCHEDULERS:
        raise ValueError(f"sampler name must be one of {sorted(SCHEDULERS)}, got {name!r}")
    return SCHEDULERS[name](steps, shift, device)


def _t(t) -> float:
    return t.item() if isinstance(t, torch.Tensor) else t


def expert_for_timestep(t, boundary: float) -> str:
    """'high' (high-noise expert) iff t >= boundary * 1000, the exact float64 product upstream compares."""
    return "high" if _t(t) >= boundary * NUM_TRAIN_TIMESTEPS else "low"


def guide_scale_for(t, boundary: float, guide_scale=(5.0, 5.0)) -> float:
    """CFG scale for timestep t; guide_scale is a number or upstream's (low-noise, high-noise) pair."""
    if isinstance(guide_scale, (int, float)):
        return float(guide_scale)
    if len(guide_scale) != 2:
        raise ValueError(f"guide_scale must be a number or a (low, high) pair, got {guide_scale!r}")
    return guide_scale[1] if expert_for_timestep(t, boundary) == "high" else guide_scale[0]


def cfg(cond: torch.Tensor, uncond: torch.Tensor, g: float) -> torch.Tensor:
    """Classifier-free guidance, upstream's order of operations."""
    return uncond + g * (cond - uncond)
