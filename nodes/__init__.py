"""ComfyUI adapters: the only code in the pack that imports comfy.*."""

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
