"""The second bad-input sweep (issue 23), items about bounds, sizes and files: a Fast clip bounded by its RoPE
table and streamed into the MP4, VAE tiles smaller than their overlap, an image whose header claims
gigapixels, a full disk under --save_latent and --report, and the text encoder's folder left by a SIGKILL.
Each ends in one `error:` line naming the flag or file, exit 2, with nothing left behind."""

import errno
import functools
import gc
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
import zlib
from pathlib import Path

import psutil
import pytest
import torch
from helpers import _gone, args_for, expect_clear_error, fast_args
from lingbot_world import cli
from lingbot_world.loaders import text_encode as tx
from lingbot_world.loaders.checkpoints import resolve_checkpoint_dir
from lingbot_world.loaders.fast_checkpoint import resolve_fast_dir
from lingbot_world.loaders.video import Mp4Writer, read_mp4_info, write_mp4
from lingbot_world.session import fast_run
from lingbot_world.session import planner as memplan
from lingbot_world.wan.config import A14B
from lingbot_world.wan.fast import MAX_FRAME_NUM, FastConfig, fast_frame_num, fast_latent_frames
from lingbot_world.wan.pipeline import frames_to_uint8

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "00"
pytestmark = pytest.mark.usefixtures("embedding_cache")


# ------------------------------------------------------------------------- 1: a Fast clip's length


@pytest.mark.parametrize("keys", [[], ["--keys", "-"]], ids=["whole-clip", "keys-stdin"])
@pytest.mark.usefixtures("nothing_loads")
def test_fast_frame_num_is_bounded_by_the_rope_table(fast_ckpt, tmp_path, capsys, keys):
    out = tmp_path / "o.mp4"
    args = fast_args(fast_ckpt, EXAMPLE, out, "--frame_num", "100001", *keys)
    err = expect_clear_error(capsys, args, out, "--frame_num", f"at most {MAX_FRAME_NUM} frames", "100001")
    assert len(err.strip().splitlines()) == 1, err


def test_the_bound_is_whole_chunks_within_the_table():
    assert MAX_FRAME_NUM == 4089 and fast_latent_frames(MAX_FRAME_NUM) == 1023
    assert fast_frame_num(4100) == MAX_FRAME_NUM  # rounded down to whole chunks, as any count
    with pytest.raises(ValueError, match="at most 4089 frames"):
        fast_latent_frames(4101)


def test_fast_help_says_what_holds(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fast", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        f"at most {MAX_FRAME_NUM} frames" in text and "RAM holds one chunk's frames, not the clip's" in text
    )


