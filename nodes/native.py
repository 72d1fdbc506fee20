"""Native ComfyUI nodes: one LingBot-World expert as a core MODEL, and image + camera conditioning as core
CONDITIONING + LATENT, so core samplers (KSamplerAdvanced x2 split at the boundary, ModelSamplingSD3 for the
shift), LoRA loaders and ComfyUI's model management run the model."""

import torch

from ..loaders.formats import CheckpointError, detect_expert_format
from ..loaders.stream import load_expert
from ..wan import i2v
from . import memory
from .camera import CAMERA
from .models import CATEGORY, MODELS_KIND, NO_EXPERTS, _default, expert_choices, resolve_model
from .native_camera import CAMERA_KEY, NativeCamera
from .sampler import frame_inputs, image_to_input
from .vae import sampler_vae

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STORED = "as stored"
MANAGEMENT_NOTE = (
    "Memory is ComfyUI's: it loads, offloads and partially loads the expert (lowvram) like any MODEL, but "
    "keeps each block's activations whole and offloads the idle expert to host RAM; the pack's own LingBot-World "
    "Sampler can also chunk activations (Speed: lean_activations), swap blocks ahead of time, drop the idle "
    "expert and plan a request before it loads, which fits longer or larger videos on small cards."
)


class LingBotNativeModelLoader:
    DESCRIPTION = (
        "Loads one LingBot-World expert (high- or low-noise) as a core MODEL: core's Wan2.2 DiT plus "
        "LingBot's camera layers. NF4 repacks stay 4-bit (dequantized layer by layer as they run), bf16/fp32 "
        "experts load as stored; streamed from disk by the pack's loader. Use two, one per expert, with "
        "ModelSamplingSD3 and two KSamplerAdvanced, and LoraLoaderModelOnly for LoRAs. " + MANAGEMENT_NOTE
    )
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The expert as a core MODEL (ModelPatcher): core samplers and LoRA loaders take it.",)

    @classmethod
    def INPUT_TYPES(cls):
        choices = expert_choices() or [NO_EXPERTS]
        return {
            "required": {
                "expert": (
                    choices,
                    {
                        "default": _default(choices, "high"),
                        "tooltip": "One expert from models/diffusion_models: an NF4 folder such as "
                        "lingbot-world-base-cam-nf4/high_noise_model_bnb_nf4, an upstream high_noise_model/ "
                        "folder (bf16 shards) or one .safetensors file.",
                    },
                ),
                "weight_dtype": (
                    [STORED, *DTYPES],
                    {
                        "default": STORED,
                        "tooltip": "dtype of the dense (non-4-bit) weights: as stored, or cast while loading. "
                        "ComfyUI picks the compute dtype for the device.",
                    },
                ),
                "quantize_to_nf4": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "Quantize a bf16/fp32 expert's Linear weights to NF4 while streaming it in "
                        "(~3.9x less memory); NF4 experts are used as stored either way.",
                    },
                ),
            }
        }

    def load(self, expert, weight_dtype, quantize_to_nf4):
        if expert == NO_EXPERTS:
            raise FileNotFoundError(
                "expert: no experts found in the diffusion_models folders; put an NF4 expert folder or a "
                ".safetensors expert there"
            )
        if weight_dtype != STORED and weight_dtype not in DTYPES:
            raise ValueError(f"weight_dtype: expected one of {[STORED, *DTYPES]}, got {weight_dtype!r}")
        try:
            src = detect_expert_format(resolve_model(MODELS_KIND, expert))
        except CheckpointError as e:
            raise ValueError(f"expert {expert!r}: {e}") from None
        if weight_dtype == STORED:
            dense = [
                t.dtype for n, t in src.tensors.items() if t.dtype in DTYPES.values() and n.endswith("bias")
            ]
            dtype = dense[0] if dense else torch.bfloat16
        else:
            dtype = DTYPES[weight_dtype]
        from .native_model import build_model  # ComfyUI's model classes: imported when a model loads

        expert_model = load_expert(src, "cpu", quantize=True if quantize_to_nf4 else None, dtype=dtype)
        return (build_model(src.dit_config, expert_model, dtype),)


class LingBotNativeImageToVideo:
    DESCRIPTION = (
        "LingBot-World conditioning for core samplers, like core WanImageToVideo: encodes the first frame "
        "(upstream's resize and sizing) and adds it, the first-frame mask and the camera path to positive and "
        "negative; returns the empty video LATENT to sample."
    )
    CATEGORY = CATEGORY
    FUNCTION = "encode"
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "negative", "latent")
    OUTPUT_TOOLTIPS = (
        "positive with the image latent, mask and camera.",
        "negative with the same.",
        "Empty video latent [1, 16, (frames-1)/4+1, H/8, W/8] for KSamplerAdvanced.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        inputs = frame_inputs()
        return {
            "required": {
                "positive": (
                    "CONDITIONING",
                    {"tooltip": "CLIP Text Encode of the prompt (Load CLIP, type wan)."},
                ),
                "negative": ("CONDITIONING", {"tooltip": "CLIP Text Encode of the negative prompt."}),
                **inputs,
                "length": (
                    "INT",
                    {
                        "default": 81,
                        "min": 1,
                        "max": 1601,
                        "step": 4,
                        "tooltip": "Frames, 4n+1 (81 = 5 s at 16 fps). A pose file with fewer poses caps it; an "
                        "action string sets it (wire the camera node's frame_num).",
                    },
                ),
            },
            "optional": {
                "camera": (
                    CAMERA,
                    {"tooltip": "From LingBot Camera or LingBot Camera Preset; none: no camera."},
                ),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, max_area=None, length=None):
        try:
            if isinstance(max_area, str):
                i2v.parse_max_area(max_area)
        except ValueError as e:
            return str(e)
        if length is not None:
            issue = i2v.frame_num_issue(length)
            return issue.replace("frame_num", "length") if issue else True
        return True

    def encode(self, positive, negative, vae, image, sizing, max_area, width, height, length, camera=None):
        img = image_to_input(image)
        try:
            if sizing == "max_area":
                size = i2v.latent_size(*img.shape[1:], i2v.parse_max_area(max_area))
            else:
                size = i2v.explicit_size(width, height)
            frames = length if camera is None else camera.plan(length)[2]
            lat_f = i2v.latent_frames(frames)
        except ValueError as e:
            raise ValueError(f"LingBot native image to video: {e}") from None
        lat_h, lat_w, h, w = size
        coder = sampler_vae(vae)
        concat = coder.to_comfy_latent(coder.encode(i2v.vae_input(img, frames, h, w)))
        mask = torch.ones(1, 1, lat_f, lat_h, lat_w)
        mask[:, :, :1] = 0.0  # the first latent frame is given (core's convention: 0 = keep)
        values = {"concat_latent_image": concat, "concat_mask": mask}
        if camera is not None:
            values[CAMERA_KEY] = NativeCamera(camera, frames, size)
        import node_helpers

        positive = node_helpers.conditioning_set_values(positive, values)
        negative = node_helpers.conditioning_set_values(negative, values)
        latent = torch.zeros(1, 16, lat_f, lat_h, lat_w, device=memory.intermediate_device())
        return (positive, negative, {"samples": latent})
