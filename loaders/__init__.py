"""Checkpoint IO: files to modules on a device. Plain torch, never imports ComfyUI."""