def test_fast_frames_go_into_the_mp4_as_they_come(tmp_path):
    """The sink hands each chunk to the writer and keeps none of them; the streamed MP4 is the file
    write_mp4 makes from all the frames at once."""
    chunks = [torch.linspace(-1, 1, 3 * n * 48 * 64).reshape(3, n, 48, 64) for n in (9, 12, 12)]
    given = []

    class Spy(Mp4Writer):
        def add(self, frames):
            given.append(weakref.ref(frames))
            super().add(frames)

    sink = fast_run.FrameSink(writer=Spy(tmp_path / "streamed.mp4"))
    for chunk in chunks:
        sink.add(chunk)
    gc.collect()
    assert sink.count == 33 and len(given) == 3 and all(ref() is None for ref in given)
    sink.writer.close()
    write_mp4(torch.cat([frames_to_uint8(c) for c in chunks]), tmp_path / "whole.mp4")
    assert (tmp_path / "streamed.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["streamed.mp4", "whole.mp4"]


def test_fast_memory_counts_what_grows_with_the_clip(fast_ckpt):
    """The prediction holds the condition and the first-frame encode's video, which grow with the clip, and
    the host RAM; a host without that RAM gets a message saying so."""
    files = resolve_fast_dir(fast_ckpt)
    short, long = (
        fast_run.fast_memory(files, (f, 60, 104), FastConfig(), None, 0, "auto") for f in (21, 1023)
    )
    assert long.condition > 40 * short.condition and long.encode > 25 * (1 << 30) > 5 * short.encode
    assert long.ram > 10 * (1 << 30) > short.ram and long.peak >= long.encode
    check = functools.partial(fast_run.fast_fit_issue, files, (1023, 60, 104), FastConfig(), None, 0)
    assert check(None, "auto", free_ram=long.ram) is None
    issue = check(None, "auto", free_ram=long.ram - 1)
    assert "host RAM" in issue and "4089 frames" in issue and "fewer frames" in issue


@pytest.mark.slow
def test_a_long_stream_holds_constant_ram(tmp_path):
    """2,400 frames through the sink into the MP4: anonymous RSS after the last chunk within 30 MB of where
    it was after the 20th (keeping them would add 110 MB)."""
    from lingbot_world.loaders.monitor import rss_anon, trim_heap

    chunk = torch.linspace(-1, 1, 3 * 12 * 96 * 160).reshape(3, 12, 96, 160)
    sink = fast_run.FrameSink(writer=Mp4Writer(tmp_path / "long.mp4"))
    for k in range(200):
        sink.add(chunk)
        if k == 19:
            trim_heap()
            start = rss_anon()
    trim_heap()
    assert rss_anon() - start < 30 * (1 << 20), (start, rss_anon())
    sink.writer.close()
    assert read_mp4_info(tmp_path / "long.mp4")["frames"] == 2400


# ------------------------------------------------------------------------- 2: VAE tiles


def _with_tile(command, ckpt, out, tile):
    if command == "fast":
        return fast_args(ckpt, EXAMPLE, out, "--vae_tile", tile)
    return [command, *args_for(ckpt, EXAMPLE, out, "--vae_tile", tile)[1:]]


@pytest.mark.parametrize(
    "command, tile", [("plan", "0,0"), ("generate", "1,1"), ("generate", "16,40"), ("fast", "1,1")]
)
@pytest.mark.usefixtures("nothing_loads")
def test_vae_tile_smaller_than_its_overlap_is_refused(command, tile, request, tmp_path, capsys):
    ckpt = request.getfixturevalue("fast_ckpt" if command == "fast" else "nf4_ckpt")
    out = tmp_path / "o.mp4"
    err = expect_clear_error(capsys, _with_tile(command, ckpt, out, tile), out, "--vae_tile", repr(tile))
    assert "more than the 16" in err and "ZeroDivision" not in err


def test_planner_refuses_a_tile_of_its_own():
    with pytest.raises(memplan.RequestError, match="more than the 16") as err:
        memplan.MemoryRequest({"high": 1, "low": 1}, vae_tile=(0, 0))
    assert err.value.param == "vae_tile" and cli.FLAGS[err.value.param] == "--vae_tile"
    plan = memplan.Planner(
        A14B, (60, 104, 480, 832), 81, memplan.MemoryRequest({"high": 1, "low": 1}, vae_tile=(17, 17))
    )
    assert plan.plan().vae_tile == (17, 17)  # the smallest tile allowed plans without an error


# ------------------------------------------------------------------------- 3: image size


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height, with a few bytes of pixel data (never decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body)
    return path


@pytest.mark.parametrize("side", [30000, 12000])
@pytest.mark.usefixtures("nothing_loads")
def test_an_image_too_large_by_its_header_is_refused(side, nf4_ckpt, tmp_path, capsys):
    image = png_claiming(tmp_path / "huge.png", side, side)
    args = args_for(nf4_ckpt, EXAMPLE, tmp_path / "o.mp4")
    args[args.index("--image") + 1] = str(image)
    err = expect_clear_error(capsys, args, tmp_path / "o.mp4", f"--image: {image}", "89,478,485 pixels")
    assert "Warning" not in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------- 4, 13: a full disk


def disk_full_for(monkeypatch, target: Path) -> None:
    """The write of `target` (its temporary file beside it) fails as on a full disk: half the data lands,
    then ENOSPC."""
    real = Path.write_bytes

    def write_bytes(self, data):
        if self.parent == target.parent and self.name.startswith(f".{target.name}."):
            real(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)


def _tiny_run(ckpt, out, *extra):
    extra = ("--frame_num", "5", "--sampling_steps", "1", "--t5_mode", "inprocess", *extra)
    return args_for(ckpt, EXAMPLE, out, *extra)


def test_save_latent_onto_a_full_disk(nf4_ckpt, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    out, latent = folder / "o.mp4", folder / "o.latent"
    disk_full_for(monkeypatch, latent)
    assert cli.main(_tiny_run(nf4_ckpt, out, "--save_latent", str(latent))) == 2
    err = capsys.readouterr().err  # the denoise's progress bar, then the error
    assert err.strip().splitlines()[-1] == f"error: {latent} could not be written: No space left on device"
    assert "Traceback" not in err and "partial" not in err
    assert list(folder.iterdir()) == []  # no latent, no temporary, and the MP4 comes after the latent


def test_report_onto_a_full_disk(nf4_ckpt, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    out, report, latent = folder / "o.mp4", folder / "report.json", folder / "o.latent"
    disk_full_for(monkeypatch, report)
    assert cli.main(_tiny_run(nf4_ckpt, out, "--report", str(report), "--save_latent", str(latent))) == 2
    captured = capsys.readouterr()
    assert (
        captured.err.strip().splitlines()[-1]
        == f"error: {report} could not be written: No space left on device"
    )
    assert f"wrote {out}" in captured.out  # the video was written before the report
    assert sorted(p.name for p in folder.iterdir()) == ["o.latent", "o.mp4"]  # no report, empty or partial


def test_mp4_onto_a_full_disk_names_the_file(tmp_path, monkeypatch):
    import av

    real, calls = av.VideoFrame.from_ndarray, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", full)
    frames = torch.zeros(9, 48, 64, 3, dtype=torch.uint8)
    with pytest.raises(OSError, match=f"^{tmp_path / 'v.mp4'} could not be written: No space left"):
        write_mp4(frames, tmp_path / "v.mp4")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- 14: the text encoder's folder


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock and /proc start times as on Linux")
def test_sweep_deletes_only_folders_whose_owner_is_gone(tmp_path):
    dead = _dead_pid()
    me = os.getpid()
    folders = {
        "live": f"{me}_a",  # this process: running, its lock free for a moment (setting up)
        "gone": f"{dead}_b",  # its process ended, lock free
        "held": f"{dead}_c",  # no such pid here, but its lock is held (an owner in another pid namespace)
        "reused": f"{me}_d",  # this pid, but the folder is older than this process: a reused pid
    }
    folders = {k: tmp_path / f"{tx.WORK_PREFIX}{v}" for k, v in folders.items()}
    for folder in folders.values():
        folder.mkdir()
        (folder / tx.LOCK_NAME).touch()
    past = psutil.Process().create_time() - 3600
    os.utime(folders["reused"], (past, past))
    lock = tx._lock(folders["held"] / tx.LOCK_NAME)
    try:
        swept = tx.sweep_stale_work_dirs(tmp_path)
    finally:
        lock.close()
    assert sorted(swept) == sorted([folders["gone"], folders["reused"]])
    assert folders["live"].is_dir() and folders["held"].is_dir()


def test_sweep_leaves_other_users_folders(tmp_path):
    """A shared /tmp: another user's folder (its owner gone or not) is neither read nor deleted, and the
    sweep goes on (its 0700 lock would otherwise stop every encode with a PermissionError)."""
    other = tmp_path / f"{tx.WORK_PREFIX}{_dead_pid()}_x"
    other.mkdir()
    (other / tx.LOCK_NAME).touch()
    mine = tmp_path / f"{tx.WORK_PREFIX}{_dead_pid()}_y"
    mine.mkdir()
    (mine / tx.LOCK_NAME).touch()
    real_stat = Path.stat

    def stat(self, *a, **k):  # `other` belongs to uid+1 (chown needs root: faked here)
        st = real_stat(self, *a, **k)
        if self == other:
            return os.stat_result((*st[:4], os.getuid() + 1, *st[5:]))
        return st

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "stat", stat)
        swept = tx.sweep_stale_work_dirs(tmp_path)
    assert swept == [mine] and other.is_dir() and not mine.exists()


def _is_encoder(proc: psutil.Process) -> bool:
    """The text-encoder child (not a helper some library starts), by the request file it is given."""
    try:
        return any(tx.WORK_PREFIX in part for part in proc.cmdline())
    except psutil.Error:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child dies with its parent on Linux")
def test_a_sigkilled_cli_leaves_a_folder_the_next_start_sweeps(nf4_ckpt, tmp_path, monkeypatch):
    """SIGKILL of `generate` while its text-encoder child runs: the child dies with it and the folder
    (child.log, owner.lock) stays; the next encode sweeps it even when its prompt is cached (no child)."""
    files = resolve_checkpoint_dir(nf4_ckpt)
    encode = functools.partial(
        tx.encode_prompts, files.text_encoder, ["a castle"], tokenizer_path=files.tokenizer
    )
    encode(mode="inprocess")  # cached for the next start
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "LINGBOT_WORLD_CACHE": str(tmp_path / "cli_cache")}
    command = [sys.executable, str(ROOT / "lingbot.py"), *args_for(nf4_ckpt, EXAMPLE, tmp_path / "o.mp4")]
    run = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child, deadline = None, time.monotonic() + 300
    try:
        while child is None and run.poll() is None and time.monotonic() < deadline:
            child = next(filter(_is_encoder, psutil.Process(run.pid).children()), None)
            time.sleep(0.01)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert child is not None, "the CLI started no text-encoder child"
    (work,) = tmp.glob(f"{tx.WORK_PREFIX}{run.pid}_*")
    assert (work / tx.LOCK_NAME).is_file() and _gone(child, 30)

    def no_child(*args, **kwargs):
        raise AssertionError("the cached prompt started an encoder child")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(tx, "encode_in_subprocess", no_child)
    encode(mode="subprocess")
    assert not work.exists() and list(tmp.iterdir()) == []
