"""Read Wan LoRA `.safetensors` files in the layouts trainers and ComfyUI users have, as `wan.lora.Lora`.

Key layouts understood (any of the prefixes `diffusion_model.`, `model.diffusion_model.`,
`transformer.`, `base_model.model.`):
- ComfyUI / original Wan names: `diffusion_model.blocks.0.self_attn.q.lora_down.weight`, `...lora_up.weight`,
  `...alpha`, and `.lora_A.weight` / `.lora_B.weight` on the same names;
- kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight` (also `lora_unet__`,
  `lycoris_`, `lora_transformer_`);
- peft / diffusers: `transformer.blocks.0.attn1.to_q.lora_A.weight`, `...lora_B.weight`,
  `...lora_B.bias` (a bias delta), with diffusers' module names (attn1/attn2, to_out.0,
  ffn.net.0.proj, condition_embedder.*, proj_out, scale_shift_table, ...);
- full deltas of step-distill LoRAs: `<name>.diff` (weight or bare parameter) and `<name>.diff_b` (bias).

Keys are matched against the model's own layers (so camera layers, block count and plain-vs-camera
checkpoints are all handled by the model given); every key that matches nothing is listed in one
error, or a warning with `allow_unmatched=True`. Shapes are checked against the model, naming the tensor.
"""

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..wan.lora import Lora, LoraError, LoraPatch, attach_lora, check_lora, lora_targets
from .tensor_file import TensorFile

EXPERTS = ("both", "high", "low")
MAX_STRENGTH = 10.0  # |strength| beyond this only overflows the activations; the node's widget range
LIST_LIMIT = 12

# (key suffix, part), tried in order
SUFFIXES = (
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.default.weight", "down"),
    (".lora_B.default.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora.down.weight", "down"),
    (".lora.up.weight", "up"),
    (".lora_B.bias", "diff_b"),
    (".alpha", "alpha"),
    (".diff_b", "diff_b"),
    (".diff", "diff"),
)
DOT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.")
UNDERSCORE_PREFIXES = ("lora_unet__", "lora_unet_", "lycoris_", "lora_transformer_")
# Wan2.1 i2v image attention and image embedder (absent from Wan2.2 A14B)
IMAGE_ATTN = re.compile(r"k_img|v_img|img_emb|add_k_proj|add_v_proj|image_embedder|norm_added_k")

# our name -> diffusers' (WanTransformer3DModel) name
_DIFFUSERS = (
    (r"blocks\.(\d+)\.self_attn\.([qkv])", r"blocks.\1.attn1.to_\2"),
    (r"blocks\.(\d+)\.self_attn\.o", r"blocks.\1.attn1.to_out.0"),
    (r"blocks\.(\d+)\.self_attn\.norm_([qk])", r"blocks.\1.attn1.norm_\2"),
    (r"blocks\.(\d+)\.cross_attn\.([qkv])", r"blocks.\1.attn2.to_\2"),
    (r"blocks\.(\d+)\.cross_attn\.o", r"blocks.\1.attn2.to_out.0"),
    (r"blocks\.(\d+)\.cross_attn\.norm_([qk])", r"blocks.\1.attn2.norm_\2"),
    (r"blocks\.(\d+)\.ffn\.0", r"blocks.\1.ffn.net.0.proj"),
    (r"blocks\.(\d+)\.ffn\.2", r"blocks.\1.ffn.net.2"),
    (r"blocks\.(\d+)\.norm3", r"blocks.\1.norm2"),
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.scale_shift_table"),
    (r"text_embedding\.0", "condition_embedder.text_embedder.linear_1"),
    (r"text_embedding\.2", "condition_embedder.text_embedder.linear_2"),
    (r"time_embedding\.0", "condition_embedder.time_embedder.linear_1"),
    (r"time_embedding\.2", "condition_embedder.time_embedder.linear_2"),
    (r"time_projection\.1", "condition_embedder.time_proj"),
    (r"head\.head", "proj_out"),
    (r"head\.modulation", "scale_shift_table"),
)
_DIFFUSERS = tuple((re.compile(a + "$"), b) for a, b in _DIFFUSERS)


