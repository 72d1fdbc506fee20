"""Self-freeing prompt encoding: subprocess vs in-process, cache, child failures, parent memory."""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import _gone
from lingbot_world.loaders import text_encode as tx
from lingbot_world.loaders import text_encoder as te
from lingbot_world.loaders.monitor import RssSampler, rss_anon
from lingbot_world.loaders.synthetic_text import (
    TINY,
    spiece_model_bytes,
    upstream_state_dict,
    write_hf_safetensors,
    write_pth,
    write_tokenizer_json,
)

TEXT_LEN = 48
PROMPTS = ["The wind whips past the castle.", "Low quality, blurry, static frames."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Upstream layout: .pth with a tokenizer/ folder beside it (the NF4 repo's layout)."""
    d = tmp_path_factory.mktemp("enc")
    write_tokenizer_json(d / "tokenizer")
    return write_pth(d / "models_t5_umt5-xxl-enc-bf16.pth", upstream_state_dict(TINY, seed=3))


@pytest.fixture(scope="module")
def comfy_ckpt(tmp_path_factory):
    """ComfyUI layout with its embedded sentencepiece tokenizer."""
    d = tmp_path_factory.mktemp("comfy")
    sd = upstream_state_dict(TINY, seed=3)
    return write_hf_safetensors(d / "umt5_xxl_fp16.safetensors", sd, spiece=spiece_model_bytes())


def _encode(path, mode, tmp_path, **kw):
    return tx.encode_prompts(path, PROMPTS, mode=mode, cache_dir=tmp_path / "cache", text_len=TEXT_LEN, **kw)


@pytest.mark.parametrize("which", ["ckpt", "comfy_ckpt"])
def test_subprocess_and_inprocess_give_identical_trimmed_embeddings(which, request, tmp_path, monkeypatch):
    path = request.getfixturevalue(which)
    # Run from a ComfyUI-like folder: the child must not pick up its `comfy` package from the cwd.
    fake_comfy = tmp_path / "ComfyUI"
    (fake_comfy / "comfy").mkdir(parents=True)
    (fake_comfy / "comfy" / "__init__.py").write_text("")
    (fake_comfy / "comfy" / "model_management.py").write_text(
        "raise SystemExit('ComfyUI imported in the child')"
    )
    monkeypatch.chdir(fake_comfy)
    sub = _encode(path, "subprocess", tmp_path / "a")
    inp = _encode(path, "inprocess", tmp_path / "b")
    tok = te.load_tokenizer(None, path, text_len=TEXT_LEN)
    model = te.load_text_encoder(path)
    for p, a, b in zip(PROMPTS, sub, inp, strict=True):
        n = len(tok.encode(p))
        assert 2 < n < TEXT_LEN
        assert a.shape == (n, TINY["dim"]) and a.dtype == torch.bfloat16 and a.device.type == "cpu"
        assert torch.equal(a, b)
        # the rows are the encoder's output at the true tokens of the 48-token padded run
        ids, mask = tok([p])
        with torch.no_grad():
            full = model(ids, mask)[0]
        assert torch.equal(a, full[:n])
    assert not torch.equal(sub[0][:2], sub[1][:2])


def test_cache_hit_never_loads_the_encoder(ckpt, tmp_path, monkeypatch):
    first = _encode(ckpt, "subprocess", tmp_path)
    files = sorted((tmp_path / "cache").glob("*.safetensors"))
    assert len(files) == 2 and not list((tmp_path / "cache").glob("*.tmp"))

    def forbidden(*a, **k):
        raise AssertionError("the encoder was loaded on a cache hit")

    monkeypatch.setattr(tx.subprocess, "Popen", forbidden)
    monkeypatch.setattr(tx, "load_text_encoder", forbidden)
    for mode in tx.MODES:
        again = _encode(ckpt, mode, tmp_path)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_cache_encodes_only_misses_and_keys_on_file_identity(ckpt, tmp_path, monkeypatch):
    loads = []
    real = tx.load_text_encoder
    monkeypatch.setattr(tx, "load_text_encoder", lambda *a, **k: loads.append(1) or real(*a, **k))
    _encode(ckpt, "inprocess", tmp_path)
    assert len(loads) == 1
    out = tx.encode_prompts(
        ckpt,
        [PROMPTS[1], "A new prompt", PROMPTS[1]],
        mode="inprocess",
        cache_dir=tmp_path / "cache",
        text_len=TEXT_LEN,
    )
    assert len(loads) == 2 and torch.equal(out[0], out[2])
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 3
    # a changed encoder file (new mtime) must not reuse old embeddings
    st = ckpt.stat()
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _encode(ckpt, "inprocess", tmp_path)
    assert len(loads) == 3
    # other text_len -> other key
    tx.encode_prompts(
        ckpt, PROMPTS[:1], mode="inprocess", cache_dir=tmp_path / "cache", text_len=TEXT_LEN + 1
    )
    assert len(loads) == 4
    # use_cache=False always encodes
    tx.encode_prompts(ckpt, PROMPTS[:1], mode="inprocess", text_len=TEXT_LEN, use_cache=False)
    assert len(loads) == 5


def test_cache_is_bounded_lru_and_survives_damage(tmp_path):
    cache = tx.EmbeddingCache(tmp_path, max_entries=2, max_bytes=1 << 20)
    t = [torch.full((3, 4), float(i), dtype=torch.bfloat16) for i in range(3)]
    cache.put("k0", "p0", t[0])
    time.sleep(0.01)
    cache.put("k1", "p1", t[1])
    time.sleep(0.01)
    assert torch.equal(cache.get("k0", "p0"), t[0])  # touch k0: k1 is now least recently used
    time.sleep(0.01)
    cache.put("k2", "p2", t[2])
    assert cache.get("k1", "p1") is None
    assert torch.equal(cache.get("k0", "p0"), t[0]) and torch.equal(cache.get("k2", "p2"), t[2])
    assert cache.get("k0", "another prompt") is None  # metadata must match the prompt
    (tmp_path / "k2.safetensors").write_bytes(b"\x00truncated")
    assert cache.get("k2", "p2") is None and not (tmp_path / "k2.safetensors").exists()
    small = tx.EmbeddingCache(tmp_path / "small", max_entries=100, max_bytes=300)
    for i in range(3):
        small.put(f"s{i}", "p", torch.zeros(8, 8, dtype=torch.bfloat16))  # ~200 B each
    assert len(list((tmp_path / "small").glob("*.safetensors"))) == 1
    import shutil

    shutil.rmtree(tmp_path)
    assert cache.get("k0", "p0") is None  # deleting the cache folder is safe


def test_bad_inputs(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        tx.encode_prompts(tmp_path / "missing.pth", PROMPTS, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="mode must be one of"):
        tx.encode_prompts(ckpt, PROMPTS, mode="thread", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="non-empty list of strings"):
        tx.encode_prompts(ckpt, "a bare string", cache_dir=tmp_path)
    lonely = write_pth(tmp_path / "lonely.pth", upstream_state_dict(TINY))
    with pytest.raises(FileNotFoundError, match="no umT5 tokenizer found"):
        tx.encode_prompts(lonely, PROMPTS, cache_dir=tmp_path)


def test_tokenizer_too_big_for_encoder_fails_in_the_child_with_its_own_error(tmp_path):
    small = dict(TINY, vocab=40)  # the tokenizer below has ~120 tokens
    write_tokenizer_json(tmp_path / "tokenizer")
    enc = write_pth(tmp_path / "enc.pth", upstream_state_dict(small))
    for mode in tx.MODES:
        with pytest.raises(ValueError, match=r"tokens but the text encoder .*enc\.pth embeds only 40"):
            tx.encode_prompts(enc, PROMPTS, mode=mode, cache_dir=tmp_path / "cache", text_len=TEXT_LEN)


def test_broken_checkpoint_error_comes_back_from_the_child(tmp_path):
    write_tokenizer_json(tmp_path / "tokenizer")
    bad = tmp_path / "broken.pth"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"broken\.pth: could not read it as a torch state dict"):
        tx.encode_prompts(bad, PROMPTS, cache_dir=tmp_path / "cache", text_len=TEXT_LEN)


def _fake_child(monkeypatch, code: str):
    monkeypatch.setattr(tx, "_child_command", lambda request: [sys.executable, "-c", code, str(request)])


def test_child_nonzero_exit_is_reported_with_its_output(ckpt, tmp_path, monkeypatch):
    _fake_child(
        monkeypatch, "import sys; print('loading...'); sys.stderr.write('CUDA exploded\\n'); sys.exit(3)"
    )
    with pytest.raises(RuntimeError, match=r"exited with status 3(.|\n)*CUDA exploded"):
        _encode(ckpt, "subprocess", tmp_path)


def test_child_without_output_is_an_error(ckpt, tmp_path, monkeypatch):
    _fake_child(monkeypatch, "print('all good, honest')")
    with pytest.raises(RuntimeError, match=r"status 0 but wrote no embeddings(.|\n)*all good, honest"):
        _encode(ckpt, "subprocess", tmp_path)


def test_child_timeout_kills_it(ckpt, tmp_path, monkeypatch):
    _fake_child(monkeypatch, "import time; print('stuck', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 1 s(.|\n)*stuck"):
        _encode(ckpt, "subprocess", tmp_path, timeout=1)
    assert time.monotonic() - t0 < 15
    assert not _encoder_children()


def test_while_waiting_runs_once_while_the_child_encodes(ckpt, tmp_path):
    """The parent's own work (the CLI imports bitsandbytes there) runs while the child is alive, once,
    and only when a child runs; an error in it stops the child and is raised as is."""
    seen = []

    def work():
        seen.append([c.is_running() for c in _encoder_children()])

    first = _encode(ckpt, "subprocess", tmp_path, while_waiting=work)
    assert seen == [[True]]
    again = _encode(ckpt, "subprocess", tmp_path, while_waiting=work)  # cache hit: no child, no call
    assert len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))

    def broken():
        raise RuntimeError("parent-side failure")

    with pytest.raises(RuntimeError, match="parent-side failure"):
        _encode(ckpt, "subprocess", tmp_path / "other", while_waiting=broken)
    assert not _encoder_children() and not list(
        Path(tempfile.gettempdir()).glob(f"{tx.WORK_PREFIX}{os.getpid()}_*")
    )


