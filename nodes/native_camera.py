"""The camera a LingBot conditioning node puts into CONDITIONING for the native model (shared by the node and
the model class, which imports ComfyUI's model code)."""

from dataclasses import dataclass, field

import torch

CAMERA_KEY = "lingbot_camera"  # the CONDITIONING key, and the native model's forward argument


@dataclass
class NativeCamera:
    """What a LingBot conditioning node puts under `lingbot_camera`: the pack's camera input and the video it
    drives; packed into the DiT's tensor once the model's control type (cam/act) is known."""

    camera: object  # loaders.camera_files.CameraInput
    frame_num: int
    size: tuple  # (lat_h, lat_w, h, w)
    _packed: dict = field(default_factory=dict, repr=False)

    def tensor(self, control_type: str | None) -> torch.Tensor:
        if control_type not in self._packed:
            self._packed[control_type] = self.camera.pack(control_type, self.frame_num, self.size, "cpu")[0]
        return self._packed[control_type]