def diffusers_name(target: str) -> str | None:
    for pattern, repl in _DIFFUSERS:
        if pattern.match(target):
            return pattern.sub(repl, target)
    return None


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA file, its strength and the experts (`'high'`, `'low'` or `'both'`) it applies to."""

    path: Path
    strength: float = 1.0
    experts: str = "both"

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))
        if self.experts not in EXPERTS:
            raise ValueError(f"LoRA {self.path}: experts must be one of {EXPERTS}, got {self.experts!r}")
        if not isinstance(self.strength, (int, float)) or not -MAX_STRENGTH <= self.strength <= MAX_STRENGTH:
            raise ValueError(
                f"LoRA {self.path}: strength must be a number in [{-MAX_STRENGTH:g}, {MAX_STRENGTH:g}], "
                f"got {self.strength!r}"
            )
        object.__setattr__(self, "strength", float(self.strength))

    def applies_to(self, expert: str) -> bool:
        if expert not in ("high", "low"):
            raise ValueError(f"expert must be 'high' or 'low', got {expert!r}")
        return self.experts in ("both", expert)


def parse_lora_spec(text: str) -> LoraSpec:
    """`FILE[:STRENGTH[:high|low|both]]`, e.g. `style.safetensors:0.8:low`. FILE may itself contain
    ':' (e.g. a Windows drive); it must end in `.safetensors`."""
    m = re.match(r"^(.+?\.safetensors)(?::([^:]*))?(?::([^:]*))?$", text, re.IGNORECASE)
    if not m:
        raise ValueError(
            f"LoRA {text!r}: expected FILE[:STRENGTH[:high|low|both]] with FILE a .safetensors file "
            "(e.g. style.safetensors:0.8:low)"
        )
    path, strength, experts = m.groups()
    value = 1.0
    if strength is not None:
        try:
            value = float(strength)
        except ValueError:
            raise ValueError(f"LoRA {text!r}: strength {strength!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"LoRA {text!r}: strength must be finite, got {strength!r}")
    if experts is not None and experts.lower() not in EXPERTS:
        raise ValueError(f"LoRA {text!r}: experts must be high, low or both, got {experts!r}")
    return LoraSpec(Path(path), value, (experts or "both").lower())


def _aliases(targets: dict) -> tuple[dict, dict]:
    """({dotted alias: target}, {underscored alias: target}) from our and diffusers' names."""
    dotted, underscored = {}, {}
    for target in targets:
        for name in (target, diffusers_name(target)):
            if name is None:
                continue
            for table, alias in ((dotted, name), (underscored, name.replace(".", "_"))):
                if table.setdefault(alias, target) != target:
                    raise AssertionError(f"LoRA key alias {alias!r} is ambiguous")
    return dotted, underscored


def _strip(name: str, prefixes) -> str:
    changed = True
    while changed:
        changed = False
        for p in prefixes:
            if name.startswith(p):
                name, changed = name[len(p) :], True
    return name


def _resolve(base: str, part: str, dotted: dict, underscored: dict, targets: dict):
    """(target, part) for a key's base name, or None."""
    name = _strip(base, DOT_PREFIXES)
    if name in dotted:
        return dotted[name], part
    for leaf, new_part in ((".weight", part), (".bias", "diff_b")):  # `X.weight.diff`, `X.bias.diff`
        if part == "diff" and name.endswith(leaf) and dotted.get(name[: -len(leaf)]) is not None:
            target = dotted[name[: -len(leaf)]]
            if targets[target].kind != "param":
                return target, new_part
    for p in UNDERSCORE_PREFIXES:
        if base.startswith(p) and base[len(p) :] in underscored:
            return underscored[base[len(p) :]], part
    if base in underscored:
        return underscored[base], part
    return None


def match_keys(keys, targets: dict) -> tuple[dict, list]:
    """({target: {part: key}}, [unmatched keys]) for a LoRA file's keys and a model's targets."""
    dotted, underscored = _aliases(targets)
    groups, unmatched = {}, []
    for key in keys:
        hit = None
        for suffix, part in SUFFIXES:
            if key.endswith(suffix):
                hit = _resolve(key[: -len(suffix)], part, dotted, underscored, targets)
                break
        if hit is None:
            unmatched.append(key)
            continue
        target, part = hit
        other = groups.setdefault(target, {}).setdefault(part, key)
        if other != key:
            raise LoraError(f"LoRA keys {other!r} and {key!r} both give the {part} of {target}")
    return groups, unmatched


