"""The LingBot-World-Fast checkpoint -> the files its phases need, every gap listed at once.

Fast is one causal DiT with a base-cam expert's tensor names and shapes, shipped as diffusers
shards (``diffusion_pytorch_model.safetensors.index.json``, stored fp32, no ``config.json``) and
installed as ``lingbot_world_fast/`` inside the base-cam folder, whose umT5 text encoder,
tokenizer and ``Wan2.1_VAE.pth`` it reuses. Accepted paths:

- the base-cam folder holding ``lingbot_world_fast_nf4/`` (written by ``lingbot.py quantize``) or
  ``lingbot_world_fast/``; a complete NF4 folder is taken first. Text encoder and VAE: in it.
- the Fast model folder itself, upstream's or an NF4 one ``lingbot.py quantize`` wrote, fp32 or bf16,
  sharded or single-file, with or without ``config.json``. Text encoder and VAE: in its parent
  folder, else in the folder itself.

Without ``config.json`` the architecture comes from the tensor shapes (the camera embedding's width
tells cam from act), num_heads as dim / 128 and the rest as the A14B config's; the whole layout is
then checked against the headers (`formats.detect_expert_format`).
"""

from dataclasses import dataclass
from pathlib import Path

from ..wan.config import DiTConfig
from .checkpoints import find_assets
from .formats import (
    DIFFUSERS_INDEX,
    DIFFUSERS_SINGLE,
    EXPERT_DIRS,
    NF4_WEIGHTS,
    CheckpointError,
    ExpertSource,
    detect_expert_format,
    folder_missing,
)
from .tensor_file import check_dir

FAST_DIR = "lingbot_world_fast"
FAST_NF4_DIR = "lingbot_world_fast_nf4"
FAST_DIRS = (FAST_NF4_DIR, FAST_DIR)  # preferred first


@dataclass(frozen=True)
class FastFiles:
    model: Path  # the Fast DiT's folder (an ExpertSource path)
    text_encoder: Path
    tokenizer: Path | None  # None: the encoder file carries its own tokenizer
    vae: Path
    config: DiTConfig  # from the model's headers (and config.json where there is one)
    source: ExpertSource  # layout, stored dtype and bytes, quantization

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
    """The Fast DiT folder for a base-cam folder holding one (the first complete of `names`, else the
    first present), or `path` itself when it holds weights or none of them is there."""
    root = Path(path)
    if root.is_dir() and not is_model_folder(root):
        present = [root / n for n in names if (root / n).is_dir()]
        complete = [d for d in present if folder_missing(d, need_config=False) == []]
        if complete or present:
            return (complete or present)[0]
    return root


def resolve_fast_dir(path) -> FastFiles:
    """FastFiles for a LingBot-World-Fast checkpoint (see the module docstring for what is accepted).

    Raises FileNotFoundError listing every missing or unusable file, or CheckpointError (a
    ValueError) naming the file and tensors that do not make a Wan DiT.
    """
    root = check_dir(path, "LingBot-World-Fast checkpoint folder")
    if root.name in {n for names in EXPERT_DIRS.values() for n in names}:
        raise CheckpointError(
            f"{root}: is one expert of the two-expert base model, not LingBot-World-Fast (give the "
            f"base-cam folder holding {FAST_DIR}/, or {FAST_DIR}/ itself)"
        )
    missing = []
    model = fast_model_dir(root)
    if model == root and not is_model_folder(root):
        model = None
        missing.append(
            f"{root / FAST_DIR}/ (the Fast model: {DIFFUSERS_INDEX} + its shards, or {DIFFUSERS_SINGLE}, "
            f"or {FAST_NF4_DIR}/ with {NF4_WEIGHTS}; e.g. huggingface-cli download "
            f"robbyant/lingbot-world-fast --local-dir {root / FAST_DIR})"
        )
    else:
        missing += folder_missing(model, need_config=False)
    roots = [root.parent, root] if model == root else [root]
    text_encoder, tokenizer, vae = find_assets(roots, missing)
    if missing:
        raise FileNotFoundError(
            f"{root}: incomplete LingBot-World-Fast checkpoint, missing or unusable:\n  - "
            + "\n  - ".join(missing)
        )
    source = detect_expert_format(model, require_config=False)
    return FastFiles(model, text_encoder, tokenizer, vae, source.dit_config, source)
