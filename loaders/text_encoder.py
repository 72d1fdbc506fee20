"""umT5-XXL encoder checkpoints and tokenizers: files to a ready `T5Encoder` and `UMT5Tokenizer`.

Accepted encoder files:
- upstream Wan `models_t5_umt5-xxl-enc-bf16.pth` (upstream parameter names), read only through
  `torch.load(weights_only=True, mmap=True)`;
- ComfyUI `models/text_encoders/umt5_xxl_*.safetensors` (Hugging Face T5 key names) in fp32, fp16,
  bf16, plain fp8, or "fp8 scaled" (fp8 weights + per-layer `scale_weight` + a `scaled_fp8` marker;
  dequantized as ComfyUI does: weight.to(dtype) * scale.to(dtype)).

The model is built on the meta device and every tensor is assigned straight from the file, converted to
the target dtype/device one tensor at a time, so no dense random init and no second copy of the weights.

Tokenizers: a `tokenizer.json` (Hugging Face fast tokenizer, via `tokenizers`), a sentencepiece
`spiece.model`, or the `spiece_model` uint8 tensor that ComfyUI embeds in its safetensors. Text is cleaned
as upstream (`clean='whitespace'`: ftfy, double html unescape, whitespace collapse), truncated to
`text_len` tokens with `</s>` kept last, and padded with `<pad>` up to `text_len`.
"""

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..wan.config import T5_DTYPE, TEXT_LEN
from ..wan.t5 import T5Encoder
from .interrupts import InterruptGuard
from .tensor_file import CheckpointError, TensorFile, check_file, exists, name_list, read_safetensors_header

SUPPORTED_FILES = (
    "upstream `models_t5_umt5-xxl-enc-bf16.pth`, or a ComfyUI umT5-XXL `.safetensors` "
    "(umt5_xxl_fp16 / bf16 / fp32 / fp8_e4m3fn / fp8_e4m3fn_scaled)"
)
SPIECE_KEY = "spiece_model"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)

# ---------------------------------------------------------------------------------------------------
# Key names: upstream (.pth) <-> Hugging Face T5 (ComfyUI safetensors). One table drives both ways.

_GLOBAL_NAMES = {
    "token_embedding.weight": "shared.weight",
    "norm.weight": "encoder.final_layer_norm.weight",
}
_BLOCK_NAMES = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # the GELU branch
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",  # the linear branch
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
_HF_BLOCK = re.compile(r"encoder\.block\.(\d+)\.(.+)")
_UP_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_ANCHOR = re.compile(r"(?:^|\.)(encoder\.(?:block\.\d+\.|final_layer_norm\.weight$))")
_HF_TO_UP_BLOCK = {hf: up for up, hf in _BLOCK_NAMES.items()}
_HF_TO_UP_GLOBAL = {hf: up for up, hf in _GLOBAL_NAMES.items()}


