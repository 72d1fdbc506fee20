"""The chunk-causal checkpoints (LingBot-World-Fast, LingBot-World 2.0 14B and 1.3B causal-fast) -> the
files their phases need and the model kind, every gap listed at once.

- **v1 Fast** is one causal DiT with a base-cam expert's tensor names and shapes, shipped as diffusers
  shards (``diffusion_pytorch_model.safetensors.index.json``, stored fp32, no ``config.json``) and
  installed as ``lingbot_world_fast/`` inside the base-cam folder, whose umT5 text encoder, tokenizer
  and ``Wan2.1_VAE.pth`` it reuses.
- **v2 14B causal-fast** (robbyant/lingbot-world-v2-14b-causal-fast) holds the text encoder, tokenizer
  and VAE at its root and the DiT in ``transformers/``: ``model-0000{1..8}-of-00008.safetensors``, their
  ``diffusion_pytorch_model.safetensors.index.json`` and a ``config.json`` of class ``WanModelFast``.
- **v2 1.3B causal-fast** (robbyant/lingbot-world-v2-1.3b-causal-fast) is the DiT alone, flat:
  ``model-0000{1..6}-of-00006.safetensors`` (fp32) + ``model.safetensors.index.json``, no ``config.json``;
  its text encoder, tokenizer and VAE are the 14B's (``assets_dir``).

Accepted paths: a folder holding the DiT folder (``lingbot_world_fast(_nf4)/``, ``transformers(_nf4)/``;
a complete NF4 folder is taken first) with the assets beside it, or a DiT folder itself (upstream's, or
an NF4 one ``lingbot.py quantize`` wrote), assets in its parent folder, else in the folder itself.
``assets_dir``, when given, is searched first.

Without ``config.json`` the architecture comes from the tensor shapes (the camera embedding's width
tells cam from act), num_heads as dim / 128 and the rest as the A14B config's; the whole layout is
then checked against the headers (`formats.detect_expert_format`). The kind (`detect_kind`) comes
from what the files say: the kind an NF4 folder's ``quantization_meta.json`` records, the 1.3B's index
name, the 14B's ``WanModelFast`` config (or its ``transformers/`` folder), a ``-diffusers`` repack's
``num_frames_per_block``, and last the architecture (dim 1536 with 30 blocks is the 1.3B).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from ..wan.config import A14B, CHUNKED_KINDS, V2_1_3B, ChunkedKind, DiTConfig
from .checkpoints import TEXT_ENCODER_NAMES, VAE_NAMES, find_assets
from .formats import (
    CONFIG,
    DIFFUSERS_INDEX,
    DIFFUSERS_SINGLE,
    EXPERT_DIRS,
    MODEL_INDEX,
    NF4_META,
    NF4_WEIGHTS,
    CheckpointError,
    ExpertSource,
    detect_expert_format,
    folder_missing,
    shard_index,
)
from .tensor_file import check_dir, exists

FAST_DIR = "lingbot_world_fast"
FAST_NF4_DIR = "lingbot_world_fast_nf4"
V2_DIR = "transformers"  # the v2 14B's DiT subfolder (upstream's fast_checkpoint)
V2_NF4_DIR = "transformers_nf4"
DIFFUSERS_DIR = "transformer"  # a -diffusers repack's DiT subfolder
FAST_DIRS = (FAST_NF4_DIR, FAST_DIR, V2_NF4_DIR, V2_DIR, DIFFUSERS_DIR)  # preferred first
MODEL_CHOICES = ("auto", *CHUNKED_KINDS)
KIND_KEY = "lingbot_kind"  # the kind, as `lingbot.py quantize` records it in quantization_meta.json


@dataclass(frozen=True)
class KindInfo:
    title: str
    repo: str  # on Hugging Face
    dit: str  # where the DiT is, for messages


KINDS = {
    "fast": KindInfo(
        "LingBot-World-Fast", "robbyant/lingbot-world-fast", f"{FAST_DIR}/ in the base-cam folder"
    ),
    "v2-14b": KindInfo(
        "LingBot-World 2.0 14B causal-fast", "robbyant/lingbot-world-v2-14b-causal-fast", f"{V2_DIR}/"
    ),
    "v2-1.3b": KindInfo(
        "LingBot-World 2.0 1.3B causal-fast",
        "robbyant/lingbot-world-v2-1.3b-causal-fast",
        f"the folder itself (model-0000i-of-00006.safetensors + {MODEL_INDEX})",
    ),
}


@dataclass(frozen=True)
class FastFiles:
    model: Path  # the Fast DiT's folder (an ExpertSource path)
    text_encoder: Path
    tokenizer: Path | None  # None: the encoder file carries its own tokenizer
    vae: Path
    config: DiTConfig  # from the model's headers (and config.json where there is one)
    source: ExpertSource  # layout, stored dtype and bytes, quantization
    kind: ChunkedKind = CHUNKED_KINDS["fast"]  # chunk, steps, shift and documented window

    @property
    def control_type(self) -> str | None:
        """'cam', 'act' or None (no camera layers)."""
        return self.config.control_type

    @property
    def quantized(self) -> bool:
        return self.source.quantized


def is_model_folder(folder: Path) -> bool:
    """Whether `folder` holds expert weights in any layout (complete or not)."""
    return folder_missing(folder, need_config=False) is not None


def fast_model_dir(path, names=FAST_DIRS) -> Path:
    """The DiT folder for a folder holding one (the first complete of `names`, else the first present),
    or `path` itself when it holds weights or none of them is there."""
    root = Path(path)
    if root.is_dir() and not is_model_folder(root):
        present = [root / n for n in names if (root / n).is_dir() and is_model_folder(root / n)]
        complete = [d for d in present if folder_missing(d, need_config=False) == []]
        if complete or present:
            return (complete or present)[0]
    return root


def _config(folder: Path) -> dict:
    try:
        data = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}  # absent or unreadable: detect_expert_format names what is wrong with it
    return data if isinstance(data, dict) else {}


def layout_kind(folder: Path) -> str | None:
    """The kind the files of a DiT folder name without reading a tensor header, or None: an NF4 folder's
    recorded kind, the 1.3B's flat index, the 14B's WanModelFast config or folder name, a -diffusers
    repack's chunk length."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / NF4_META).read_text(encoding="utf-8"))
        if meta.get(KIND_KEY) in CHUNKED_KINDS:
            return meta[KIND_KEY]
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        pass
    index = shard_index(folder)
    if index is not None and index.name == MODEL_INDEX and not exists(folder / CONFIG):
        return "v2-1.3b"
    config = _config(folder)
    per_block = config.get("num_frames_per_block")
    if per_block in (3, 4):  # a -diffusers repack (CausalLingBotWorldTransformer3DModel)
        return "fast" if per_block == 3 else None  # v2: 14B or 1.3B, the architecture tells
    if config.get("_class_name") == "WanModelFast" or folder.name in (V2_DIR, V2_NF4_DIR):
        return "v2-14b"
    return None