def _run_and_catch(fn):
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=target)
    th.start()
    return th, box


def _encoder_children() -> list:
    """This process's text-encoder children (an argument is their request file); other children,
    such as a multiprocessing resource tracker that an earlier test started, are not ours to judge."""
    kids = []
    for p in psutil.Process().children():
        try:
            if any(arg.endswith("request.json") for arg in p.cmdline()):
                kids.append(p)
        except psutil.NoSuchProcess:
            pass
    return kids


def _wait_for_child(timeout=30.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = _encoder_children()
        if kids:
            return kids[0]
        time.sleep(0.02)
    raise AssertionError("no child process appeared")


def test_killed_child_gives_a_clear_error(ckpt, tmp_path):
    th, box = _run_and_catch(lambda: _encode(ckpt, "subprocess", tmp_path))
    _wait_for_child().send_signal(signal.SIGKILL)
    th.join(60)
    assert not th.is_alive()
    err = box.get("error")
    assert isinstance(err, RuntimeError) and "killed by signal 9 (SIGKILL)" in str(err), box
    assert not list((tmp_path / "cache").glob("*.safetensors"))


def test_interrupt_stops_the_child_and_cleans_up(ckpt, tmp_path, monkeypatch):
    _fake_child(monkeypatch, "import time; time.sleep(60)")
    seen = {}

    def interrupt():
        child = _wait_for_child()
        seen["request"] = Path(child.cmdline()[-1])
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        tx.encode_in_subprocess(ckpt, PROMPTS, None, text_len=TEXT_LEN)
    assert not _encoder_children()
    assert seen["request"].name == "request.json" and not seen["request"].parent.exists()


def test_background_encode_matches_and_reports_its_time(ckpt, tmp_path):
    direct = _encode(ckpt, "subprocess", tmp_path / "a")
    with tx.BackgroundEncode(ckpt, PROMPTS, cache_dir=tmp_path / "b", text_len=TEXT_LEN) as bg:
        child = _wait_for_child()  # the encode runs while this thread goes on
        out = bg.result()
    assert all(torch.equal(a, b) for a, b in zip(direct, out, strict=True))
    assert not child.is_running() and bg.seconds > 0 and 0 <= bg.waited <= bg.seconds


def test_background_encode_error_comes_back_from_result(ckpt, tmp_path, monkeypatch):
    _fake_child(monkeypatch, "import sys; print('no luck'); sys.exit(3)")
    with tx.BackgroundEncode(ckpt, PROMPTS, cache_dir=tmp_path, text_len=TEXT_LEN) as bg:
        with pytest.raises(tx.EncoderProcessError, match=r"status 3(.|\n)*no luck"):
            bg.result()
    assert not _encoder_children()


def test_closing_a_background_encode_stops_its_child_and_cleans_up(ckpt, tmp_path, monkeypatch):
    _fake_child(monkeypatch, "import time; time.sleep(60)")
    t0 = time.monotonic()
    with tx.BackgroundEncode(ckpt, PROMPTS, cache_dir=tmp_path, text_len=TEXT_LEN) as bg:
        request = Path(_wait_for_child().cmdline()[-1])
    assert time.monotonic() - t0 < 15  # not the child's 60 s
    assert not _encoder_children() and not request.parent.exists()
    assert not any(t.name == "text-encode" for t in threading.enumerate())
    with pytest.raises(tx.EncodeCancelled):
        bg.result()


def _peak_rss_anon_during(fn):
    with RssSampler(interval=0.005) as sampler:
        out = fn()
    return out, sampler.peak


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc RssAnon")
def test_parent_memory_does_not_hold_the_weights(tmp_path):
    """A ~270 MB fp16 checkpoint: the subprocess leaves the parent's anonymous RSS flat; the in-process
    control shows the same measurement does see the weights, and that they are given back."""
    big = dict(vocab=65536, dim=2048, dim_attn=64, dim_ffn=64, num_heads=4, num_layers=1, num_buckets=32)
    path = write_hf_safetensors(
        tmp_path / "umt5_big_fp16.safetensors",
        upstream_state_dict(big, seed=4),
        spiece=spiece_model_bytes(),
        dtype=torch.float16,
    )
    size = path.stat().st_size
    assert size > 250e6
    import gc

    gc.collect()
    base = rss_anon()
    embs, peak_sub = _peak_rss_anon_during(
        lambda: tx.encode_in_subprocess(path, PROMPTS, None, text_len=TEXT_LEN)[0]
    )
    assert embs[0].shape[1] == 2048
    assert peak_sub - base < 0.2 * size, (peak_sub - base, size)

    gc.collect()
    base = rss_anon()
    (embs_in, report), peak_in = _peak_rss_anon_during(
        lambda: tx.encode_in_process(path, PROMPTS, None, text_len=TEXT_LEN)
    )
    assert peak_in - base > 0.8 * size  # bf16 copies of the fp16 file did live here
    assert rss_anon() - base < 0.2 * size  # ... and were released
    assert report["rss_anon_after"] - report["rss_anon_before"] < 0.2 * size
    assert all(torch.equal(a, b) for a, b in zip(embs, embs_in, strict=True))


def test_relative_paths_work_in_the_child(ckpt, tmp_path, monkeypatch):
    """The child runs in its own temp folder: every path it gets must already be absolute."""
    work = tmp_path / "cwd"
    (work / "valid").mkdir(parents=True)
    write_tokenizer_json(work / "valid" / "tokenizer")
    write_pth(work / "valid" / "enc.pth", upstream_state_dict(TINY, seed=3))
    monkeypatch.chdir(work)
    rel = dict(tokenizer_path="valid/tokenizer", cache_dir="cache", text_len=TEXT_LEN)
    embs = tx.encode_prompts("valid/enc.pth", PROMPTS, mode="subprocess", **rel)
    assert len(list((work / "cache").glob("*.safetensors"))) == len(PROMPTS)
    again = tx.encode_prompts("valid/enc.pth", PROMPTS, mode="inprocess", use_cache=False, **rel)
    assert all(torch.equal(a, b) for a, b in zip(embs, again, strict=True))


# The parent of these tests: a process like the CLI, encoding with the real child.
PARENT = r"""
import signal, sys
sys.path.insert(0, sys.argv[1])
from lingbot import load_pack
load_pack()
from lingbot_world.loaders import text_encode as tx

def on_sigterm(signum, frame):
    if sys.argv[3] == "systemexit":
        sys.exit(143)
    raise KeyboardInterrupt

if sys.argv[3] != "default":
    signal.signal(signal.SIGTERM, on_sigterm)
print("encoding", flush=True)
tx.encode_in_subprocess(sys.argv[2], ["a secret prompt"], None, text_len=48)
print("finished", flush=True)
"""


def _start_parent(ckpt, tmp_path, on_sigterm):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(Path(tx.ROOT)), str(ckpt), on_sigterm],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert parent.stdout.readline().strip() == "encoding"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = psutil.Process(parent.pid).children()
        if kids:
            return parent, kids[0], tmp
        time.sleep(0.01)
    parent.kill()
    raise AssertionError("the encoder child did not start")


