"""The session layer: for each model kind, request -> checks -> memory plan -> run.

Between the front ends (`cli.py`, `nodes/`) and the model code: it uses `loaders/` (files into modules)
and `wan/` (model math), and never imports ComfyUI or the front ends.
"""