def hf_name(upstream_name: str) -> str:
    """Hugging Face T5 key for an upstream parameter name (KeyError if there is none)."""
    if upstream_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[upstream_name]
    m = _UP_BLOCK.fullmatch(upstream_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise KeyError(upstream_name)
    return f"encoder.block.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"


def upstream_name(hf_key: str) -> str | None:
    """Upstream parameter name for a Hugging Face T5 encoder key, or None if it is not one."""
    if hf_key in _HF_TO_UP_GLOBAL:
        return _HF_TO_UP_GLOBAL[hf_key]
    m = _HF_BLOCK.fullmatch(hf_key)
    if m is None or m.group(2) not in _HF_TO_UP_BLOCK:
        return None
    return f"blocks.{m.group(1)}.{_HF_TO_UP_BLOCK[m.group(2)]}"


# ---------------------------------------------------------------------------------------------------
# Reading files


def file_identity(path) -> str:
    """Cheap identity of a file's content: resolved path + size + mtime_ns."""
    p = Path(path).resolve()
    st = p.stat()
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


@dataclass
class _Plan:
    """Where each upstream parameter comes from in a file."""

    layout: str  # 'upstream' | 'hf'
    sources: dict  # upstream name -> file key
    scales: dict  # upstream name -> file key of its scale_weight (fp8 scaled files)


def _plan(ckpt: TensorFile) -> _Plan:
    keys = set(ckpt.keys)
    if "token_embedding.weight" in keys or any(k.startswith("blocks.") for k in keys):
        unexpected = sorted(
            k
            for k in keys
            if k != "norm.weight" and k != "token_embedding.weight" and not _UP_BLOCK.fullmatch(k)
        )
        if unexpected:
            raise CheckpointError(
                f"{ckpt.path} is not an upstream umT5 encoder checkpoint: unexpected keys {name_list(unexpected)}"
            )
        return _Plan("upstream", {k: k for k in keys}, {})

    anchors = sorted((m for m in map(_HF_ANCHOR.search, keys) if m is not None), key=lambda m: m.string)
    if not anchors:
        raise CheckpointError(
            f"{ckpt.path} is not a umT5 encoder checkpoint: expected upstream keys (token_embedding.weight, "
            f"blocks.N...) or Hugging Face T5 keys (shared.weight, encoder.block.N...); found "
            f"{name_list(keys)}. Supported: {SUPPORTED_FILES}"
        )
    # ComfyUI saves the bare T5 keys; tolerate a prefix in front of `encoder.` all the same.
    prefix = anchors[0].string[: anchors[0].start(1)]
    sources, scales, unexpected = {}, {}, []
    for key in keys:
        rest = key[len(prefix) :] if key.startswith(prefix) else None
        if key in (SPIECE_KEY, prefix + SPIECE_KEY, "scaled_fp8", prefix + "scaled_fp8") or rest is None:
            continue
        if rest.startswith("decoder.") or rest == "lm_head.weight" or rest.endswith(".scale_input"):
            continue  # full-T5 files and ComfyUI's optional fp8 input scales carry parts we don't run
        if rest == "encoder.embed_tokens.weight":
            sources.setdefault("token_embedding.weight", key)  # tied copy of shared.weight
            continue
        if rest.endswith(".scale_weight"):
            name = upstream_name(rest[: -len(".scale_weight")] + ".weight")
            if name is None:
                unexpected.append(key)
            else:
                scales[name] = key
            continue
        name = upstream_name(rest)
        if name is None:
            unexpected.append(key)
        else:
            sources[name] = key  # shared.weight wins over the tied encoder.embed_tokens copy
    if unexpected:
        quant = [
            k for k in unexpected if k.endswith((".weight_scale", ".comfy_quant", ".input_scale", ".absmax"))
        ]
        what = "quantization format" if quant else "keys"
        raise CheckpointError(
            f"{ckpt.path}: unsupported {what} for a umT5 encoder: {name_list(unexpected)}. "
            f"Supported: {SUPPORTED_FILES}"
        )
    return _Plan("hf", sources, scales)


def _config(ckpt: TensorFile, plan: _Plan) -> dict:
    needed = [
        "token_embedding.weight",
        "blocks.0.attn.q.weight",
        "blocks.0.ffn.fc1.weight",
        "blocks.0.pos_embedding.embedding.weight",
    ]
    missing = [n for n in needed if n not in plan.sources]
    if missing:
        names = missing if plan.layout == "upstream" else [hf_name(n) for n in missing]
        raise CheckpointError(f"{ckpt.path}: missing keys {', '.join(names)} (not a complete umT5 encoder)")
    for name in needed:
        shape = ckpt.shape(plan.sources[name])
        if len(shape) != 2 or min(shape) < 1:
            raise CheckpointError(
                f"{ckpt.path}: tensor {plan.sources[name]} has shape {list(shape)}, expected a non-empty 2-D "
                "weight (rows, columns)"
            )
    vocab, dim = ckpt.shape(plan.sources["token_embedding.weight"])
    num_buckets, num_heads = ckpt.shape(plan.sources["blocks.0.pos_embedding.embedding.weight"])
    layers = {int(_UP_BLOCK.fullmatch(n).group(1)) for n in plan.sources if n.startswith("blocks.")}
    return dict(
        vocab=vocab,
        dim=dim,
        dim_attn=ckpt.shape(plan.sources["blocks.0.attn.q.weight"])[0],
        dim_ffn=ckpt.shape(plan.sources["blocks.0.ffn.fc1.weight"])[0],
        num_heads=num_heads,
        num_layers=max(layers) + 1,
        num_buckets=num_buckets,
    )


def read_encoder_config(path) -> dict:
    """T5Encoder constructor arguments read from a checkpoint's tensor shapes (no weights loaded)."""
    ckpt = TensorFile(path, "text encoder", SUPPORTED_FILES)
    return _config(ckpt, _plan(ckpt))


def _to_param(t: torch.Tensor, scale: torch.Tensor | None, dtype, device, where: str) -> nn.Parameter:
    if t.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {t.dtype} (expected fp32, fp16, bf16 or fp8)")
    if scale is not None:
        if scale.numel() != 1:
            raise CheckpointError(f"{where}: expected a scalar scale_weight, got shape {tuple(scale.shape)}")
        # ComfyUI's scaled-fp8 Linear: weight cast to the compute dtype, times the scale in that dtype.
        t = t.to(device=device, dtype=dtype) * scale.reshape(()).to(device=device, dtype=dtype)
    else:
        t = t.to(device=device, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


def load_text_encoder(path, device="cpu", dtype: torch.dtype = T5_DTYPE) -> T5Encoder:
    """Build the umT5 encoder described by the file's shapes on `device` in `dtype` (eval, no grad).

    Raises FileNotFoundError for a missing file and ValueError naming the keys for a wrong, incomplete
    or mismatched checkpoint.
    """
    ckpt = TensorFile(path, "text encoder", SUPPORTED_FILES)
    plan = _plan(ckpt)
    config = _config(ckpt, plan)
    try:
        with torch.device("meta"):
            model = T5Encoder(**config)
    except (ValueError, TypeError, ArithmeticError) as e:
        raise CheckpointError(f"{ckpt.path}: tensor shapes give no usable umT5 encoder ({e})") from None
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(plan.sources))
    extra = sorted(set(plan.sources) - set(expected))

    def file_names(names):
        return names if plan.layout == "upstream" else [hf_name(n) for n in names]

    if missing:
        raise CheckpointError(
            f"{ckpt.path}: missing keys for a {config['num_layers']}-layer umT5 encoder: {name_list(file_names(missing))}"
        )
    if extra:
        raise CheckpointError(f"{ckpt.path}: unexpected keys: {name_list(file_names(extra))}")

    device = torch.device(device)
    with InterruptGuard():  # Ctrl-C inside safetensors' read must stay a KeyboardInterrupt
        _assign(model, ckpt, plan, expected, dtype, device)
    return model.eval()


def _assign(model, ckpt: TensorFile, plan: _Plan, expected: dict, dtype, device) -> None:
    for name, param in expected.items():
        key = plan.sources[name]
        shape = ckpt.shape(key)
        if shape != tuple(param.shape):
            raise CheckpointError(
                f"{ckpt.path}: tensor {key} has shape {list(shape)}, expected {list(param.shape)}"
            )
        scale = ckpt.get(plan.scales[name]) if name in plan.scales else None
        new = _to_param(ckpt.get(key), scale, dtype, device, f"{ckpt.path}: tensor {key}")
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, new)


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def basic_clean(text: str) -> str:
    import ftfy

    text = ftfy.fix_text(text)
    return html.unescape(html.unescape(text)).strip()


