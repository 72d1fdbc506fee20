"""Random umT5 checkpoints and tokenizers built offline, in both file layouts (tests and the demo)."""

import io
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..wan.t5 import T5Encoder, random_param
from .text_encoder import SPIECE_KEY, hf_name

TINY = dict(vocab=160, dim=32, dim_attn=32, dim_ffn=48, num_heads=4, num_layers=2, num_buckets=32)

CORPUS = (
    "The video presents a soaring journey through a fantasy jungle.",
    "The wind whips past the rider's blue hands gripping the reins, causing the leather straps to vibrate.",
    "A camera glides over a quiet harbor at dawn, boats rocking gently on silver water.",
    "The ancient gothic castle approaches steadily, its stone details becoming clearer.",
    "画面突变，色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量",
    "Low quality, blurry, static frames, watermark, text, distorted limbs & faces.",
)


def upstream_state_dict(config: dict = TINY, seed: int = 0, dtype=torch.bfloat16) -> dict:
    """Random weights under upstream names (what models_t5_umt5-xxl-enc-bf16.pth holds)."""
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in T5Encoder(**config).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    return {n: random_param(n, shape, config, g).to(dtype) for n, shape in names.items()}


def write_pth(path: Path, sd: dict) -> Path:
    torch.save(sd, path)
    return path


def write_hf_safetensors(
    path: Path, sd: dict, spiece: bytes | None = None, dtype=None, fp8_scaled: bool = False
) -> Path:
    """The ComfyUI layout: HF T5 key names, optional embedded tokenizer, optional scaled fp8 Linears."""
    out = {}
    for name, t in sd.items():
        t = t if dtype is None else t.to(dtype)
        key = hf_name(name)
        if fp8_scaled and t.ndim == 2 and not name.endswith(("token_embedding.weight", "embedding.weight")):
            scale = t.float().abs().max() / torch.finfo(torch.float8_e4m3fn).max
            out[key] = (t.float() / scale).to(torch.float8_e4m3fn)
            out[key.removesuffix(".weight") + ".scale_weight"] = scale.reshape(())
        else:
            out[key] = t.contiguous()
    if fp8_scaled:
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    if spiece is not None:
        out[SPIECE_KEY] = torch.frombuffer(bytearray(spiece), dtype=torch.uint8)
    save_file(out, str(path))
    return path


def spiece_model_bytes(vocab_size: int = 120) -> bytes:
    """A unigram sentencepiece model with T5's special ids (pad 0, eos 1, unk 2, no bos)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(CORPUS) * 20),
        model_writer=buf,
        vocab_size=vocab_size,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    return buf.getvalue()


def write_tokenizer_json(folder: Path, vocab_size: int = 120) -> Path:
    """A T5-style fast tokenizer folder: unigram + Metaspace, '$A </s>' post-processor, <pad> = 0."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) * 20, trainer=trainer)
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    )
    return folder
