"""The input integrator (session.controls): keys and mouse -> camera-to-world poses per latent frame."""

import numpy as np
import pytest
import torch
from lingbot_world.session.controls import (
    LOOK_STEP,
    MOVE_STEP,
    RUN,
    ChunkCamera,
    Controls,
    PoseTrack,
    Slot,
    key_name,
)
from lingbot_world.wan.camera_presets import preset_intrinsics

SIZE = (6, 14, 48, 112)


def walk(track: PoseTrack, slots) -> np.ndarray:
    return track.advance(slots)


def heading(pose) -> np.ndarray:
    """The camera's forward axis flattened to the ground plane, unit length."""
    f = pose[:3, 2].copy()
    f[1] = 0.0
    return f / np.linalg.norm(f)


def test_held_w_moves_along_the_heading_and_a_look_turns_it():
    track = PoseTrack()
    first = walk(track, [Slot(frozenset({"w"}))] * 2)
    assert np.array_equal(first[0], np.eye(4))  # a rollout starts at the identity
    # W: +z (forward in OpenCV axes), 4 video frames of MOVE_STEP a latent frame, no turn
    np.testing.assert_allclose(first[1][:3, 3], [0, 0, 4 * MOVE_STEP], atol=1e-6)
    np.testing.assert_allclose(first[2][:3, 3], [0, 0, 8 * MOVE_STEP], atol=1e-6)
    np.testing.assert_allclose(first[2][:3, :3], np.eye(3), atol=1e-12)
    # right arrow for one latent frame: 4 steps of LOOK_STEP about the vertical, towards +x
    turned = walk(track, [Slot(frozenset({"right"}))])[0]
    yaw = np.arctan2(turned[0, 2], turned[2, 2])
    assert yaw == pytest.approx(4 * LOOK_STEP)
    np.testing.assert_allclose(turned[:3, 3], first[2][:3, 3], atol=1e-9)  # looking does not move
    # then W moves along the new heading
    after = walk(track, [Slot(frozenset({"w"}))])[0]
    step = after[:3, 3] - turned[:3, 3]
    np.testing.assert_allclose(step / np.linalg.norm(step), heading(turned), atol=1e-6)
    assert np.linalg.norm(step) == pytest.approx(4 * MOVE_STEP, rel=1e-5)
    # Shift runs RUN times as far; E goes up (-y), Q down
    run = walk(track, [Slot(frozenset({"w", "shift"}))])[0]
    assert np.linalg.norm(run[:3, 3] - after[:3, 3]) == pytest.approx(RUN * 4 * MOVE_STEP, rel=1e-5)
    up = walk(track, [Slot(frozenset({"e"}))])[0]
    np.testing.assert_allclose(up[:3, 3] - run[:3, 3], [0, -4 * MOVE_STEP, 0], atol=1e-9)


def test_no_input_is_a_static_camera():
    cam = ChunkCamera(SIZE, preset_intrinsics(np.ones(1), SIZE[2:]), chunk=4)
    controls = Controls("history")
    for t in (1.0, 2.0, 3.0):
        tensor, poses = cam.next(controls.slots(t, cam.slots_needed()))
        assert np.array_equal(poses, np.tile(np.eye(4), (4, 1, 1)))
    rel = cam.track.relative(0, 12)
    assert torch.equal(rel, torch.eye(4).expand(12, 4, 4))
    assert tensor.shape == (1, 384, 4, 6, 14)


def test_mouse_drag_looks_and_unknown_keys_are_ignored():
    controls = Controls("history")
    assert not controls.key("KeyZ", True, 0.1) and not controls.key("F5", True, 0.1)
    assert not controls.key(None, True, 0.1)
    assert controls.key("KeyW", True, 0.2) and controls.key("ArrowLeft", True, 0.2)
    assert [key_name(n) for n in ("ShiftLeft", "w", "ArrowUp", "j", "x")] == [
        "shift",
        "w",
        "up",
        "left",
        None,
    ]
    controls.look(10.0, -4.0, 0.3)
    slots = controls.slots(1.0, 2)
    assert slots[0].keys == {"w", "left"} and (slots[0].dx, slots[0].dy) == (10.0, -4.0)
    track = PoseTrack()
    track.advance([])
    pose = track.advance([Slot(dx=10.0)])[0]
    yaw = np.arctan2(pose[0, 2], pose[2, 2])
    assert 0 < yaw <= 4 * LOOK_STEP  # dragging right turns right, no faster than the arrows
    pitch_up = track.advance([Slot(dy=-10.0)])[0]
    assert pitch_up[1, 2] < 0  # dragging up looks up (forward gains -y)


def test_history_and_hold_place_key_edges_differently():
    """W pressed 3/4 into the window: history moves only in the last latent frame; hold from the first.
    A tap (down and up within the window) counts in its own latent frame (history) or the first (hold)."""
    for mode in ("history", "hold"):
        c = Controls(mode, t0=0.0)
        c.key("w", True, 0.8)
        c.key("d", True, 0.1)
        c.key("d", False, 0.15)
        slots = c.slots(1.0, 4)
        keys = [set(s.keys) for s in slots]
        if mode == "history":
            assert keys == [{"d"}, set(), set(), {"w"}]
        else:
            assert keys == [{"w", "d"}, {"w"}, {"w"}, {"w"}]
        # released in the second quarter of the next window: history keeps it for the first latent frame,
        # hold sees it up when the chunk starts
        c.key("w", False, 1.4)
        later = [set(s.keys) for s in c.slots(2.0, 4)]
        assert later == ([{"w"}, set(), set(), set()] if mode == "history" else [set()] * 4)
    with pytest.raises(ValueError, match="mode: expected one of history, hold"):
        Controls("toggle")


def test_events_after_the_chunk_start_wait_for_the_next_chunk():
    c = Controls("history", t0=0.0)
    c.key("s", True, 1.6)
    assert [set(s.keys) for s in c.slots(1.0, 2)] == [set(), set()]
    assert [set(s.keys) for s in c.slots(2.0, 2)] == [set(), {"s"}]
