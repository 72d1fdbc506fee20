"""Experts loader node: validates both DiT experts at node time, loads nothing until sampling."""

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import folder_paths

from ..loaders.checkpoints import expert_pair_config
from ..loaders.experts import ExpertSwitcher
from ..loaders.formats import (
    CONFIG,
    DIFFUSERS_SINGLE,
    NF4_PT,
    NF4_WEIGHTS,
    ExpertSource,
    detect_expert_format,
    find_experts,
)
from ..loaders.lora import EXPERTS as LORA_EXPERTS
from ..loaders.lora import MAX_STRENGTH, LoraSpec
from ..session.fast_run import device_bytes
from ..session.planner import expert_vram
from ..session.request import RequestError, check_lora_merge
from ..wan.config import DiTConfig
from . import memory

CATEGORY = "LingBot-World"
EXPERTS = "LINGBOT_EXPERTS"
MODELS_KIND = "diffusion_models"
FOLDER_WEIGHTS = (NF4_WEIGHTS, NF4_PT, DIFFUSERS_SINGLE)
NO_EXPERTS = "(none found: set ckpt_dir)"
SIDE_PATH, MERGE = "side path", "merge before quantizing"  # LingBot LoRA modes


def _roots(kind: str) -> list[str]:
    return folder_paths.get_folder_paths(kind)


def expert_choices() -> list[str]:
    """Experts under ComfyUI's diffusion_models folders: expert folders (config.json beside
    model.safetensors / model.pt / diffusion_pytorch_model*.safetensors, listed as the folder) and
    single .safetensors files. Uses ComfyUI's cached recursive file list."""
    roots = _roots(MODELS_KIND)
    out = set()
    for rel in folder_paths.get_filename_list(MODELS_KIND):
        name, folder = os.path.basename(rel), os.path.dirname(rel)
        is_weights = name in FOLDER_WEIGHTS or (
            name.startswith("diffusion_pytorch_model-") and name.endswith(".safetensors")
        )
        if is_weights and folder and any(os.path.isfile(os.path.join(r, folder, CONFIG)) for r in roots):
            out.add(folder)
        elif name.endswith(".safetensors") and not name.startswith("diffusion_pytorch_model-"):
            out.add(rel)
    return sorted(out)


def resolve_model(kind: str, name: str) -> Path:
    """A file or folder entry of a ComfyUI model list -> its path (first root holding it)."""
    for root in _roots(kind):
        candidate = os.path.join(root, name)
        if os.path.exists(candidate):
            return Path(candidate)
    raise FileNotFoundError(f"{name!r} not found in the {kind} folders: {', '.join(_roots(kind))}")


def _default(choices: list[str], word: str) -> str:
    return next((c for c in choices if word in c.lower()), choices[0])


