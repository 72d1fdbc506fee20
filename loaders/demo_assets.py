"""A tiny random LingBot-World checkpoint in the NF4 repack's exact layout, for the demo and tests.

Written once into a cache folder (built in a temporary folder, then renamed into place), so the
demo runs offline in seconds on a CPU. The numbers are random: the demo shows the whole flow —
streaming NF4 load, self-freeing text encode, camera conditioning, dual-expert sampling, VAE
decode, MP4 — not a meaningful video.
"""

import shutil
import tempfile
from pathlib import Path

import torch

from ..wan.vae import WAN21_VAE_CONFIG, WanVAE
from ..wan.vae import init_random_ as init_vae_
from .synthetic import tiny_config, write_nf4_expert
from .synthetic_text import TINY, upstream_state_dict, write_pth, write_tokenizer_json

VERSION = "v1"  # bump when the layout or sizes change, so stale caches are rebuilt
DEMO_VAE = {**WAN21_VAE_CONFIG, "dim": 8}


def build_demo_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config("cam", text_dim=TINY["dim"], text_len=512)
    write_nf4_expert(folder / "high_noise_model_bnb_nf4", cfg, seed=1)
    write_nf4_expert(folder / "low_noise_model_bnb_nf4", cfg, seed=2)
    write_pth(folder / "models_t5_umt5-xxl-enc-bf16.pth", upstream_state_dict(TINY, seed=3))
    write_tokenizer_json(folder / "tokenizer", vocab_size=120)
    vae = init_vae_(WanVAE(**DEMO_VAE), seed=4)
    torch.save(vae.state_dict(), folder / "Wan2.1_VAE.pth")
    return folder


def ensure_demo_checkpoint(workdir) -> Path:
    """The demo checkpoint folder under `workdir`, built on first use."""
    target = Path(workdir) / VERSION
    if (target / "COMPLETE").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_demo_checkpoint(tmp)
        (tmp / "COMPLETE").write_text("tiny random LingBot-World checkpoint for the demo\n")
        if target.exists():  # an incomplete earlier attempt
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