def _size_name(cfg: DiTConfig) -> str | None:
    """The released size this architecture is, if it is one ('14B': v1 Fast and v2 14B; '1.3B')."""
    return {(A14B.dim, A14B.num_layers): "14B", (V2_1_3B.dim, V2_1_3B.num_layers): "1.3B"}.get(
        (cfg.dim, cfg.num_layers)
    )


def _folder(source: ExpertSource) -> Path:
    return source.path if source.path.is_dir() else source.path.parent


def known_kind(source: ExpertSource) -> str | None:
    """The kind a validated DiT's files or architecture name, or None (v1 Fast's files name none)."""
    folder = _folder(source)
    if layout_kind(folder):
        return layout_kind(folder)
    if _size_name(source.dit_config) == "1.3B":
        return "v2-1.3b"
    return "v2-14b" if "num_frames_per_block" in _config(folder) else None


def detect_kind(source: ExpertSource, model: str = "auto") -> ChunkedKind:
    """The chunk-causal kind of a validated DiT: `model` ('auto' or a CHUNKED_KINDS name) checked against
    what the files say. A named kind whose released architecture differs from the checkpoint's released
    one (a 14B named v2-1.3b, or the reverse) is refused; tiny test models pass."""
    if model not in MODEL_CHOICES:
        raise ValueError(f"model: expected one of {', '.join(MODEL_CHOICES)}, got {model!r}")
    if model == "auto":
        return CHUNKED_KINDS[known_kind(source) or "fast"]
    folder, cfg = _folder(source), source.dit_config
    size, kind = _size_name(cfg), CHUNKED_KINDS[model]
    if size is not None and size != _size_name(kind.dit):
        raise CheckpointError(
            f"{folder}: holds a {size} DiT (dim {cfg.dim}, {cfg.num_layers} blocks), not {KINDS[model].title} "
            f"(dim {kind.dit.dim}, {kind.dit.num_layers} blocks); name the model that matches, or 'auto'"
        )
    return kind


