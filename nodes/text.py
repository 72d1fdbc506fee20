"""Text encode node: umT5-XXL in a child process (default) or here, then freed; embeddings on the CPU."""

import logging
from dataclasses import dataclass
from pathlib import Path

import folder_paths
import torch

from ..loaders.text_encode import MODES, encode_prompts
from ..loaders.text_encoder import read_encoder_config
from ..wan.config import NEGATIVE_PROMPT, T5_DTYPE, TEXT_LEN
from ..wan.t5 import T5Encoder
from . import memory
from .models import CATEGORY, resolve_model

TEXT = "LINGBOT_TEXT"
log = logging.getLogger("LingBot-World")
DEVICES = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class TextEmbeds:
    """What flows on a LINGBOT_TEXT link: bf16 CPU tensors [tokens, 4096]."""

    context: torch.Tensor
    context_null: torch.Tensor


def encoder_device(choice: str) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "gpu":
        return memory.torch_device()
    return memory.text_encoder_device()  # ComfyUI's own choice for text encoders


def encoder_bytes(path) -> int:
    """Device bytes of the encoder in its compute dtype (an fp8 file doubles), from shapes alone."""
    with torch.device("meta"):
        model = T5Encoder(**read_encoder_config(path))
    return sum(p.numel() for p in model.parameters()) * T5_DTYPE.itemsize


class LingBotTextEncode:
    DESCRIPTION = (
        "Encodes the prompt and the negative prompt with umT5-XXL (upstream .pth or ComfyUI's "
        "umt5_xxl_*.safetensors). The encoder is freed right after: by default it runs in a child "
        "process, so its ~11 GB never stay in ComfyUI's memory. Results are cached on disk."
    )
    CATEGORY = CATEGORY
    FUNCTION = "encode"
    RETURN_TYPES = (TEXT,)
    RETURN_NAMES = ("text",)
    OUTPUT_TOOLTIPS = ("Prompt and negative-prompt embeddings (CPU).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "text_encoder": (
                    folder_paths.get_filename_list("text_encoders"),
                    {
                        "tooltip": "umT5-XXL from models/text_encoders: models_t5_umt5-xxl-enc-bf16.pth (needs a "
                        "tokenizer/ folder beside it or the tokenizer input) or umt5_xxl_fp16/fp8_scaled.safetensors "
                        "(tokenizer embedded).",
                    },
                ),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What the video shows."}),
                "negative_prompt": (
                    "STRING",
                    {
                        "multiline": True,
                        "default": "",
                        "tooltip": "Empty = upstream LingBot-World's default negative prompt.",
                    },
                ),
                "mode": (
                    list(MODES),
                    {
                        "default": "subprocess",
                        "tooltip": "subprocess: encode in a child process that exits afterwards (no memory "
                        "left behind). inprocess: encode here and free the model afterwards.",
                    },
                ),
                "device": (
                    list(DEVICES),
                    {
                        "default": "auto",
                        "tooltip": "Where the encoder runs. auto = ComfyUI's text-encoder device.",
                    },
                ),
            },
            "optional": {
                "tokenizer": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Optional tokenizer folder (tokenizer.json or spiece.model) or file. Empty = "
                        "the encoder's embedded tokenizer, or tokenizer/ or google/umt5-xxl/ beside it.",
                    },
                ),
            },
        }

    def encode(self, text_encoder, prompt, negative_prompt, mode, device, tokenizer=""):
        path = resolve_model("text_encoders", text_encoder)
        tok = Path(tokenizer.strip()).expanduser() if tokenizer.strip() else None
        dev = encoder_device(device)
        if dev.type != "cpu":
            memory.make_room(encoder_bytes(path) + memory.GIB, dev)
        negative = negative_prompt if negative_prompt.strip() else NEGATIVE_PROMPT
        context, context_null = encode_prompts(
            path, [prompt, negative], tokenizer_path=tok, device=dev, mode=mode
        )
        memory.after_release()
        return (TextEmbeds(context, context_null),)


def conditioning_to_context(conditioning, name: str) -> torch.Tensor:
    """Core CONDITIONING (CLIPTextEncode with a `wan` CLIP) -> upstream's form, bf16 CPU [tokens, dim].

    ComfyUI's umT5 pads every prompt to 512 tokens and zeroes the positions after the end token;
    upstream keeps each prompt's own tokens (end token included) and lets the DiT pad. So the rows
    are cut at the attention mask when ComfyUI passes one, else after the last non-zero row, and at
    most upstream's 512 tokens are kept.
    """
    if not isinstance(conditioning, list) or not conditioning:
        raise ValueError(
            f"{name}: expected CONDITIONING from CLIP Text Encode, got {type(conditioning).__name__}"
        )
    if len(conditioning) != 1:
        raise ValueError(
            f"{name}: expected one conditioning entry (a single CLIP Text Encode with a wan CLIP), got "
            f"{len(conditioning)}; combined or area conditioning is not supported"
        )
    cond, extra = conditioning[0][0], conditioning[0][1] if len(conditioning[0]) > 1 else {}
    if not isinstance(cond, torch.Tensor) or cond.dim() != 3 or cond.shape[0] != 1:
        shape = list(cond.shape) if isinstance(cond, torch.Tensor) else type(cond).__name__
        raise ValueError(f"{name}: expected conditioning [1, tokens, dim] from CLIP Text Encode, got {shape}")
    rows = cond[0]
    mask = extra.get("attention_mask") if isinstance(extra, dict) else None
    if isinstance(mask, torch.Tensor) and mask.numel() == rows.shape[0]:
        keep = int(mask.reshape(-1).gt(0).sum())
    else:
        nonzero = rows.ne(0).any(dim=-1).nonzero()
        keep = int(nonzero[-1]) + 1 if len(nonzero) else 0
    if keep == 0:
        raise ValueError(
            f"{name}: the conditioning is all zeros (ConditioningZeroOut?); encode a prompt instead"
        )
    if keep > TEXT_LEN:
        log.warning("%s: %d tokens, upstream keeps %d; the rest is dropped", name, keep, TEXT_LEN)
        keep = TEXT_LEN
    return rows[:keep].to("cpu", T5_DTYPE).contiguous()


def sampler_text(text, positive, negative) -> TextEmbeds:
    """The sampler's text: our LINGBOT_TEXT, or core positive + negative CONDITIONING."""
    if positive is None and negative is None:
        if text is None:
            raise ValueError(
                "text: connect LingBot Text Encode to 'text', or CLIP Text Encode (wan CLIP) to positive and negative"
            )
        return text
    if text is not None:
        raise ValueError("text: connect either 'text' or positive/negative, not both")
    if positive is None or negative is None:
        missing = "negative" if negative is None else "positive"
        raise ValueError(f"{missing}: positive and negative CONDITIONING go together; connect both")
    return TextEmbeds(
        conditioning_to_context(positive, "positive"), conditioning_to_context(negative, "negative")
    )