def whitespace_clean(text: str) -> str:
    # Upstream uses the `regex` package; after ftfy and html.unescape (which drop the C0 controls
    # \x1c-\x1f, the only code points where `re`'s \s differs from it) the two match the same set.
    return re.sub(r"\s+", " ", text).strip()


def clean_text(text: str) -> str:
    """Upstream's `clean='whitespace'` prompt cleaning."""
    return whitespace_clean(basic_clean(text))


@dataclass(frozen=True)
class TokenizerSource:
    """A resolved tokenizer: kind 'json' (tokenizer.json), 'spiece' (spiece.model) or 'embedded'
    (the `spiece_model` tensor of an encoder .safetensors), and the file it comes from."""

    kind: str
    path: Path

    def identity(self) -> str:
        return f"{self.kind}:{file_identity(self.path)}"


def _has_spiece_tensor(path: Path) -> bool:
    """Whether `path` is a safetensors file with a tokenizer inside; False for anything unreadable
    (the encoder's own loading reports that)."""
    if path.suffix.lower() != ".safetensors":
        return False
    try:
        refs, _ = read_safetensors_header(path)
    except (OSError, ValueError):
        return False
    return SPIECE_KEY in refs


def _in_folder(folder: Path) -> TokenizerSource | None:
    """The tokenizer file in a folder; one that is there but unreadable is returned all the same, so
    that loading it names the problem."""
    if exists(folder / "tokenizer.json"):
        return TokenizerSource("json", folder / "tokenizer.json")
    if exists(folder / "spiece.model"):
        return TokenizerSource("spiece", folder / "spiece.model")
    return None


