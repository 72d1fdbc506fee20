"""LoRA on a loaded `WanModel`, unmerged: the (NF4 or dense) weights are never rewritten.

A LoRA is a mapping {target: LoraPatch} where a target is a module path of this model
(`blocks.3.self_attn.q`, `head.head`, `blocks.0.norm3`, `patch_embedding`) or the path of a bare
parameter (`blocks.0.modulation`, `head.modulation`). On an nn.Linear (bitsandbytes Linear4bit
included) every patch becomes a side path that `wan.dit.linear` adds to the layer's output:

    low rank (down [r, in], up [out, r], alpha):  strength * alpha / r * (x @ down.T) @ up.T
    full delta `diff` [out, in]:                  strength * x @ diff.T   (dense; memory warned)
    bias delta `diff_b` [out]:                    strength * diff_b

held as non-persistent buffers of a `lora` submodule, so they follow `model.to(...)` and never
enter a state dict. Norms, the patch-embedding conv and modulation tables take only `diff` /
`diff_b`, added to the parameter in place (weight += strength * diff) with the original kept on
the host, so detaching restores it exactly. Several LoRAs stack; each `attach_lora` returns a
handle for `detach_lora`.

`merge_into_weight` is the merge-before-quantize alternative: the dense tensor a loader is about
to quantize, with every patch for it added.
"""

import itertools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

# Linears that wan.dit runs in fp32 (time embedding, time projection, head): their side paths are
# kept in fp32 too; every other side path is kept in the model's compute dtype.
FP32_LINEARS = frozenset({"time_embedding.0", "time_embedding.2", "time_projection.1", "head.head"})
PARTS = ("down", "up", "alpha", "diff", "diff_b")
LIST_LIMIT = 12  # problems shown per error
_ids = itertools.count(1)


class LoraError(ValueError):
    """A LoRA that does not fit the model; the message names the file's tensor and what was expected."""


@dataclass
class LoraPatch:
    """One target's tensors from one LoRA file; `keys` names each part's tensor in the file."""

    down: torch.Tensor | None = None  # [rank, in]
    up: torch.Tensor | None = None  # [out, rank]
    alpha: float | None = None  # scale = alpha / rank; None means 1
    diff: torch.Tensor | None = None  # full delta of the weight (or of a bare parameter)
    diff_b: torch.Tensor | None = None  # delta of the bias
    keys: dict = field(default_factory=dict)

    def key(self, target: str, part: str) -> str:
        return self.keys.get(part, f"{target}.{part}")

    @property
    def scale(self) -> float:
        if self.alpha is None or self.down is None:
            return 1.0
        return float(self.alpha) / self.down.shape[0]


@dataclass
class Lora:
    """A LoRA file's patches with the strength it is applied at. Tuples (down, up, alpha, diff,
    diff_b) are accepted as patches."""

    patches: dict
    strength: float = 1.0
    name: str = "LoRA"

    def __post_init__(self):
        self.patches = {t: p if isinstance(p, LoraPatch) else LoraPatch(*p) for t, p in self.patches.items()}


@dataclass(frozen=True)
class Target:
    """kind: 'linear' (side paths), 'module' (norm/conv: diff and diff_b in place) or 'param'
    (a bare parameter: diff in place). Shapes are the logical (unpacked) ones."""

    kind: str
    weight: tuple
    bias: tuple | None
    what: str


@dataclass(frozen=True, eq=False)
class LoraHandle:
    id: int
    lora: Lora


