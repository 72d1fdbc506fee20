"""Write tests/golden/unipc_upstream.pt: upstream's FlowUniPCMultistepScheduler run step by step.

    python tests/golden/make_unipc_golden.py PATH/TO/upstream/wan/utils/fm_solvers_unipc.py

Upstream's file imports diffusers; a shim of the few names it uses stands in, so only torch and
numpy are needed. For each case the golden file holds upstream's timesteps and sigmas, the starting
sample, the model output fed at each step (a state-dependent function plus noise, so a divergence
would compound) and upstream's sample after each step. tests/test_schedulers.py replays the model
outputs through ours and asks for the same samples, bit for bit.
"""

import dataclasses
import enum
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "unipc_upstream.pt"
# (steps, shift, sample dtype): upstream's default schedule, a short one, and a bf16 sample.
CASES = [(70, 10.0, torch.float32), (7, 5.0, torch.float32), (5, 3.0, torch.bfloat16)]


def _diffusers_shim():
    """Just enough of diffusers' API for upstream's fm_solvers_unipc.py to import and run."""

    class ConfigMixin:
        def register_to_config(self, **kw):
            for k, val in kw.items():
                setattr(self.config, k, val)

    def register_to_config(init):
        sig = inspect.signature(init)

        def wrapped(self, *a, **kw):
            bound = sig.bind(self, *a, **kw)
            bound.apply_defaults()
            self.config = types.SimpleNamespace(**{k: v for k, v in bound.arguments.items() if k != "self"})
            init(self, *a, **kw)

        return wrapped

    @dataclasses.dataclass
    class SchedulerOutput:
        prev_sample: torch.Tensor

    mods = {
        "diffusers": types.ModuleType("diffusers"),
        "diffusers.configuration_utils": types.ModuleType("diffusers.configuration_utils"),
        "diffusers.schedulers": types.ModuleType("diffusers.schedulers"),
        "diffusers.schedulers.scheduling_utils": types.ModuleType("diffusers.schedulers.scheduling_utils"),
        "diffusers.utils": types.ModuleType("diffusers.utils"),
    }
    mods["diffusers.configuration_utils"].ConfigMixin = ConfigMixin
    mods["diffusers.configuration_utils"].register_to_config = register_to_config
    su = mods["diffusers.schedulers.scheduling_utils"]
    su.KarrasDiffusionSchedulers = enum.Enum("KarrasDiffusionSchedulers", [])
    su.SchedulerMixin = type("SchedulerMixin", (), {})
    su.SchedulerOutput = SchedulerOutput
    mods["diffusers.utils"].deprecate = lambda *a, **k: None
    mods["diffusers.utils"].is_scipy_available = lambda: False
    return mods


def load_upstream(path: Path):
    for name, mod in _diffusers_shim().items():
        sys.modules[name] = mod
    spec = importlib.util.spec_from_file_location("_upstream_fm_solvers_unipc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlowUniPCMultistepScheduler


def run_case(cls, steps: int, shift: float, dtype: torch.dtype) -> dict:
    ref = cls(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
    ref.set_timesteps(steps, device="cpu", shift=shift)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, 2, 3, 3, generator=gen).to(dtype)
    case = {"timesteps": ref.timesteps.clone(), "sigmas": ref.sigmas.clone(), "x_init": x.clone()}
    outputs, samples = [], []
    for t in ref.timesteps:
        v = torch.tanh(x.float() * 1.3) + 0.1 * torch.randn(x.shape, generator=gen)  # fp32, as the DiT gives
        x = ref.step(v, t, x, return_dict=False)[0]
        outputs.append(v)
        samples.append(x.clone())
    case.update(model_outputs=torch.stack(outputs), samples=torch.stack(samples))
    return case


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_file():
        raise SystemExit(f"usage: {Path(__file__).name} PATH/TO/wan/utils/fm_solvers_unipc.py")
    cls = load_upstream(Path(argv[0]))
    golden = {f"{steps}_{shift}_{str(dtype).removeprefix('torch.')}": run_case(cls, steps, shift, dtype)
              for steps, shift, dtype in CASES}  # fmt: skip
    torch.save(golden, OUT)
    print(f"wrote {OUT} ({', '.join(golden)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