def _missing_error(root: Path, title: str, missing: list) -> FileNotFoundError:
    if len(missing) == 1:
        return FileNotFoundError(f"{root}: incomplete {title} checkpoint, missing or unusable: {missing[0]}")
    return FileNotFoundError(
        f"{root}: incomplete {title} checkpoint, missing or unusable:\n  - " + "\n  - ".join(missing)
    )


def resolve_fast_dir(path, model: str = "auto", assets_dir=None) -> FastFiles:
    """FastFiles for a chunk-causal checkpoint (see the module docstring for what is accepted).

    model: 'auto' (detected) or a CHUNKED_KINDS name; assets_dir: a folder searched first for the text
    encoder, tokenizer and VAE (the v2 1.3B ships none). Raises FileNotFoundError listing every missing
    or unusable file, or CheckpointError (a ValueError) naming the file and tensors that do not make a
    Wan DiT of that kind.
    """
    if model not in MODEL_CHOICES:
        raise ValueError(f"model: expected one of {', '.join(MODEL_CHOICES)}, got {model!r}")
    root = check_dir(path, "Fast model folder")
    assets = None if assets_dir is None else check_dir(assets_dir, "assets folder (assets_dir)")
    if root.name in {n for names in EXPERT_DIRS.values() for n in names}:
        raise CheckpointError(
            f"{root}: is one expert of the two-expert base model, not LingBot-World-Fast (give the "
            f"base-cam folder holding {FAST_DIR}/, or {FAST_DIR}/ itself)"
        )
    missing = []
    dit = fast_model_dir(root)
    guess = model if model != "auto" else "fast"
    if dit == root and not is_model_folder(root):
        dit = None
        if model == "auto":
            what = (
                f"{root / FAST_DIR}/ (the Fast model: {DIFFUSERS_INDEX} + its shards, or {DIFFUSERS_SINGLE}, "
                f"or {FAST_NF4_DIR}/ with {NF4_WEIGHTS}; e.g. huggingface-cli download "
                f"robbyant/lingbot-world-fast --local-dir {root / FAST_DIR}), or {root / V2_DIR}/ "
                f"(LingBot-World 2.0 14B), or the 1.3B's model-0000i-of-00006.safetensors + {MODEL_INDEX}"
            )
        else:
            what = f"the {KINDS[model].title} DiT: {KINDS[model].dit} (huggingface-cli download {KINDS[model].repo})"
        missing.append(what)
    else:
        missing += folder_missing(dit, need_config=False)
        guess = model if model != "auto" else layout_kind(dit) or guess
    roots = [root.parent, root] if dit == root else [root]
    if assets is not None:
        roots.insert(0, assets)
    lacking = []
    text_encoder, tokenizer, vae = find_assets(roots, lacking)
    title = KINDS[guess].title
    if lacking and assets is None and guess == "v2-1.3b":
        hint = (
            f"the {title} release holds only the DiT; give the text encoder ({TEXT_ENCODER_NAMES[0]}), "
            f"tokenizer (google/umt5-xxl/) and VAE ({VAE_NAMES[0]}) with --assets_dir: the "
            f"{KINDS['v2-14b'].repo} folder (or a base-cam folder)"
        )
        if not missing:
            raise FileNotFoundError(f"{root}: {hint}")
        lacking = [hint]
    if missing or lacking:
        raise _missing_error(root, title, missing + lacking)
    source = detect_expert_format(dit, require_config=False)
    kind = detect_kind(source, model)
    return FastFiles(dit, text_encoder, tokenizer, vae, source.dit_config, source, kind)