def lora_targets(model: nn.Module) -> dict:
    """{target path: Target} of every module or parameter a LoRA may patch; works on meta models."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraSide):
            continue
        if isinstance(module, nn.Linear):
            bias = (module.out_features,) if module.bias is not None else None
            out[name] = Target(
                "linear", (module.out_features, module.in_features), bias, type(module).__name__
            )
            continue
        own = {k: p for k, p in module._parameters.items() if p is not None}
        if own and set(own) <= {"weight", "bias"} and "weight" in own:
            bias = tuple(own["bias"].shape) if "bias" in own else None
            out[name] = Target("module", tuple(own["weight"].shape), bias, type(module).__name__)
        else:
            for pname, p in own.items():
                out[f"{name}.{pname}" if name else pname] = Target("param", tuple(p.shape), None, "parameter")
    return out


def _shape(t) -> tuple:
    return tuple(t.shape)


def lora_problems(targets: dict, lora: Lora) -> list:
    """Every way `lora` does not fit `targets`, one line each naming the tensor."""
    problems = []
    for target, p in lora.patches.items():
        t = targets.get(target)
        if t is None:
            problems.append(f"{target}: no such layer or parameter in this model")
            continue
        if (p.down is None) != (p.up is None):
            have, miss = ("down", "up") if p.up is None else ("up", "down")
            problems.append(f"{p.key(target, have)}: low-rank '{have}' without its '{miss}' matrix")
        if p.alpha is not None and p.down is None:
            problems.append(f"{p.key(target, 'alpha')}: alpha without low-rank matrices")
        if p.down is not None and p.up is not None:
            if t.kind != "linear":
                problems.append(
                    f"{p.key(target, 'down')}: low-rank LoRA on {target} ({t.what}) is not supported; "
                    "only 'diff'/'diff_b' full deltas apply there"
                )
            elif p.down.dim() != 2 or p.up.dim() != 2:
                problems.append(
                    f"{p.key(target, 'down')}: expected 2-D low-rank matrices for {target}, got "
                    f"down {list(p.down.shape)} and up {list(p.up.shape)}"
                )
            else:
                out_f, in_f = t.weight
                if p.down.shape[1] != in_f:
                    problems.append(
                        f"{p.key(target, 'down')}: shape {list(p.down.shape)}, but {target} takes "
                        f"{in_f} inputs (expected [rank, {in_f}])"
                    )
                if p.up.shape[0] != out_f:
                    problems.append(
                        f"{p.key(target, 'up')}: shape {list(p.up.shape)}, but {target} has "
                        f"{out_f} outputs (expected [{out_f}, rank])"
                    )
                if p.up.shape[1] != p.down.shape[0]:
                    problems.append(
                        f"{p.key(target, 'up')}: rank {p.up.shape[1]} differs from the rank "
                        f"{p.down.shape[0]} of {p.key(target, 'down')}"
                    )
        if p.diff is not None and _shape(p.diff) != t.weight:
            problems.append(
                f"{p.key(target, 'diff')}: shape {list(p.diff.shape)}, expected {list(t.weight)} for {target}"
            )
        if p.diff_b is not None:
            if t.bias is None:
                problems.append(f"{p.key(target, 'diff_b')}: {target} has no bias")
            elif _shape(p.diff_b) != t.bias:
                problems.append(
                    f"{p.key(target, 'diff_b')}: shape {list(p.diff_b.shape)}, expected {list(t.bias)} "
                    f"for the bias of {target}"
                )
    return problems


def check_lora(targets: dict, lora: Lora) -> None:
    problems = lora_problems(targets, lora)
    if problems:
        more = f"\n  ... and {len(problems) - LIST_LIMIT} more" if len(problems) > LIST_LIMIT else ""
        raise LoraError(
            f"LoRA {lora.name}: does not fit this model (made for another model?):\n  "
            + "\n  ".join(problems[:LIST_LIMIT])
            + more
        )


class LoraSide(nn.Module):
    """The unmerged LoRA paths of one Linear, read by `wan.dit.linear`."""

    def __init__(self):
        super().__init__()
        self.entries = []  # (handle id, down buffer, up buffer or None, scale)
        self.bias_parts = {}  # handle id -> buffer of strength * diff_b (fp32)
        self.register_buffer("bias_sum", None, persistent=False)

    def add_path(self, hid: int, down: torch.Tensor, up: torch.Tensor | None, scale: float) -> None:
        i = len(self.entries)
        self.register_buffer(f"down_{hid}_{i}", down, persistent=False)
        if up is not None:
            self.register_buffer(f"up_{hid}_{i}", up, persistent=False)
        self.entries.append((hid, f"down_{hid}_{i}", None if up is None else f"up_{hid}_{i}", scale))

    def add_bias(self, hid: int, delta: torch.Tensor, dtype: torch.dtype) -> None:
        self.register_buffer(f"bias_{hid}", delta, persistent=False)
        self.bias_parts[hid] = f"bias_{hid}"
        self._sum_bias(dtype)

    def _sum_bias(self, dtype):
        parts = [self._buffers[n].float() for n in self.bias_parts.values()]
        self.bias_sum = torch.stack(parts).sum(0).to(dtype) if parts else None

    def remove(self, hid: int) -> bool:
        """Drop handle `hid`'s paths; True when nothing is left."""
        for entry in [e for e in self.entries if e[0] == hid]:
            self.entries.remove(entry)
            for name in entry[1:3]:
                if name is not None:
                    del self._buffers[name]
        if hid in self.bias_parts:
            dtype = self.bias_sum.dtype
            del self._buffers[self.bias_parts.pop(hid)]
            self._sum_bias(dtype)
        return not self.entries and not self.bias_parts

    def paths(self) -> list:
        b = self._buffers
        return [(b[d], None if u is None else b[u], s) for _, d, u, s in self.entries]

    def bias(self) -> torch.Tensor | None:
        return self.bias_sum