@dataclass
class ExpertsHandle:
    """What flows on a LINGBOT_EXPERTS link: validated paths and settings, no weights.

    The switcher (and the experts it parks in RAM under keep_in_ram_gb) lives as long as ComfyUI
    caches this node's output, so repeated runs skip the disk read; ComfyUI's "free model and node
    cache" drops it.
    """

    paths: dict  # {'high': Path, 'low': Path}
    config: DiTConfig  # shared by both experts
    nbytes: dict  # stored bytes per expert, for make_room
    quantize: bool | None
    ram_budget: int
    loras: tuple = ()  # LoraSpecs from LingBot LoRA nodes, in chain order
    lora_merge: tuple = ()  # per entry of `loras`: merged into the weights before quantizing (else a side path)
    allow_unmatched_lora_keys: bool = False
    swap_blocks: int = 0  # DiT blocks streamed from pinned host RAM (wan.block_swap)
    _switcher: ExpertSwitcher | None = field(default=None, repr=False)
    _switcher_key: tuple | None = field(default=None, repr=False)
    _fp8_nbytes: dict | None = field(default=None, repr=False)  # device bytes per expert with fp8 linears

    def switcher(self, device, loras: dict, fp8: bool = False) -> ExpertSwitcher:
        """`loras`: the plan's LoRAs read for these specs (the same on every run of this handle). The
        switcher (and what it parked) is kept while the device, the LoRAs with their modes and `fp8` (LingBot
        Speed's fp8_linears: the experts loaded with fp8 linears) stay the same: merged LoRAs and fp8 live in
        the loaded weights, so changing them means loading the experts again."""
        key = (self.loras, self.lora_merge, fp8)
        if self._switcher is None or self._switcher.device != device or self._switcher_key != key:
            self.close()
            side, merged = (loras, False) if not any(self.lora_merge) else self._split_loras(loras)
            self._switcher = ExpertSwitcher(
                self.paths,
                device,
                quantize="fp8" if fp8 else self.quantize,
                ram_budget=self.ram_budget,
                loras=side,
                swap_blocks=self.swap_blocks,
                merge_loras=merged,
            )
            self._switcher_key = key
            self._fp8_nbytes = None if not fp8 else {name: self._fp8_bytes(name) for name in self.paths}
        return self._switcher

    def _fp8_bytes(self, name: str) -> int:
        """Device bytes of expert `name` loaded with fp8 linears (its headers read again where only a path is
        held)."""
        source = self.paths[name]
        if not isinstance(source, ExpertSource):
            source = detect_expert_format(source, require_config=False)
        return device_bytes(source, "fp8")

    def _split_loras(self, loras: dict) -> tuple[dict, dict]:
        """The plan's {'high'|'low': [Lora]} (one per spec that applies, in chain order) -> (side path, merged)."""
        side, merged = {}, {}
        for e in ("high", "low"):
            modes = [m for spec, m in zip(self.loras, self.lora_merge, strict=True) if spec.applies_to(e)]
            got = loras.get(e, [])
            if len(got) != len(modes):
                raise ValueError(f"loras: {len(got)} read for the {e}-noise expert, {len(modes)} expected")
            side[e] = [lora for lora, m in zip(got, modes, strict=True) if not m]
            merged[e] = [lora for lora, m in zip(got, modes, strict=True) if m]
        return side, merged

    def with_lora(self, spec: LoraSpec, allow_unmatched: bool, merge: bool = False) -> "ExpertsHandle":
        """A new handle (own switcher, own parked experts) with one more LoRA; `merge`: added into the
        weights before quantizing instead of as a side path."""
        return replace(
            self,
            loras=(*self.loras, spec),
            lora_merge=(*self.lora_merge, bool(merge)),
            _switcher=None,
            _switcher_key=None,
            allow_unmatched_lora_keys=self.allow_unmatched_lora_keys or allow_unmatched,
        )

    def provider(self, device, working_bytes: int, loras: dict, fp8: bool = False):
        """`experts(name)` for wan.pipeline: drop the resident expert, ask ComfyUI for room, load (`fp8`:
        with fp8 linears)."""
        switcher = self.switcher(device, loras, fp8)

        def experts(name: str):
            if switcher.resident != name:
                switcher.release()
                memory.after_release()
                memory.make_room(self.resident_bytes(name) + working_bytes, switcher.device)
            return switcher(name)

        return experts

    def resident_bytes(self, name: str) -> int:
        """Device bytes of expert `name` while resident: with swap, the unswapped blocks plus two in flight."""
        nbytes = self.nbytes if self._fp8_nbytes is None else self._fp8_nbytes
        return expert_vram(nbytes[name], self.config.num_layers, self.swap_blocks)

    def release(self) -> None:
        """After sampling: park the expert in RAM if keep_in_ram_gb allows, else drop it."""
        if self._switcher is not None:
            self._switcher.release()
            if not self.ram_budget:
                self._switcher.close()
        memory.after_release()

    def close(self) -> None:
        if self._switcher is not None:
            self._switcher.close()
            self._switcher = None


class LingBotExpertsLoader:
    DESCRIPTION = (
        "Picks the high-noise and low-noise LingBot-World experts (NF4 repack folders, diffusers "
        "folders or single .safetensors). Checks them from their headers now; the sampler streams "
        "one expert at a time onto the GPU."
    )
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (EXPERTS,)
    RETURN_NAMES = ("experts",)
    OUTPUT_TOOLTIPS = ("Expert paths and load settings; nothing is loaded until the sampler runs.",)

    @classmethod
    def INPUT_TYPES(cls):
        choices = expert_choices() or [NO_EXPERTS]
        return {
            "required": {
                "high_noise_expert": (
                    choices,
                    {
                        "default": _default(choices, "high"),
                        "tooltip": "High-noise expert from models/diffusion_models: a folder such as "
                        "lingbot-world-base-cam-nf4/high_noise_model_bnb_nf4, or one .safetensors file. The NF4 "
                        "folders come from huggingface.co/cahlen/lingbot-world-base-cam-nf4 (download the "
                        "high_noise_model_bnb_nf4/ and low_noise_model_bnb_nf4/ folders whole into "
                        "models/diffusion_models/lingbot-world-base-cam-nf4/).",
                    },
                ),
                "low_noise_expert": (
                    choices,
                    {
                        "default": _default(choices, "low"),
                        "tooltip": "Low-noise expert, same forms as the high-noise one.",
                    },
                ),
                "quantize_to_nf4": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Quantize bf16/fp32 experts to NF4 while streaming them in (~3.9x less "
                        "memory). NF4 checkpoints are used as stored either way.",
                    },
                ),
                "keep_in_ram_gb": (
                    "FLOAT",
                    {
                        "default": 0.0,
                        "min": 0.0,
                        "max": 1024.0,
                        "step": 1.0,
                        "tooltip": "Host RAM allowed for parking experts between phases and runs "
                        "(an NF4 expert needs ~10 GB). 0 = drop each expert and stream it from disk again.",
                    },
                ),
            },
            "optional": {
                "ckpt_dir": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Optional checkpoint folder holding high_noise_model(_bnb_nf4)/ and "
                        "low_noise_model(_bnb_nf4)/; when set it replaces the two lists above.",
                    },
                ),
                "swap_blocks": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 40,
                        "step": 1,
                        "tooltip": "DiT blocks of the running expert kept in pinned host RAM and streamed to the "
                        "GPU one block ahead of their turn: less VRAM (each of the 40 blocks of an NF4 expert is "
                        "~0.24 GB), identical results, a little slower. 0 = the whole expert on the GPU.",
                    },
                ),
            },
        }

    def load(
        self, high_noise_expert, low_noise_expert, quantize_to_nf4, keep_in_ram_gb, ckpt_dir="", swap_blocks=0
    ):
        if ckpt_dir.strip():
            paths = find_experts(Path(ckpt_dir.strip()).expanduser())
        else:
            if NO_EXPERTS in (high_noise_expert, low_noise_expert):
                raise FileNotFoundError(
                    "no experts found in the diffusion_models folders "
                    f"({', '.join(_roots(MODELS_KIND))}); put the NF4 expert folders there or set ckpt_dir"
                )
            paths = {
                "high": resolve_model(MODELS_KIND, high_noise_expert),
                "low": resolve_model(MODELS_KIND, low_noise_expert),
            }
        config, sources = expert_pair_config(paths)
        if isinstance(swap_blocks, bool) or not isinstance(swap_blocks, int) or not 0 <= swap_blocks:
            raise ValueError(f"swap_blocks: expected an integer >= 0, got {swap_blocks!r}")
        if swap_blocks > config.num_layers:
            raise ValueError(f"swap_blocks: these experts have {config.num_layers} blocks, got {swap_blocks}")
        handle = ExpertsHandle(
            paths=paths,
            config=config,
            nbytes={k: s.nbytes for k, s in sources.items()},
            quantize=True if quantize_to_nf4 else None,
            ram_budget=int(keep_in_ram_gb * memory.GIB),
            swap_blocks=swap_blocks,
        )
        return (handle,)