@pytest.mark.parametrize("on_sigterm", ["systemexit", "interrupt"])
def test_sigterm_handler_in_the_parent_kills_the_child_and_cleans_up(ckpt, tmp_path, on_sigterm):
    """The CLI turns SIGTERM into SystemExit(143) or KeyboardInterrupt in its main thread: the
    child must be dead and the temp folder (request with the prompts, outputs) gone when it exits."""
    parent, child, tmp = _start_parent(ckpt, tmp_path, on_sigterm)
    parent.send_signal(signal.SIGTERM)
    _, err = parent.communicate(timeout=60)
    # an uncaught KeyboardInterrupt ends Python by SIGINT
    assert parent.returncode == (143 if on_sigterm == "systemexit" else -signal.SIGINT), err[-2000:]
    assert _gone(child, 0.5)  # reaped by the parent before it exited
    assert not list(tmp.iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_child_dies_with_a_killed_parent_and_its_folder_is_swept(ckpt, tmp_path):
    """SIGKILL (or an unhandled SIGTERM) leaves the parent no chance to clean up: the kernel kills
    the child with it, the child has already deleted its request, and the next encode sweeps the
    folder."""
    parent, child, tmp = _start_parent(ckpt, tmp_path, "default")
    (work,) = tmp.glob(f"{tx.WORK_PREFIX}{parent.pid}_*")
    deadline = time.monotonic() + 30
    while (work / "request.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (work / "request.json").exists()  # the prompts left the disk once the child read them
    parent.send_signal(signal.SIGTERM)
    parent.communicate(timeout=60)
    assert parent.returncode == -signal.SIGTERM
    assert _gone(child, 1.0)
    assert tx.sweep_stale_work_dirs(tmp) == [work] and not work.exists()


def test_sweep_leaves_folders_of_live_encoders_alone(ckpt, tmp_path, monkeypatch):
    seen = {}

    def sweep_during_encode(request):
        seen["swept"] = tx.sweep_stale_work_dirs(request.parent.parent, min_age_s=0)
        seen["work"] = request.parent
        return [sys.executable, "-c", "pass"]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tx, "_child_command", sweep_during_encode)
    with pytest.raises(tx.EncoderProcessError, match="wrote no embeddings"):
        tx.encode_in_subprocess(ckpt, PROMPTS, None, text_len=TEXT_LEN)
    assert seen["swept"] == [] and seen["work"].parent == tmp_path
    assert not seen["work"].exists()
