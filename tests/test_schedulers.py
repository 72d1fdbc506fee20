import math

import numpy as np
import pytest
import torch
from lingbot_world.wan.schedulers import (
    FlowEulerScheduler,
    FlowUniPCScheduler,
    cfg,
    expert_for_timestep,
    guide_scale_for,
    make_scheduler,
)

# Bit-identity with upstream's FlowUniPCMultistepScheduler is checked in test_parity.py.

# ---------------------------------------------------------------- schedule


def expert_split(steps: int, shift: float, boundary: float) -> tuple[int, int]:
    """(high-noise steps, low-noise steps): the expert the pipeline picks at each scheduler timestep."""
    which = [expert_for_timestep(t, boundary) for t in FlowUniPCScheduler(steps, shift).timesteps]
    return which.count("high"), which.count("low")


def test_expert_split_defaults():
    assert expert_split(70, 10.0, 0.947) == (26, 44)
    assert expert_split(40, 5.0, 0.947) == (9, 31)
    assert expert_split(40, 5.0, 0.900) == (15, 25)  # Wan2.2's boundary


@pytest.mark.parametrize("cls", [FlowUniPCScheduler, FlowEulerScheduler])
def test_timesteps_and_sigmas(cls):
    s = cls(70, 10.0)
    t = s.timesteps
    assert t.dtype == torch.int64 and t.shape == (70,)
    assert bool((t[1:] < t[:-1]).all())
    assert int(t[0]) == 999 and int(t[-1]) == 126
    assert s.sigmas.dtype == torch.float32 and s.sigmas.shape == (71,)
    assert float(s.sigmas[-1]) == 0.0
    # Unshifted start is float32(0.999); warp sigma' = s*sigma/(1+(s-1)*sigma).
    sig0 = float(np.float32(0.999))
    assert float(s.sigmas[0]) == pytest.approx(10 * sig0 / (1 + 9 * sig0), rel=1e-7)
    # Timesteps are the float64 sigmas * 1000 truncated, so always <= the float32 sigma * 1000 (+ rounding).
    assert bool((t.double() <= s.sigmas[:-1].double() * 1000 + 1e-3).all())
    assert bool((t.double() > s.sigmas[:-1].double() * 1000 - 1).all())


def test_make_scheduler_and_errors():
    assert isinstance(make_scheduler("unipc", 5, 3.0, "cpu"), FlowUniPCScheduler)
    assert isinstance(make_scheduler("euler", 5, 3.0, torch.device("cpu")), FlowEulerScheduler)
    with pytest.raises(ValueError, match="sampler name"):
        make_scheduler("dpm++", 5, 3.0)
    with pytest.raises(ValueError, match="steps"):
        make_scheduler("unipc", 0, 3.0)
    with pytest.raises(ValueError, match="shift"):
        make_scheduler("unipc", 4, 0.0)
    s = make_scheduler("unipc", 2, 3.0)
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="does not match step 0"):
        s.step(x, int(s.timesteps[1]), x)
    for t in s.timesteps:
        x = s.step(torch.ones(2), t, x)
    with pytest.raises(ValueError, match="called 3 times"):
        s.step(x, 0, x)


def test_expert_and_guidance():
    assert expert_for_timestep(947, 0.947) == "high"
    assert expert_for_timestep(torch.tensor(946), 0.947) == "low"
    assert expert_for_timestep(999, 0.947) == "high"
    assert guide_scale_for(960, 0.947, (3.0, 7.0)) == 7.0  # (low, high) order
    assert guide_scale_for(900, 0.947, (3.0, 7.0)) == 3.0
    assert guide_scale_for(900, 0.947, 4.5) == 4.5
    with pytest.raises(ValueError, match="guide_scale"):
        guide_scale_for(900, 0.947, (1.0, 2.0, 3.0))
    c, u = torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])
    assert torch.equal(cfg(c, u, 5.0), torch.tensor([11.0, 1.0]))
    assert torch.equal(cfg(c, u, 1.0), c)


# ---------------------------------------------------------------- toy ODEs


def _gauss_flow(mu: torch.Tensor, c: float):
    """Exact velocity field dx/dsigma for data ~ N(mu, c^2) under x = (1-s) x0 + s n, and the exact ODE map."""

    def var(s):
        return (1 - s) ** 2 * c**2 + s**2

    def v(x, s):
        return -mu + (s - (1 - s) * c**2) / var(s) * (x - (1 - s) * mu)

    def solve_to_zero(x, s):
        return mu + c * (x - (1 - s) * mu) / math.sqrt(var(s))

    return v, solve_to_zero


def _run(name, steps, shift, v, x):
    s = make_scheduler(name, steps, shift)
    for k, t in enumerate(s.timesteps):
        x = s.step(v(x, float(s.sigmas[k])), t, x)
    return x


