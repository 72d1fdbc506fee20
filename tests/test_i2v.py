import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lingbot_world.wan.i2v import (
    explicit_size,
    first_frame_mask,
    frame_num_issue,
    image_to_tensor,
    latent_frames,
    latent_size,
    make_noise,
    pad_frame_num,
    resolve_seed,
    seq_len,
    vae_input,
)
from PIL import Image


def test_latent_size_matches_upstream_formula_and_quirk():
    # 480x832 at 480*832: sqrt(...) = 479.99999999999994 in float64, so upstream lands on 464x832.
    assert latent_size(480, 832, 480 * 832) == (58, 104, 464, 832)
    assert latent_size(720, 1280, 720 * 1280) == (90, 160, 720, 1280)
    assert latent_size(832, 480, 832 * 480) == (104, 60, 832, 480)  # portrait evaluates exactly
    # Aspect follows the image, area follows max_area: a 16:9 photo at the 480p budget.
    assert latent_size(1080, 1920, 480 * 832) == (58, 104, 464, 832)
    assert latent_size(1000, 1000, 720 * 1280) == (120, 120, 960, 960)
    with pytest.raises(ValueError, match="max_area"):
        latent_size(480, 832, 100)
    with pytest.raises(ValueError, match="image_w"):
        latent_size(480, 0, 480 * 832)


def test_explicit_size():
    assert explicit_size(832, 480) == (60, 104, 480, 832)
    assert explicit_size(1280, 720) == (90, 160, 720, 1280)
    for bad, name in (((830, 480), "width"), ((832.0, 480), "width"), ((832, 0), "height")):
        with pytest.raises(ValueError, match=name):
            explicit_size(*bad)
    with pytest.raises(ValueError, match="multiple of 16"):
        explicit_size(832, 472)


def test_pad_frame_num():
    assert [pad_frame_num(n) for n in (1, 2, 4, 5, 6, 45, 80, 81)] == [1, 5, 5, 5, 9, 45, 81, 81]
    with pytest.raises(ValueError, match="frame_num"):
        pad_frame_num(0)


def test_latent_frames_and_upstream_behaviour():
    assert latent_frames(81) == 21
    assert latent_frames(161) == 41
    assert latent_frames(1) == 1
    assert frame_num_issue(121) is None
    msg = frame_num_issue(80)
    assert "77" in msg and "81" in msg and "upstream" in msg
    with pytest.raises(ValueError, match="4n\\+1"):
        latent_frames(80)
    with pytest.raises(ValueError, match="frame_num"):
        latent_frames(0)
    # The claim in the message: upstream's mask construction cannot fold F+3 frames into groups of 4.
    msk = torch.ones(1, 80 + 3, 2, 2)
    with pytest.raises(RuntimeError):
        msk.view(1, msk.shape[1] // 4, 4, 2, 2)


def test_seq_len():
    assert seq_len(21, 60, 104) == 32760
    assert seq_len(21, 58, 104) == 31668
    assert seq_len(41, 60, 104) == 63960
    assert seq_len(21, 90, 160) == 75600
    assert seq_len(1, 2, 6, sp_size=4) == 4  # 3 tokens rounded up to the SP size


def test_first_frame_mask():
    m = first_frame_mask(81, 58, 104, "cpu")
    assert m.shape == (4, 21, 58, 104) and m.dtype == torch.float32
    assert bool((m[:, 0] == 1).all()) and bool((m[:, 1:] == 0).all())
    assert first_frame_mask(1, 2, 3).shape == (4, 1, 2, 3)
    assert bool((first_frame_mask(1, 2, 3) == 1).all())
    with pytest.raises(ValueError, match="frame_num"):
        first_frame_mask(10, 2, 2)


def test_noise_is_seeded_like_upstream():
    a = make_noise(42, 3, 4, 6, "cpu")
    assert a.shape == (16, 3, 4, 6) and a.dtype == torch.float32
    assert torch.equal(a, make_noise(42, 3, 4, 6))
    assert not torch.equal(a, make_noise(43, 3, 4, 6))
    g = torch.Generator(device="cpu").manual_seed(42)
    assert torch.equal(a, torch.randn(16, 3, 4, 6, generator=g))
    with pytest.raises(ValueError, match="seed"):
        make_noise(-1, 1, 2, 2)
    assert resolve_seed(7) == 7
    assert resolve_seed(-1) >= 0


def test_vae_input():
    img = torch.rand(3, 30, 50) * 2 - 1
    v = vae_input(img, 9, 16, 32)
    assert v.shape == (3, 9, 16, 32) and v.dtype == torch.float32
    assert torch.equal(v[:, 0], F.interpolate(img[None], size=(16, 32), mode="bicubic")[0])
    assert bool((v[:, 1:] == 0).all())
    torch.testing.assert_close(vae_input(img, 1, 30, 50)[:, 0], img)  # same size: bicubic is the identity
    with pytest.raises(ValueError, match="image"):
        vae_input(torch.zeros(1, 8, 8), 5, 8, 8)
    with pytest.raises(ValueError, match="frame_num"):
        vae_input(img, 4, 16, 16)


def test_image_to_tensor():
    arr = np.zeros((17, 20, 3), dtype=np.uint8)
    arr[..., 0] = 255
    arr[3, 5] = (0, 128, 7)
    t = image_to_tensor(Image.fromarray(arr))
    assert t.shape == (3, 17, 20) and t.dtype == torch.float32
    expected = (torch.from_numpy(arr).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
    assert torch.equal(t, expected)
    assert t[0, 0, 0] == 1 and t[1, 0, 0] == -1
    assert t[1, 3, 5] == np.float32((np.float32(128) / np.float32(255) - np.float32(0.5)) / np.float32(0.5))
    grey = image_to_tensor(Image.fromarray(np.full((16, 16), 255, np.uint8), mode="L"))
    assert grey.shape == (3, 16, 16) and bool((grey == 1).all())
    rgba = image_to_tensor(Image.new("RGBA", (16, 16), (10, 20, 30, 0)))
    assert torch.equal(rgba[:, 0, 0], (torch.tensor([10.0, 20.0, 30.0]) / 255 - 0.5) / 0.5)
    with pytest.raises(ValueError, match="image must be at least 16x16"):
        image_to_tensor(Image.new("RGB", (15, 40)))
    with pytest.raises(ValueError, match="PIL image"):
        image_to_tensor(arr)