def _unmatched_message(path, unmatched: list) -> str:
    shown = sorted(unmatched)[:LIST_LIMIT]
    more = f"\n  ... and {len(unmatched) - LIST_LIMIT} more" if len(unmatched) > LIST_LIMIT else ""
    msg = (
        f"LoRA {path}: {len(unmatched)} key(s) match no layer of this model:\n  " + "\n  ".join(shown) + more
    )
    if any(IMAGE_ATTN.search(k) for k in unmatched):
        msg += "\n(k_img/v_img/img_emb keys belong to Wan2.1 i2v's image attention, which Wan2.2 A14B lacks)"
    msg += (
        "\nExpected <layer>.lora_down/lora_up.weight, .lora_A/lora_B.weight, .alpha, .diff or .diff_b "
        "on this model's layers (e.g. diffusion_model.blocks.0.self_attn.q); "
        "pass allow_unmatched to skip such keys with a warning"
    )
    return msg


def read_lora(source, model: nn.Module, strength: float | None = None, allow_unmatched: bool = False) -> Lora:
    """Read a LoRA `.safetensors` for `model` (a loaded or meta `WanModel`: only its structure is used).

    source: a path or a `LoraSpec` (whose strength is used unless `strength` is given).
    Raises LoraError listing every unmatched key (a warning instead with `allow_unmatched`) and
    every tensor whose shape does not fit the model.
    """
    spec = source if isinstance(source, LoraSpec) else LoraSpec(Path(source))
    if strength is not None:
        spec = LoraSpec(spec.path, strength, spec.experts)
    if spec.path.suffix.lower() != ".safetensors":
        raise ValueError(f"LoRA {spec.path}: only .safetensors LoRA files are supported")
    file = TensorFile(spec.path, "LoRA", ".safetensors")
    targets = lora_targets(model)
    groups, unmatched = match_keys(file.keys, targets)
    if unmatched:
        if not allow_unmatched:
            raise LoraError(_unmatched_message(spec.path, unmatched))
        warnings.warn(
            _unmatched_message(spec.path, unmatched).rsplit("\n", 1)[0] + "\n(skipped)", stacklevel=2
        )
    if not groups:
        raise LoraError(f"LoRA {spec.path}: no key matches a layer of this model")
    patches = {}
    for target, parts in groups.items():
        tensors = {}
        for part, key in parts.items():
            t = file.get(key)
            if not t.dtype.is_floating_point:
                raise LoraError(
                    f"LoRA {spec.path}: tensor {key!r} has dtype {t.dtype}, expected a float type"
                )
            if not torch.isfinite(t).all():
                raise LoraError(f"LoRA {spec.path}: tensor {key!r} holds NaN or Inf values")
            if part == "alpha":
                if t.numel() != 1:
                    raise LoraError(
                        f"LoRA {spec.path}: tensor {key!r} (alpha) has shape {list(t.shape)}, "
                        "expected a single value"
                    )
                t = float(t.float().item())
            tensors[part] = t
        patches[target] = LoraPatch(**tensors, keys=dict(parts))
    lora = Lora(patches, spec.strength, name=str(spec.path))
    check_lora(targets, lora)
    return lora


def read_loras(specs, model: nn.Module, expert: str, allow_unmatched: bool = False) -> list:
    """The `Lora`s of the specs that apply to `expert` ('high' or 'low'), read and checked against
    `model` (a meta model will do, e.g. for `wan.lora.merge_into_weight` while streaming)."""
    return [read_lora(s, model, allow_unmatched=allow_unmatched) for s in specs if s.applies_to(expert)]


def load_loras(model: nn.Module, specs, expert: str, allow_unmatched: bool = False) -> list:
    """Read and attach every spec that applies to `expert`; returns the handles (for
    `wan.lora.detach_lora`). All files are read and checked before any is attached."""
    return [attach_lora(model, lora) for lora in read_loras(specs, model, expert, allow_unmatched)]
