"""Run by ComfyUI's python (cwd = the ComfyUI checkout): encode prompts with ComfyUI's Wan umT5 (its
tokenizer, padding, masking and T5; tiny config read off the file) + our CONDITIONING conversion, and
with the pack's own text encoder, from the same file; print JSON with the shapes and the largest
difference per prompt. It calls the text model's `encode_token_weights` on the tokenizer's
`tokenize_with_weights` output, which is what CLIP Text Encode reaches through comfy.sd.CLIP, so it
needs neither comfy.sd nor the server.

    python comfyui_text_parity.py PACK_ROOT TEXT_ENCODER_FILE PROMPT [PROMPT ...]
"""

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, ".")
sys.path.insert(0, str(HERE))


def main(pack_root: str, encoder: str, prompts: list) -> dict:
    from comfy.cli_args import args

    args.cpu = True  # as the test server runs; read when comfy.model_management is first imported
    import comfy.text_encoders.wan
    import comfy.utils
    import torch

    sys.path.insert(0, pack_root)
    from lingbot import load_pack

    load_pack()
    from lingbot_world.loaders.text_encode import encode_in_process
    from lingbot_world.nodes.text import conditioning_to_context

    sd = comfy.utils.load_torch_file(encoder, safe_load=True)
    # the test node package's plain-Python part, loaded by path: its __init__ imports comfy.sd
    spec = importlib.util.spec_from_file_location(
        "_tiny_clip_shapes", HERE / "comfyui_tiny_clip" / "shapes.py"
    )
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    config = shapes.umt5_config(sd)
    model = comfy.text_encoders.wan.te()(
        device="cpu", dtype=torch.float32, model_options={"umt5xxl_model_config": config}
    )
    missing, _ = model.load_sd(sd)
    assert not missing, missing
    tokenizer = comfy.text_encoders.wan.WanT5Tokenizer(tokenizer_data={"spiece_model": sd["spiece_model"]})
    ours, _ = encode_in_process(encoder, prompts)
    out = []
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.no_grad():
            cond, pooled = model.encode_token_weights(tokenizer.tokenize_with_weights(prompt))[:2]
        cond = [[cond, {"pooled_output": pooled}]]
        theirs = conditioning_to_context(cond, "positive")
        row = {
            "prompt": prompt,
            "comfy_padded": list(cond[0][0].shape),
            "comfy": list(theirs.shape),
            "ours": list(mine.shape),
            "dtype": str(theirs.dtype),
        }
        if theirs.shape == mine.shape:
            diff = (theirs.float() - mine.float()).abs()
            row["max_abs_diff"] = float(diff.max())
            row["max_abs"] = float(mine.float().abs().max())
        out.append(row)
    return {"results": out}


if __name__ == "__main__":
    print("PARITY " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