def _handles(model: nn.Module) -> list:
    return model.__dict__.setdefault("_lora_handles", [])


def _originals(model: nn.Module) -> dict:
    return model.__dict__.setdefault("_lora_originals", {})


def attached_loras(model: nn.Module) -> list:
    """Handles of the LoRAs on `model`, in attach order."""
    return list(_handles(model))


def _in_place_params(target: str, t: Target, p: LoraPatch) -> list:
    """[(parameter name, delta)] a patch adds in place (non-Linear targets)."""
    if t.kind == "param":
        return [(target, p.diff)] if p.diff is not None else []
    out = []
    if p.diff is not None:
        out.append((f"{target}.weight", p.diff))
    if p.diff_b is not None:
        out.append((f"{target}.bias", p.diff_b))
    return out


def _refresh_params(model: nn.Module, names: set) -> None:
    """Set each parameter to its original plus every attached LoRA's strength * delta (fp32 sum)."""
    targets = lora_targets(model)
    originals = _originals(model)
    params = dict(model.named_parameters())
    for name in names:
        param = params[name]
        total, any_delta = originals[name].to(param.device, torch.float32), False
        for h in _handles(model):
            for target, p in h.lora.patches.items():
                if h.lora.strength == 0 or targets[target].kind == "linear":
                    continue
                for pname, delta in _in_place_params(target, targets[target], p):
                    if pname == name:
                        total = total + h.lora.strength * delta.to(param.device, torch.float32)
                        any_delta = True
        with torch.no_grad():
            param.copy_(total.to(param.dtype) if any_delta else originals[name].to(param.device))
        if not any_delta:
            del originals[name]


