import numpy as np
import pytest
import torch
from lingbot_world.loaders.camera_files import load_camera_dir
from lingbot_world.wan.camera import (
    camera_conditioning,
    interpolate_poses,
    pack_pixels,
    pixel_directions,
    ray_field,
    relative_poses,
    scale_intrinsics,
    used_frame_count,
)
from scipy.spatial.transform import Rotation

K480 = np.array([[502.9116, 503.10812, 415.77786, 239.77779]], dtype=np.float32)  # example 00


def poses_from(rots, trans) -> np.ndarray:
    p = np.tile(np.eye(4, dtype=np.float32), (len(trans), 1, 1))
    p[:, :3, :3] = rots
    p[:, :3, 3] = trans
    return p


def unpack(cam: torch.Tensor, c: int, f: int, y: int, x: int) -> float:
    """Value of field channel c at pixel (y, x) of latent frame f in a packed [1, C, F, h, w] tensor."""
    return cam[0, c * 64 + (y % 8) * 8 + (x % 8), f, y // 8, x // 8].float().item()


def test_identity_poses_give_zero_origins_and_pixel_directions():
    h, w = 32, 48
    K = np.array([[40.0, 50.0, 20.0, 15.0]], dtype=np.float32)
    cam, F = camera_conditioning(np.tile(np.eye(4), (9, 1, 1)), K, 9, h, w, 4, 6, dtype=torch.float32)
    assert F == 9 and cam.shape == (1, 384, 3, 4, 6)
    sx, sy = w / 832, h / 480  # intrinsics are given at 480x832
    fx, fy, cx, cy = 40.0 * sx, 50.0 * sy, 20.0 * sx, 15.0 * sy
    for y, x in [(0, 0), (h - 1, w - 1), (13, 29)]:
        d = np.array([(x + 0.5 - cx) / fx, (y + 0.5 - cy) / fy, 1.0])
        d /= np.linalg.norm(d)
        for f in range(3):
            got = [unpack(cam, c, f, y, x) for c in range(6)]
            np.testing.assert_allclose(got[:3], 0.0, atol=0)
            np.testing.assert_allclose(got[3:], d, rtol=1e-5, atol=1e-6)


def test_pure_translation_along_z_gives_unit_z_steps():
    trans = np.zeros((17, 3))
    trans[:, 2] = 0.37 * np.arange(17)
    rel = relative_poses(interpolate_poses(poses_from(np.eye(3), trans), 5))
    assert torch.equal(rel[0], torch.eye(4))
    np.testing.assert_allclose(rel[1:, :3, 3].numpy(), np.tile([0.0, 0.0, 1.0], (4, 1)), atol=1e-6)
    np.testing.assert_allclose(rel[1:, :3, :3].numpy(), np.tile(np.eye(3), (4, 1, 1)), atol=1e-6)
    # the same through the whole pipeline: rays_o channel z is 1 after frame 0
    cam, _ = camera_conditioning(poses_from(np.eye(3), trans), K480, 17, 16, 16, 2, 2, dtype=torch.float32)
    assert unpack(cam, 2, 0, 5, 5) == 0.0
    assert unpack(cam, 2, 3, 5, 5) == pytest.approx(1.0, abs=1e-6)


def test_translation_normalised_by_largest_step():
    trans = np.zeros((9, 3))
    trans[4:, 0] = [2.0, 2.0, 2.0, 2.0, 6.0]  # latent steps: 2 then 4 along x
    rel = relative_poses(interpolate_poses(poses_from(np.eye(3), trans), 3))
    np.testing.assert_allclose(rel[:, :3, 3].numpy(), [[0, 0, 0], [0.5, 0, 0], [1, 0, 0]], atol=1e-6)


def test_pure_yaw_gives_per_latent_step_rotation():
    deg = 1.5
    rots = Rotation.from_rotvec(np.outer(np.deg2rad(deg * np.arange(21)), [0, 1, 0])).as_matrix()
    rel = relative_poses(interpolate_poses(poses_from(rots, np.zeros((21, 3))), 6))
    rv = Rotation.from_matrix(rel[1:, :3, :3].double().numpy()).as_rotvec(degrees=True)
    np.testing.assert_allclose(rv, np.tile([0.0, 4 * deg, 0.0], (5, 1)), atol=1e-4)
    assert torch.count_nonzero(rel[:, :3, 3]) == 0  # no translation, no normalisation


def test_slerp_interpolates_between_frames():
    # as for act2cam's 4n+2 poses, targets can fall between frames: linspace(0, 5, 3) = 0, 2.5, 5
    rots = Rotation.from_rotvec(np.outer(np.deg2rad(10.0 * np.arange(6)), [0, 1, 0])).as_matrix()
    out = interpolate_poses(poses_from(rots, np.arange(18).reshape(6, 3)), 3)  # frames 0, 2.5, 5
    ang = Rotation.from_matrix(out[:, :3, :3].double().numpy()).as_euler("yxz", degrees=True)[:, 0]
    np.testing.assert_allclose(ang, [0.0, 25.0, 50.0], atol=1e-4)
    np.testing.assert_allclose(out[1, :3, 3].numpy(), [7.5, 8.5, 9.5], atol=1e-5)


def test_intrinsics_rescaling_480p_quirk_and_720p():
    Ks = torch.from_numpy(K480)
    h480 = int(np.sqrt(480 * 832 * (480 / 832)) // 8 // 2 * 2 * 8)  # upstream's float64 sizing: 464
    assert h480 == 464
    got = scale_intrinsics(Ks, 464, 832)[0].numpy()
    np.testing.assert_allclose(got, K480[0] * [1, 464 / 480, 1, 464 / 480], rtol=1e-6)
    got = scale_intrinsics(Ks, 720, 1280)[0].numpy()
    np.testing.assert_allclose(got, K480[0] * [1280 / 832, 1.5, 1280 / 832, 1.5], rtol=1e-6)


def test_only_intrinsics_row_zero_is_used():
    poses = np.tile(np.eye(4), (5, 1, 1))
    other = np.concatenate([K480, np.tile([[900.0, 900.0, 10.0, 10.0]], (4, 1))]).astype(np.float32)
    a, _ = camera_conditioning(poses, K480, 5, 16, 32, 2, 4)
    b, _ = camera_conditioning(poses, other, 5, 16, 32, 2, 4)
    assert torch.equal(a, b)


def test_packing_order_on_hand_built_field():
    f, h, w, c = 2, 16, 24, 6
    field = torch.arange(f * h * w * c, dtype=torch.float32).view(f, h, w, c)
    packed = pack_pixels(field, 2, 3)
    assert packed.shape == (1, c * 64, f, 2, 3)
    for fi, y, x, ci in [(0, 0, 0, 0), (1, 15, 23, 5), (0, 9, 3, 2), (1, 7, 16, 4)]:
        ch = ci * 64 + (y % 8) * 8 + (x % 8)
        assert packed[0, ch, fi, y // 8, x // 8] == field[fi, y, x, ci]


def test_ray_field_rotates_directions_and_broadcasts_origin():
    R = torch.tensor(Rotation.from_euler("x", 30, degrees=True).as_matrix(), dtype=torch.float32)
    c2w = torch.eye(4)[None].clone()
    c2w[0, :3, :3] = R
    c2w[0, :3, 3] = torch.tensor([1.0, -2.0, 3.0])
    dirs = pixel_directions(torch.tensor([10.0, 10.0, 4.0, 4.0]), 8, 8)
    field = ray_field(c2w, dirs, 8, 8)
    d = torch.tensor([0.5 - 4.0, 7.5 - 4.0, 10.0]) / 10  # pixel (row 7, col 0)
    assert torch.allclose(dirs[7 * 8 + 0], d / d.norm(), atol=1e-6)
    assert torch.allclose(field[0, 7, 0, 3:], R @ (d / d.norm()), atol=1e-6)
    assert torch.equal(field[0, 3, 5, :3], torch.tensor([1.0, -2.0, 3.0]))
    assert torch.equal(ray_field(c2w, dirs, 8, 8, only_rays_d=True), field[..., 3:])


def test_all_examples_cam(all_examples):
    for i, ex in enumerate(all_examples):
        poses, K = np.load(ex / "poses.npy"), np.load(ex / "intrinsics.npy")
        h, w = (464, 832) if i == 0 else (64, 96)  # one real size, the rest small to stay fast
        cam, F = camera_conditioning(poses, K, 81, h, w, h // 8, w // 8)
        assert F == 81, ex
        assert cam.shape == (1, 384, 21, h // 8, w // 8) and cam.dtype == torch.bfloat16, ex
        assert torch.isfinite(cam.float()).all(), ex
        # relative pose of frame 0 is the identity: zero origins
        assert cam[0, :192, 0].abs().max() == 0, ex


def test_truncation_to_4n_plus_1_prefix(all_examples):
    assert (
        used_frame_count(269, 961) == 269
        and used_frame_count(10, 81) == 9
        and used_frame_count(961, 81) == 81
    )
    ex03 = [e for e in all_examples if e.name == "03"]
    poses = np.load(ex03[0] / "poses.npy") if ex03 else np.tile(np.eye(4), (269, 1, 1))
    cam, F = camera_conditioning(poses, K480, 961, 16, 16, 2, 2)
    assert len(poses) == 269 and F == 269 and cam.shape[2] == 68
    cam, F = camera_conditioning(np.tile(np.eye(4), (10, 1, 1)), K480, 81, 16, 16, 2, 2)
    assert F == 9 and cam.shape[2] == 3


def test_act_packing_rays_d_then_wasd(shipped_example):
    poses, K = np.load(shipped_example / "poses.npy"), np.load(shipped_example / "intrinsics.npy")
    action = np.load(shipped_example / "action.npy")
    act, F = camera_conditioning(poses, K, 81, 32, 48, 4, 6, control_type="act", actions=action)
    cam, _ = camera_conditioning(poses, K, 81, 32, 48, 4, 6, actions=action)  # ignored for 'cam'
    assert F == 81 and act.shape == (1, 448, 21, 4, 6)
    assert torch.equal(act[:, :192], cam[:, 192:])  # rays_d block of the cam tensor
    wasd = torch.from_numpy(action[:81:4]).float()  # [21, 4]
    for k in range(4):
        expect = wasd[:, k].to(torch.bfloat16)[None, :, None, None].expand(64, 21, 4, 6)
        assert torch.equal(act[0, 192 + 64 * k : 256 + 64 * k], expect)
    assert wasd.sum() > 0  # the example actually presses keys


def test_act2cam_keeps_all_poses():
    poses = np.tile(np.eye(4), (14, 1, 1))  # 13 frames + the start pose
    cam, F = camera_conditioning(poses, K480, 13, 16, 16, 2, 2, act2cam=True)
    assert F == 13 and cam.shape == (1, 384, 4, 2, 2)
    with pytest.raises(ValueError, match="poses: act2cam expects frame_num \\+ 1 = 14"):
        camera_conditioning(poses[:13], K480, 13, 16, 16, 2, 2, act2cam=True)


# ---- bad input: each error names the array and what was expected --------------------------------

EYE = np.tile(np.eye(4, dtype=np.float32), (9, 1, 1))


def _with(**kw):
    args = dict(poses=EYE, intrinsics=K480, frame_num=9, height=16, width=16, lat_h=2, lat_w=2)
    args.update(kw)
    return args


def _poses(fn):
    p = EYE.copy()
    fn(p)
    return p


BAD = {
    "poses_ndim": (_with(poses=EYE[0]), r"poses: expected of shape \[N, 4, 4\]"),
    "poses_shape": (_with(poses=EYE[:, :3]), r"poses: expected of shape \[N, 4, 4\].*\[9, 3, 4\]"),
    "poses_nan": (_with(poses=_poses(lambda p: p.__setitem__((3, 0, 3), np.nan))), "poses: expected finite"),
    "poses_inf": (_with(poses=_poses(lambda p: p.__setitem__((3, 1, 3), np.inf))), "poses: expected finite"),
    "poses_not_rigid": (
        _with(poses=_poses(lambda p: p.__setitem__((2, 0, 0), 1.1))),
        "poses: expected rotation",
    ),
    "poses_reflection": (_with(poses=_poses(lambda p: p.__setitem__((2, 0, 0), -1.0))), r"pose 2 .*det = -1"),
    "poses_bottom_row": (
        _with(poses=_poses(lambda p: p.__setitem__((4, 3, 0), 0.5))),
        "poses: expected bottom row",
    ),
    "poses_too_few": (_with(poses=EYE[:4], frame_num=1), "poses: expected at least 5 poses, got 4"),
    "poses_strings": (_with(poses=EYE.astype(str)), "poses: expected a real numeric array"),
    "intrinsics_shape": (_with(intrinsics=K480[0]), r"intrinsics: expected of shape \[N, 4\]"),
    "intrinsics_no_rows": (_with(intrinsics=np.zeros((0, 4))), "intrinsics: expected at least 1 row"),
    "intrinsics_zero_focal": (_with(intrinsics=K480 * [0, 1, 1, 1]), "intrinsics: expected focal lengths"),
    "intrinsics_negative_focal": (
        _with(intrinsics=K480 * [1, -1, 1, 1]),
        "intrinsics: expected focal lengths",
    ),
    "intrinsics_nan": (_with(intrinsics=K480 * [1, 1, np.nan, 1]), "intrinsics: expected finite"),
    "actions_missing": (_with(control_type="act"), "actions: control_type 'act' needs"),
    "actions_shape": (
        _with(control_type="act", actions=np.zeros((9, 3))),
        r"actions: expected of shape \[N, 4\]",
    ),
    "actions_too_short": (
        _with(control_type="act", actions=np.zeros((8, 4))),
        "actions: expected at least 9 rows",
    ),
    "height_not_8x": (_with(height=24), "height/width: expected height = 8\\*lat_h"),
    "lat_w_odd": (_with(width=24, lat_w=3), "height/width: .*multiples of 2"),
    "frame_num_not_4n1": (_with(frame_num=8), "frame_num: expected a positive integer of the form 4n\\+1"),
    "control_type": (_with(control_type="xyz"), "control_type: expected one of"),
    "act2cam_with_act": (
        _with(poses=EYE, frame_num=5, act2cam=True, control_type="act", actions=np.zeros((9, 4))),
        "control_type: act2cam poses drive the 'cam' model only",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input(case):
    kwargs, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        camera_conditioning(**kwargs)


# ---- loader ----------------------------------------------------------------------------------


def test_load_camera_dir(shipped_example, tmp_path):
    d = load_camera_dir(shipped_example)
    assert d["poses"].shape == (961, 4, 4) and d["intrinsics"].shape == (961, 4)
    assert d["action"].shape == d["wasd"].shape == d["ijkl"].shape == (961, 4)
    np.save(tmp_path / "intrinsics.npy", K480)
    assert set(load_camera_dir(tmp_path, require_poses=False)) == {"intrinsics"}
    with pytest.raises(FileNotFoundError, match="poses.npy: file not found"):
        load_camera_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="camera folder not found"):
        load_camera_dir(tmp_path / "nope")


def test_load_camera_dir_bad_files(tmp_path):
    np.save(tmp_path / "intrinsics.npy", K480)
    np.save(tmp_path / "poses.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"poses\.npy: not a plain numeric \.npy array"):
        load_camera_dir(tmp_path)
    np.save(tmp_path / "poses.npy", np.zeros((9, 3, 3)))
    with pytest.raises(ValueError, match=r"poses\.npy: expected of shape \[N, 4, 4\]"):
        load_camera_dir(tmp_path)
    np.save(tmp_path / "poses.npy", EYE)
    (tmp_path / "wasd_action.npy").write_bytes(b"not an npy file")
    with pytest.raises(ValueError, match=r"wasd_action\.npy: "):
        load_camera_dir(tmp_path)
    np.save(tmp_path / "wasd_action.npy", np.zeros((9, 5)))
    with pytest.raises(ValueError, match=r"wasd_action\.npy: expected of shape \[N, 4\]"):
        load_camera_dir(tmp_path)
