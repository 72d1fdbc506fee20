"""Keys, shapes and one tensor at a time from a `.safetensors` file or a weights-only torch file.

Torch files are only ever read with `torch.load(weights_only=True, mmap=True)`: nothing is unpickled
beyond tensors, and tensors stay memory-mapped until a caller copies one.
"""

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")


class TensorFile:
    """`what` names the file's role in errors; `supported` says which files would do.

    `allow_unmapped`: also accept the legacy (non-zip) torch format, which cannot be memory-mapped
    and is read whole; only for small files such as the VAE.
    """

    def __init__(self, path, what: str, supported: str, allow_unmapped: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{what} file not found: {self.path}")
        suffix = self.path.suffix.lower()
        self._st = self._sd = None
        if suffix == ".safetensors":
            try:
                self._st = safe_open(str(self.path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{self.path}: not a readable .safetensors file ({e})") from e
            self.shapes = {k: tuple(self._st.get_slice(k).get_shape()) for k in self._st.keys()}
        elif suffix in TORCH_SUFFIXES:
            self._sd = self._torch_load(supported, allow_unmapped)
            self.shapes = {k: tuple(v.shape) for k, v in self._sd.items()}
        else:
            raise ValueError(f"{self.path}: unsupported {what} file type {suffix!r}; supported: {supported}")

    def _torch_load(self, supported: str, allow_unmapped: bool) -> dict:
        try:
            try:
                sd = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if not (allow_unmapped and "mmap" in str(e)):
                    raise
                sd = torch.load(self.path, map_location="cpu", weights_only=True)  # legacy non-zip format
        except Exception as e:
            raise ValueError(
                f"{self.path}: could not read it as a torch state dict with "
                f"torch.load(weights_only=True, mmap=True) ({e}); supported: {supported}"
            ) from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError(
                f"{self.path}: expected a flat dict of tensors (a state dict), got {type(sd).__name__}"
            )
        return sd

    @property
    def keys(self) -> list:
        return list(self.shapes)

    def shape(self, key: str) -> tuple:
        return self.shapes[key]

    def get(self, key: str) -> torch.Tensor:
        return self._st.get_tensor(key) if self._st is not None else self._sd[key]