def resolve_tokenizer(tokenizer_path=None, encoder_path=None) -> TokenizerSource:
    """Find the tokenizer without loading it.

    tokenizer_path may be a folder holding tokenizer.json or spiece.model (a checkpoint's `tokenizer/`,
    a `google/umt5-xxl` folder), one of those files, or a .safetensors with a `spiece_model` tensor.
    Without it: the encoder's own `spiece_model` tensor, then `tokenizer/`, `google/umt5-xxl/` and
    `umt5-xxl/` beside the encoder file. Never downloads anything.
    """
    if tokenizer_path is not None:
        p = Path(tokenizer_path)
        if not exists(p):
            raise FileNotFoundError(f"tokenizer not found: {p}")
        if p.is_dir():
            found = _in_folder(p)
            if found is None:
                raise FileNotFoundError(f"tokenizer folder {p} holds neither tokenizer.json nor spiece.model")
            return found
        check_file(p, "tokenizer file")
        if p.suffix.lower() == ".json":
            return TokenizerSource("json", p)
        if p.suffix.lower() == ".model":
            return TokenizerSource("spiece", p)
        if _has_spiece_tensor(p):
            return TokenizerSource("embedded", p)
        raise CheckpointError(
            f"{p}: not a tokenizer (expected a folder with tokenizer.json or spiece.model, one of those "
            f"files, or a .safetensors holding a '{SPIECE_KEY}' tensor)"
        )
    if encoder_path is None:
        raise ValueError("resolve_tokenizer needs tokenizer_path or encoder_path")
    enc = Path(encoder_path)
    if _has_spiece_tensor(enc):
        return TokenizerSource("embedded", enc)
    folders = [enc.parent / "tokenizer", enc.parent / "google" / "umt5-xxl", enc.parent / "umt5-xxl"]
    for folder in folders:
        found = _in_folder(folder) if folder.is_dir() else None
        if found is not None:
            return found
    raise FileNotFoundError(
        f"no umT5 tokenizer found for {enc}: it has no '{SPIECE_KEY}' tensor and none of "
        f"{', '.join(str(f) for f in folders)} holds tokenizer.json or spiece.model. Pass tokenizer_path "
        "(e.g. the checkpoint's tokenizer/ or google/umt5-xxl folder)."
    )


