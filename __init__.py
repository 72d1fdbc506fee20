"""LingBot-World NF4: ComfyUI entry point. Registers the node classes; no logic here."""

try:
    import comfy.model_management  # noqa: F401  (present only inside ComfyUI)
except ImportError:  # imported as a plain package (CLI, tests): no nodes to register
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web/comfyui"  # the play panel (LingBot-World Play)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
