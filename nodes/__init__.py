"""ComfyUI adapters: the only code in the pack that imports comfy.* (through nodes/memory.py)."""

from .camera import LingBotCamera, LingBotCameraPreset, LingBotCameraPreview
from .fast import LingBotFastLoader, LingBotFastSampler
from .models import LingBotExpertsLoader, LingBotLoRA
from .native import LingBotNativeImageToVideo, LingBotNativeModelLoader
from .play import LingBotPlay
from .sampler import LingBotSampler
from .speed import LingBotSpeed
from .text import LingBotTextEncode
from .vae import LingBotVAEDecode, LingBotVAELoader

_NODES = {
    "LingBotExpertsLoader": (LingBotExpertsLoader, "LingBot Experts Loader (NF4 streaming)"),
    "LingBotLoRA": (LingBotLoRA, "LingBot LoRA"),
    "LingBotTextEncode": (LingBotTextEncode, "LingBot Text Encode (umT5)"),
    "LingBotCamera": (LingBotCamera, "LingBot Camera Path"),
    "LingBotCameraPreset": (LingBotCameraPreset, "LingBot Camera Preset"),
    "LingBotCameraPreview": (LingBotCameraPreview, "LingBot Camera Path Preview"),
    "LingBotVAELoader": (LingBotVAELoader, "LingBot VAE Loader (Wan2.1)"),
    "LingBotSampler": (LingBotSampler, "LingBot-World Sampler"),
    "LingBotSpeed": (LingBotSpeed, "LingBot Speed Options"),
    "LingBotVAEDecode": (LingBotVAEDecode, "LingBot VAE Decode"),
    "LingBotFastLoader": (LingBotFastLoader, "LingBot-World-Fast Loader"),
    "LingBotFastSampler": (LingBotFastSampler, "LingBot-World-Fast Sampler (chunked)"),
    "LingBotNativeModelLoader": (LingBotNativeModelLoader, "LingBot-World Model (native)"),
    "LingBotNativeImageToVideo": (LingBotNativeImageToVideo, "LingBot-World Image To Video (native)"),
    "LingBotPlay": (LingBotPlay, "LingBot-World Play"),
}
NODE_CLASS_MAPPINGS = {k: cls for k, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {k: name for k, (_, name) in _NODES.items()}