class LingBotLoRA:
    DESCRIPTION = (
        "Adds a LoRA (.safetensors from models/loras: ComfyUI/kohya, peft/diffusers or step-distill diff "
        "layouts) to the experts as a low-rank path beside the NF4 weights: nothing is re-quantized. Chain "
        "several to stack them. With original bf16/fp32 experts quantized while loading, it can instead be "
        "merged into the weights before they are quantized."
    )
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    RETURN_TYPES = (EXPERTS,)
    RETURN_NAMES = ("experts",)
    OUTPUT_TOOLTIPS = ("The experts with this LoRA added; it is read and checked when sampling starts.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "experts": (EXPERTS, {"tooltip": "From LingBot Experts Loader or another LingBot LoRA."}),
                "lora_name": (
                    folder_paths.get_filename_list("loras"),
                    {
                        "tooltip": "A Wan2.2 14B (or Wan2.1 14B) LoRA .safetensors from models/loras.",
                    },
                ),
                "strength": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": -MAX_STRENGTH,
                        "max": MAX_STRENGTH,
                        "step": 0.01,
                        "tooltip": "Multiplier of the LoRA's delta (0 = off).",
                    },
                ),
                "apply_to": (
                    list(LORA_EXPERTS),
                    {
                        "default": "both",
                        "tooltip": "Which expert gets it: both, high (high-noise, first steps) or low (low-noise).",
                    },
                ),
                "allow_unmatched_keys": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Warn about keys that match no layer instead of failing (e.g. Wan2.1 image-attention keys).",
                    },
                ),
            },
            "optional": {
                "mode": (
                    [SIDE_PATH, MERGE],
                    {
                        "default": SIDE_PATH,
                        "tooltip": "side path: a low-rank path beside the weights, for any experts. merge before "
                        "quantizing: added into the weights as they stream in, before they are quantized (no "
                        "side path at run time); only for original bf16/fp32 experts with quantize_to_nf4 on "
                        "in the LingBot Experts Loader.",
                    },
                ),
            },
        }

    def apply(self, experts, lora_name, strength, apply_to, allow_unmatched_keys, mode=SIDE_PATH):
        spec = LoraSpec(resolve_model("loras", lora_name), strength, apply_to)
        if not spec.path.suffix.lower() == ".safetensors":
            raise ValueError(f"lora_name: {lora_name!r} is not a .safetensors file")
        if mode not in (SIDE_PATH, MERGE):
            raise ValueError(f"mode: expected {SIDE_PATH!r} or {MERGE!r}, got {mode!r}")
        if mode == MERGE:
            _, sources = expert_pair_config(experts.paths)
            try:
                check_lora_merge(
                    sources, experts.quantize, (spec,), "quantize_to_nf4 on the LingBot Experts Loader"
                )
            except RequestError as e:
                raise ValueError(f"mode {MERGE!r}: {e.detail}") from None
        return (experts.with_lora(spec, allow_unmatched_keys, merge=mode == MERGE),)
