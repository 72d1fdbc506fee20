import numpy as np
import pytest
import torch
from lingbot_world.wan.actions import (
    MOVE_STEP,
    act2cam_trajectory,
    actions_to_poses,
    parse_action_string,
)
from lingbot_world.wan.camera import camera_conditioning, validate_poses
from scipy.spatial.transform import Rotation

STEP = MOVE_STEP / (1 + 1e-6)  # upstream divides the flattened direction by (norm + 1e-6)


def poses_for(s: str) -> np.ndarray:
    wasd, ijkl = parse_action_string(s)
    return actions_to_poses(wasd, ijkl)


def yaw_deg(R: np.ndarray) -> float:
    """Heading of the camera's forward axis in the x-z plane, degrees, + towards +x (right)."""
    return float(np.degrees(np.arctan2(R[0, 2], R[2, 2])))


def test_forward_moves_along_plus_z():
    poses = poses_for("w-4")
    assert poses.shape == (5, 4, 4) and poses.dtype == np.float64
    np.testing.assert_array_equal(poses[0], np.eye(4))
    np.testing.assert_allclose(poses[:, :3, 3], [[0, 0, STEP * k] for k in range(5)], atol=1e-12)
    np.testing.assert_allclose(poses[:, :3, :3], np.tile(np.eye(3), (5, 1, 1)), atol=1e-12)
    validate_poses(poses)  # rigid, bottom row [0, 0, 0, 1]


@pytest.mark.parametrize(("keys", "axis", "sign"), [("s", 2, -1), ("d", 0, 1), ("a", 0, -1)])
def test_other_moves(keys, axis, sign):
    pos = poses_for(f"{keys}-3")[3, :3, 3]
    expect = np.zeros(3)
    expect[axis] = sign * 3 * STEP
    np.testing.assert_allclose(pos, expect, atol=1e-12)


def test_yaw_two_degrees_per_frame():
    poses = poses_for("l-5,j-2")
    headings = [yaw_deg(p[:3, :3]) for p in poses]
    np.testing.assert_allclose(headings, [0, 2, 4, 6, 8, 10, 8, 6], atol=1e-9)
    rv = Rotation.from_matrix(poses[5, :3, :3]).as_rotvec(degrees=True)
    np.testing.assert_allclose(rv, [0, 10, 0], atol=1e-9)  # about world y, no roll or pitch
    assert np.all(poses[:, :3, 3] == 0)


def test_move_follows_heading_in_xz_plane():
    poses = poses_for("l-45,w-2")  # turn 90 deg right, then forward is world +x
    np.testing.assert_allclose(poses[-1, :3, 3], [2 * STEP, 0, 0], atol=1e-9)
    poses = poses_for("i-10,w-1")  # looking up 20 deg: the step stays horizontal, full length
    np.testing.assert_allclose(poses[-1, :3, 3], [0, 0, STEP], atol=1e-8)


def test_pitch_up_and_clamp():
    poses = poses_for("i-50")
    fwd = poses[:, :3, 2]
    assert fwd[1, 1] < 0  # i looks up: forward gains -y (OpenCV y points down)
    pitch = np.degrees(np.arcsin(-fwd[:, 1]))
    np.testing.assert_allclose(pitch[:43], 2.0 * np.arange(43), atol=1e-9)
    np.testing.assert_allclose(pitch[43:], 84.0, atol=1e-9)  # an 86-deg step is dropped
    assert pitch.max() <= 85.0
    down = np.degrees(np.arcsin(-poses_for("i-50,k-100")[:, 1, 2]))
    assert down.min() == pytest.approx(-84.0) and down[-1] == pytest.approx(-84.0)


def test_parse_action_string():
    wasd, ijkl = parse_action_string(" W-2 ， ij-1,none-2,-1")
    np.testing.assert_array_equal(wasd, [[1, 0, 0, 0]] * 2 + [[0, 0, 0, 0]] * 4)
    np.testing.assert_array_equal(ijkl, [[0, 0, 0, 0]] * 2 + [[1, 1, 0, 0]] + [[0, 0, 0, 0]] * 3)
    assert wasd.dtype == ijkl.dtype == np.float32


@pytest.mark.parametrize(
    ("s", "message"),
    [
        ("x-3", r"unknown key\(s\) \['x'\] in segment 'x-3'"),
        ("wq-3", r"unknown key\(s\) \['q'\]"),
        ("w-0", "frame count '0'; expected a positive integer"),
        ("w-abc", "frame count 'abc'"),
        ("w-1.5", "frame count '1.5'"),
        ("w3", "segment 'w3' is not <keys>-<frames>"),
        ("w-3,,a-2", "empty segment"),
        ("  ", "action_string: empty"),
    ],
)
def test_parse_errors(s, message):
    with pytest.raises(ValueError, match=message):
        parse_action_string(s)


def test_act2cam_string_padding_and_conditioning():
    traj = act2cam_trajectory("w-4,l-6")  # 10 frames -> 13
    assert traj.frame_num == 13 and traj.poses.shape == (14, 4, 4)
    assert traj.wasd.shape == traj.ijkl.shape == (13, 4)
    assert traj.wasd[10:].sum() == 0 and traj.ijkl[10:].sum() == 0
    np.testing.assert_array_equal(traj.poses[10:], np.repeat(traj.poses[10:11], 4, axis=0))  # idle tail
    cam, F = camera_conditioning(
        traj.poses, np.array([[500.0, 500, 416, 240]]), 13, 32, 32, 4, 4, act2cam=True
    )
    assert F == 13 and cam.shape == (1, 384, 4, 4, 4) and torch.isfinite(cam.float()).all()
    with pytest.raises(ValueError, match=r"frame_num: 9 must equal .* padded to 4n\+1 \(13\)"):
        act2cam_trajectory("w-4,l-6", frame_num=9)


def test_act2cam_from_example_files(shipped_example):
    wasd = np.load(shipped_example / "wasd_action.npy")
    ijkl = np.load(shipped_example / "ijkl_action.npy")
    traj = act2cam_trajectory(wasd=wasd, ijkl=ijkl)
    assert traj.frame_num == 81 and traj.poses.shape == (82, 4, 4)
    np.testing.assert_array_equal(traj.wasd, wasd[:81])
    assert np.abs(traj.poses[-1, :3, 3]).max() > 0  # the example moves
    traj = act2cam_trajectory(wasd=wasd[:21], frame_num=21)  # no ijkl file (examples 03/04)
    assert traj.ijkl.sum() == 0 and traj.poses.shape == (22, 4, 4)
    with pytest.raises(ValueError, match="wasd: expected at least 81 rows"):
        act2cam_trajectory(wasd=wasd[:50])
    with pytest.raises(ValueError, match=r"ijkl: expected of shape \[N, 4\]"):
        act2cam_trajectory(wasd=wasd, ijkl=ijkl[:, :3])
    with pytest.raises(ValueError, match="frame_num: expected a positive integer of the form 4n\\+1"):
        act2cam_trajectory(wasd=wasd, frame_num=80)


def test_actions_to_poses_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="ijkl: expected as many rows as wasd"):
        actions_to_poses(np.zeros((5, 4)), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="wasd: expected finite"):
        actions_to_poses(np.full((5, 4), np.nan))