def _pad_token_name(folder: Path) -> str:
    """The pad token named by tokenizer_config.json / special_tokens_map.json, else T5's '<pad>'."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = folder / name
        if f.is_file():
            try:
                pad = json.loads(f.read_text(encoding="utf-8")).get("pad_token")
            except (ValueError, OSError):
                continue
            if isinstance(pad, dict):
                pad = pad.get("content")
            if isinstance(pad, str):
                return pad
    return "<pad>"


class UMT5Tokenizer:
    """Prompt -> ids padded to `text_len` with a 0/1 mask, as upstream's HuggingfaceTokenizer
    (padding='max_length', truncation=True, add_special_tokens=True, clean='whitespace')."""

    def __init__(self, source: TokenizerSource, text_len: int = TEXT_LEN):
        self.source = source
        self.text_len = text_len
        check_file(source.path, "tokenizer file")
        if source.kind == "json":
            from tokenizers import Tokenizer

            try:
                tok = Tokenizer.from_file(str(source.path))
            except Exception as e:
                raise CheckpointError(f"{source.path}: not a readable tokenizer.json ({e})") from e
            tok.no_padding()
            # Like transformers: the limit counts the special tokens the post-processor adds.
            tok.enable_truncation(max_length=text_len)
            pad = _pad_token_name(source.path.parent)
            self.pad_id = tok.token_to_id(pad)
            if self.pad_id is None:
                raise CheckpointError(f"{source.path}: pad token {pad!r} is not in the vocabulary")
            self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
            self._tok = tok
        else:
            import sentencepiece

            if source.kind == "embedded":
                ckpt = TensorFile(source.path, "text encoder", SUPPORTED_FILES)
                if SPIECE_KEY not in ckpt.shapes:
                    raise CheckpointError(
                        f"{source.path}: holds no '{SPIECE_KEY}' tensor (embedded tokenizer)"
                    )
                args = dict(model_proto=ckpt.get(SPIECE_KEY).numpy().tobytes())
            else:
                args = dict(model_file=str(source.path))
            try:
                sp = sentencepiece.SentencePieceProcessor(**args)
            except Exception as e:
                raise CheckpointError(f"{source.path}: not a readable sentencepiece model ({e})") from e
            self.pad_id, self.eos_id = sp.pad_id(), sp.eos_id()
            if self.pad_id < 0 or self.eos_id < 0:
                raise CheckpointError(f"{source.path}: sentencepiece model defines no pad or eos id")
            self.vocab_size = sp.get_piece_size()
            self._sp = sp

    def encode(self, text: str) -> list[int]:
        """Token ids of one cleaned prompt, `</s>` last, at most text_len of them."""
        text = clean_text(text)
        if self.source.kind == "json":
            return self._tok.encode(text, add_special_tokens=True).ids
        # Same result as HF's sentencepiece T5 tokenizer: content cut to text_len - 1, then </s>.
        return self._sp.encode(text)[: self.text_len - 1] + [self.eos_id]

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, text_len] int64 and mask [B, text_len] int64 (1 = real token)."""
        ids = torch.full((len(texts), self.text_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), self.text_len), dtype=torch.long)
        for i, text in enumerate(texts):
            row = self.encode(text)
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return ids, mask

    def check_fits(self, vocab_rows: int, encoder_path=None) -> None:
        """ValueError if this tokenizer can emit ids beyond the encoder's embedding table."""
        if self.vocab_size > vocab_rows:
            raise CheckpointError(
                f"tokenizer {self.source.path} has {self.vocab_size} tokens but the text encoder "
                f"{encoder_path or ''} embeds only {vocab_rows}: this tokenizer does not belong to this encoder "
                "(umT5-XXL needs the google/umt5-xxl tokenizer, 256384 rows)"
            )


def load_tokenizer(tokenizer_path=None, encoder_path=None, text_len: int = TEXT_LEN) -> UMT5Tokenizer:
    """Resolve (see resolve_tokenizer) and load the tokenizer."""
    return UMT5Tokenizer(resolve_tokenizer(tokenizer_path, encoder_path), text_len)
