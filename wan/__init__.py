"""LingBot-World model math in plain torch: no ComfyUI, no file IO beyond tensors handed in."""