def test_point_mass_flow_is_exact_for_both():
    # Data is a single point x0: v = noise - x0 = (x - x0)/sigma and both solvers land on x0.
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 3, 5, generator=gen)
    noise = torch.randn(4, 3, 5, generator=gen)
    for name in ("unipc", "euler"):
        s = make_scheduler(name, 6, 5.0)
        x = (1 - s.sigmas[0]) * x0 + s.sigmas[0] * noise
        for k, t in enumerate(s.timesteps):
            x = s.step((x - x0) / s.sigmas[k], t, x)
        torch.testing.assert_close(x, x0, rtol=0, atol=1e-5)


def test_unipc_beats_euler_on_gaussian_flow():
    # Gaussian data has a curved, exactly solvable probability-flow ODE; both solvers converge, UniPC faster.
    gen = torch.Generator().manual_seed(1)
    mu = torch.randn(64, generator=gen, dtype=torch.float64)
    noise = torch.randn(64, generator=gen, dtype=torch.float64)
    v, exact = _gauss_flow(mu, 0.5)
    errs = {}
    for name in ("unipc", "euler"):
        for steps, shift in ((16, 3.0), (32, 3.0), (70, 10.0)):
            s0 = float(make_scheduler(name, steps, shift).sigmas[0])
            x = (1 - s0) * mu + s0 * noise
            out = _run(name, steps, shift, v, x)
            errs[name, steps] = float((out - exact(x, s0)).abs().max())
    for name in ("unipc", "euler"):
        assert errs[name, 32] < 0.6 * errs[name, 16]
    assert errs["unipc", 32] < 5e-3
    for steps in (16, 32, 70):
        assert errs["unipc", steps] < 0.4 * errs["euler", steps]


# ---------------------------------------------------------------- UniPC recursion by hand


def _hand_unipc(sig, v, x, n_steps):
    """Independent float64 re-derivation of UniPC-bh2 (x0 form) for the first steps."""
    lam = [math.log((1 - s) / s) if s > 0 else math.inf for s in sig]
    x0s, x_prev_start = [], None
    for k in range(n_steps):
        x0 = x - sig[k] * v(x, sig[k])
        if k >= 1:  # UniC over [sig[k-1], sig[k]], order 1 at k == 1, else 2
            h = lam[k] - lam[k - 1]
            B = math.expm1(-h)
            base = sig[k] / sig[k - 1] * x_prev_start - (1 - sig[k]) * B * x0s[-1]
            d1_t = x0 - x0s[-1]
            if k == 1:
                corr = 0.5 * d1_t
            else:
                r = (lam[k - 2] - lam[k - 1]) / h
                phi2 = B / (-h) - 1
                b1 = phi2 / B
                b2 = 2 * (phi2 / (-h) - 0.5) / B
                rho0 = (b1 - b2) / (1 - r)
                rho1 = b1 - rho0
                corr = rho0 * (x0s[-2] - x0s[-1]) / r + rho1 * d1_t
            x = base - (1 - sig[k]) * B * corr
        x0s.append(x0)
        x_prev_start = x
        # UniP over [sig[k], sig[k+1]], order 1 at k == 0
        h = lam[k + 1] - lam[k]
        B = math.expm1(-h)
        x = sig[k + 1] / sig[k] * x - (1 - sig[k + 1]) * B * x0
        if k >= 1:
            r = (lam[k - 1] - lam[k]) / h
            x = x - (1 - sig[k + 1]) * B * 0.5 * (x0s[-2] - x0) / r
    return x


def test_unipc_matches_hand_derivation():
    gen = torch.Generator().manual_seed(2)
    mu = torch.randn(32, generator=gen, dtype=torch.float64)
    v, _ = _gauss_flow(mu, 0.5)
    x_init = torch.randn(32, generator=gen, dtype=torch.float64)
    s = FlowUniPCScheduler(12, 5.0)
    sig = [float(a) for a in s.sigmas]
    x = x_init.clone()
    for k in range(4):
        x = s.step(v(x, sig[k]), s.timesteps[k], x)
        torch.testing.assert_close(x, _hand_unipc(sig, v, x_init.clone(), k + 1), rtol=1e-5, atol=1e-6)


def test_last_step_returns_x0_prediction():
    s = FlowUniPCScheduler(3, 5.0)
    x = torch.randn(8, generator=torch.Generator().manual_seed(3))
    for t in s.timesteps[:-1]:
        x = s.step(torch.sin(x), t, x)
    v = torch.cos(x)
    out = s.step(v, s.timesteps[-1], x)
    # Final sigma is 0: the result is the (corrected-sample-independent) x0 of the last model output.
    torch.testing.assert_close(out, x - s.sigmas[-2] * v, rtol=0, atol=1e-6)
