"""A whole LingBot-World checkpoint folder -> the files each phase needs, every gap listed at once.

Accepts upstream's layout (`high_noise_model/`, `low_noise_model/`, `models_t5_umt5-xxl-enc-bf16.pth`,
`google/umt5-xxl/`, `Wan2.1_VAE.pth`) and the NF4 repack's (`*_noise_model_bnb_nf4/`, `tokenizer/`),
and ComfyUI's file names for the text encoder and VAE placed in the same folder.
"""

from dataclasses import dataclass
from pathlib import Path

from ..wan.config import DiTConfig
from .formats import detect_expert_format, find_experts
from .tensor_file import check_dir, exists, path_problem
from .text_encoder import resolve_tokenizer

TEXT_ENCODER_NAMES = (
    "models_t5_umt5-xxl-enc-bf16.pth",
    "umt5_xxl_fp16.safetensors",
    "umt5_xxl_bf16.safetensors",
)
VAE_NAMES = ("Wan2.1_VAE.pth", "wan_2.1_vae.safetensors")


@dataclass(frozen=True)
class CheckpointFiles:
    experts: dict  # {'high': Path, 'low': Path}
    text_encoder: Path
    tokenizer: Path | None  # None: the encoder file carries its own tokenizer
    vae: Path
    config: DiTConfig  # the experts' shared config, read from their headers
    sources: dict  # {'high'|'low': formats.ExpertSource}: layout, stored bytes, quantization

    @property
    def control_type(self) -> str | None:
        """'cam', 'act' or None (plain Wan2.2 i2v)."""
        return self.config.control_type


def _first(roots, names) -> Path | None:
    """The first of `names` present in the first of `roots` holding one, readable or not (its loader
    names what is wrong)."""
    return next((root / n for root in roots for n in names if exists(root / n)), None)


def _unusable(path: Path, role: str) -> list[str]:
    problem = path_problem(path)
    return [] if problem is None else [f"{path} ({role}): {problem}"]


def find_assets(roots, missing: list) -> tuple[Path | None, Path | None, Path | None]:
    """(text encoder, tokenizer or None when the encoder carries its own, VAE), each looked up in
    `roots` in order; what is absent or unusable is appended to `missing`, named under roots[0]."""
    roots = [Path(r) for r in roots]
    text_encoder = _first(roots, TEXT_ENCODER_NAMES)
    tokenizer = None
    if text_encoder is None:
        missing.append(f"{roots[0] / TEXT_ENCODER_NAMES[0]} (text encoder)")
    elif _unusable(text_encoder, "text encoder"):
        missing += _unusable(text_encoder, "text encoder")
    else:
        try:
            source = resolve_tokenizer(encoder_path=text_encoder)
            tokenizer = None if source.kind == "embedded" else source.path
        except (FileNotFoundError, ValueError):
            where = text_encoder.parent
            missing.append(
                f"{where / 'tokenizer'}/tokenizer.json or {where / 'google' / 'umt5-xxl'}/ (tokenizer)"
            )
    vae = _first(roots, VAE_NAMES)
    if vae is None:
        missing.append(f"{roots[0] / VAE_NAMES[0]} (VAE)")
    else:
        missing += _unusable(vae, "VAE")
    return text_encoder, tokenizer, vae


def resolve_checkpoint_dir(ckpt_dir) -> CheckpointFiles:
    root = check_dir(ckpt_dir, "checkpoint directory")
    missing = []
    try:
        experts = find_experts(root)
    except FileNotFoundError as err:
        experts = None
        missing.append(str(err).split("missing: ", 1)[-1])
    text_encoder, tokenizer, vae = find_assets([root], missing)
    if missing:
        raise FileNotFoundError(
            f"{root}: incomplete checkpoint, missing or unusable:\n  - " + "\n  - ".join(missing)
        )
    config, sources = expert_pair_config(experts)
    return CheckpointFiles(experts, text_encoder, tokenizer, vae, config, sources)


def expert_pair_config(paths: dict) -> tuple[DiTConfig, dict]:
    """(shared DiTConfig, {'high'|'low': ExpertSource}) from the two experts' headers; they must agree."""
    sources = {k: detect_expert_format(paths[k]) for k in ("high", "low")}
    high, low = sources["high"].dit_config, sources["low"].dit_config
    if high != low:
        diff = {f: (getattr(high, f), getattr(low, f)) for f in high.__dataclass_fields__}
        raise ValueError(
            f"the experts do not match ({paths['high']} vs {paths['low']}): "
            + ", ".join(f"{f} high={a!r} low={b!r}" for f, (a, b) in diff.items() if a != b)
        )
    return high, sources