def attach_lora(model: nn.Module, lora: Lora, dtype: torch.dtype | None = None) -> LoraHandle:
    """Apply `lora` at `lora.strength`; returns the handle `detach_lora` takes.

    dtype: dtype of the side-path tensors (default: the model's `compute_dtype`, fp32 for the layers
    wan.dit runs in fp32). Everything is checked before anything changes; strength 0 attaches nothing.
    """
    targets = lora_targets(model)
    check_lora(targets, lora)
    dtype = dtype or getattr(model, "compute_dtype", torch.bfloat16)
    handle = LoraHandle(next(_ids), lora)
    if lora.strength == 0:
        _handles(model).append(handle)
        return handle
    for target in lora.patches:
        if targets[target].kind == "linear" and model.get_submodule(target).weight.is_meta:
            raise LoraError(f"LoRA {lora.name}: {target} has no weights yet (meta); load the model first")
    dense_bytes, touched = 0, set()
    s = lora.strength
    for target, p in lora.patches.items():
        t = targets[target]
        if t.kind != "linear":
            for name, _ in _in_place_params(target, t, p):
                param = model.get_parameter(name)
                _originals(model).setdefault(name, param.detach().to("cpu", copy=True))
                touched.add(name)
            continue
        layer = model.get_submodule(target)
        side = layer._modules.get("lora")
        if side is None:
            side = LoraSide()
            layer.add_module("lora", side)
        device = layer.weight.device
        sd = torch.float32 if target in FP32_LINEARS else dtype
        if p.down is not None:
            side.add_path(handle.id, p.down.to(device, sd), p.up.to(device, sd), s * p.scale)
        if p.diff is not None:
            delta = p.diff.to(device, sd)
            dense_bytes += delta.numel() * delta.element_size()
            side.add_path(handle.id, delta, None, s)
        if p.diff_b is not None:
            side.add_bias(handle.id, s * p.diff_b.to(device, torch.float32), sd)
    _handles(model).append(handle)
    if touched:
        _refresh_params(model, touched)
    if dense_bytes:
        warnings.warn(
            f"LoRA {lora.name}: full-weight 'diff' deltas on Linear layers are kept as dense side "
            f"weights ({dense_bytes / 2**20:.1f} MiB beside the 4-bit weights)",
            stacklevel=2,
        )
    return handle


def detach_lora(model: nn.Module, handle: LoraHandle) -> None:
    """Remove one attached LoRA; in-place parameter deltas are recomputed from the originals."""
    handles = _handles(model)
    if handle not in handles:
        raise ValueError(f"LoRA {handle.lora.name} (handle {handle.id}) is not attached to this model")
    handles.remove(handle)
    for module in list(model.modules()):
        side = module._modules.get("lora")
        if isinstance(side, LoraSide) and side.remove(handle.id):
            del module._modules["lora"]
    targets = lora_targets(model)
    names = {
        n
        for target, p in handle.lora.patches.items()
        if targets[target].kind != "linear"
        for n, _ in _in_place_params(target, targets[target], p)
    }
    _refresh_params(model, names & set(_originals(model)))


def detach_all(model: nn.Module) -> None:
    for handle in reversed(attached_loras(model)):
        detach_lora(model, handle)


def merge_into_weight(name: str, weight: torch.Tensor, loras) -> torch.Tensor:
    """`weight` (the parameter called `name`, e.g. `blocks.0.ffn.0.weight`) with every patch of
    `loras` for it added: strength * (alpha / r * up @ down + diff) on a weight, strength * diff_b
    on a bias, strength * diff on any other parameter. Summed in fp32, returned in `weight`'s
    dtype; `weight` itself when no LoRA touches it. For loaders that quantize a dense tensor:
    merging first costs no side path at run time but needs the dense weight (and a re-load to undo).
    """
    module, _, leaf = name.rpartition(".")
    total = None
    for lora in loras:
        if lora.strength == 0:
            continue
        deltas = []
        p = lora.patches.get(module) if leaf in ("weight", "bias") else None
        if p is not None and leaf == "weight":
            if p.down is not None:
                deltas.append(p.scale * (p.up.float() @ p.down.float()))
            if p.diff is not None:
                deltas.append(p.diff.float())
        elif p is not None and p.diff_b is not None:
            deltas.append(p.diff_b.float())
        q = lora.patches.get(name)
        if q is not None and q.diff is not None:
            deltas.append(q.diff.float())
        for d in deltas:
            if d.shape != weight.shape:
                raise LoraError(
                    f"LoRA {lora.name}: delta for {name} has shape {list(d.shape)}, "
                    f"the weight {list(weight.shape)}"
                )
            d = lora.strength * d.to(weight.device)
            total = d if total is None else total + d
    if total is None:
        return weight
    return (weight.float() + total).to(weight.dtype)
