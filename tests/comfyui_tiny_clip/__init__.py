"""Test-only ComfyUI node: core's Wan umT5 text encoder (comfy.text_encoders.wan, the model and the
tokenizer CLIPLoader type `wan` builds) at the size of a tiny test file.

Core CLIPLoader builds umT5 from a fixed XXL config (4096 wide, 24 blocks) and recognises the file by
its 24th block, so a tiny random encoder cannot go through it. This loader builds the same ComfyUI
classes with the config read off the file's shapes (ComfyUI's `umt5xxl_model_config` model option)
and loads the file as CLIPLoader does; CLIP Text Encode then runs ComfyUI's own tokenizer, padding
and masking. The real-ComfyUI tests put it in place of CLIPLoader; it is not part of the pack.
"""

import types

import comfy.sd
import comfy.text_encoders.wan
import comfy.utils
import folder_paths

from .shapes import umt5_config


def tiny_wan_clip(path: str):
    sd = comfy.utils.load_torch_file(path, safe_load=True)
    config = umt5_config(sd)
    target = types.SimpleNamespace(
        params={}, clip=comfy.text_encoders.wan.te(), tokenizer=comfy.text_encoders.wan.WanT5Tokenizer
    )
    clip = comfy.sd.CLIP(
        target,
        tokenizer_data={"spiece_model": sd.get("spiece_model")},
        parameters=comfy.utils.calculate_parameters(sd),
        model_options={"umt5xxl_model_config": config},
    )
    missing, _ = clip.load_sd(sd)
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    return clip


class LingBotTestTinyWanCLIPLoader:
    CATEGORY = "testing"
    FUNCTION = "load"
    RETURN_TYPES = ("CLIP",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip_name": (folder_paths.get_filename_list("text_encoders"),)}}

    def load(self, clip_name):
        return (tiny_wan_clip(folder_paths.get_full_path_or_raise("text_encoders", clip_name)),)


NODE_CLASS_MAPPINGS = {"LingBotTestTinyWanCLIPLoader": LingBotTestTinyWanCLIPLoader}
