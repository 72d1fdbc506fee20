"""Helpers shared by several test files (tests import them from here, never from another test file):
CPU stand-ins of ComfyUI's runtime modules for the node tests, the nodes' inputs for an example and the
Fast sampler call, the block-swap tests' tiny NF4 expert with its LoRA, the CLI's bad-input checks
(arguments, a linked checkpoint copy, the one-error check), a kohya LoRA file, a compiled-blocks graph counter, a Fast session's forward
recorder, a process-exit wait and a headless Chromium."""

import contextlib
import functools
import os
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from lingbot_world import cli
from lingbot_world.loaders import synthetic as S
from lingbot_world.loaders.stream import load_expert
from lingbot_world.wan import devices
from lingbot_world.wan.config import CONTROL_CHANNELS
from lingbot_world.wan.fast import FastSession
from lingbot_world.wan.lora import Lora
from PIL import Image
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
EXPERT = "high_noise_model_bnb_nf4/model.safetensors"  # the tiny demo checkpoint's high-noise expert
SWAP_CFG = S.tiny_config(num_layers=4)  # the block-swap tests' expert


def channels_last_3d(a: torch.Tensor) -> bool:
    """Whether a 5-D tensor has channels-last-3d's strides, size-1 dims' included (`is_contiguous` ignores those)."""
    _, c, t, h, w = a.shape
    return a.stride() == (c * t * h * w, 1, h * w * c, w * c, c)


def install_fake_comfy(monkeypatch, ckpt, input_dir):
    """The few ComfyUI runtime modules the nodes import, as plain CPU stand-ins, so the node code runs
    here as it runs in ComfyUI (the real-ComfyUI tests cover the server itself). Returns the pack's nodes
    package; `nodes.memory.mm.free_memory_calls` records each `free_memory(nbytes, device)` the nodes ask."""
    mm = types.ModuleType("comfy.model_management")
    cpu = torch.device("cpu")
    for name in ("get_torch_device", "intermediate_device", "vae_device", "text_encoder_device"):
        setattr(mm, name, lambda: cpu)
    mm.free_memory_calls = []
    mm.free_memory = lambda nbytes, device: mm.free_memory_calls.append((nbytes, torch.device(device)))
    mm.soft_empty_cache = lambda: None
    mm.throw_exception_if_processing_interrupted = lambda: None
    utils = types.ModuleType("comfy.utils")

    class ProgressBar:
        def __init__(self, total):
            self.total = total

        def update_absolute(self, value, total=None, preview=None):
            pass

    utils.ProgressBar = ProgressBar
    attn = types.ModuleType("comfy.ldm.modules.attention")
    attn.optimized_attention = lambda q, k, v, heads, **kw: (
        torch.nn.functional.scaled_dot_product_attention(
            *(t.view(1, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
        )
        .transpose(1, 2)
        .reshape(q.shape)
    )
    comfy = types.ModuleType("comfy")
    comfy.model_management, comfy.utils = mm, utils
    roots = {
        "diffusion_models": [str(ckpt)],
        "text_encoders": [str(ckpt)],
        "vae": [str(ckpt)],
        "loras": [str(input_dir)],
    }
    fp = types.ModuleType("folder_paths")
    fp.get_folder_paths = lambda kind: roots[kind]
    fp.get_filename_list = lambda kind: sorted(p.name for p in Path(roots[kind][0]).iterdir())
    fp.get_input_directory = lambda: str(input_dir)
    ldm, ldm_modules = types.ModuleType("comfy.ldm"), types.ModuleType("comfy.ldm.modules")
    comfy.__path__, ldm.__path__, ldm_modules.__path__ = [], [], []  # packages
    comfy.ldm, ldm.modules, ldm_modules.attention = ldm, ldm_modules, attn
    modules = {"comfy": comfy, "comfy.model_management": mm, "comfy.utils": utils, "folder_paths": fp}
    modules.update({"comfy.ldm": ldm, "comfy.ldm.modules": ldm_modules, "comfy.ldm.modules.attention": attn})
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in [n for n in sys.modules if n.startswith("lingbot_world.nodes")]:
        monkeypatch.delitem(sys.modules, name)
    import lingbot_world.nodes as nodes

    return nodes


def node_inputs(nodes, example):
    """(text, vae, camera, image) from the pack's nodes for `example` and the prompt "a castle", as a
    workflow feeds the samplers (the image as core Load Image gives it)."""
    (text,) = nodes.LingBotTextEncode().encode(
        "models_t5_umt5-xxl-enc-bf16.pth", "a castle", "", "inprocess", "cpu"
    )
    (vae,) = nodes.LingBotVAELoader().load("Wan2.1_VAE.pth", "fp32")
    camera, _ = nodes.LingBotCamera().load(str(example))
    with Image.open(example / "image.jpg") as img:
        image = torch.from_numpy(np.array(img.convert("RGB")).astype(np.float32) / 255.0)[None]
    return text, vae, camera, image


NODE_SIZE = ("max_area", "64*112", 832, 480)  # the samplers' size inputs: at most 64*112 pixels


def fast_sample(
    nodes, model, vae, image, length=21, seed=5, shift=10.0, window=3, sink=0, kv="bf16", **inputs
):
    """The Fast sampler node's `sample` at NODE_SIZE (`inputs`: camera, text, speed)."""
    return nodes.LingBotFastSampler().sample(
        model, vae, image, *NODE_SIZE, length, seed, shift, window, sink, kv, **inputs
    )


def load_nf4(path, device="cpu"):
    """An NF4 expert folder loaded with bitsandbytes' portable CPU kernel."""
    import bitsandbytes as bnb

    model = load_expert(path, device)
    for m in model.modules():  # keep bnb's portable CPU kernel (see loaders/stream.py)
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def swap_inputs(device="cpu"):
    """(x, t, context, y, cam) for one forward of a SWAP_CFG expert on a 2x4x4 latent."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 4, 4, generator=g)
    y = torch.randn(20, 2, 4, 4, generator=g)
    ctx = torch.randn(7, SWAP_CFG.text_dim, generator=g)
    cam = torch.randn(1, 384, 2, 4, 4, generator=g)
    return [v.to(device) for v in (x, torch.tensor([700.0]), ctx, y, cam)]


def swap_run(model, device="cpu"):
    """One forward of `model` on `swap_inputs`."""
    x, t, ctx, y, cam = swap_inputs(device)
    with torch.no_grad():
        return model(x, t, ctx, y=y, cam=cam)


def lora_for(model, targets=("blocks.3.self_attn.q", "blocks.2.ffn.0", "blocks.0.cross_attn.o")):
    """A random LoRA on `targets` (low-rank + bias deltas) and a diff on block 3's norm3."""
    g = torch.Generator().manual_seed(9)
    patches = {}
    for target in targets:
        layer = model.get_submodule(target)
        patches[target] = (
            torch.randn(4, layer.in_features, generator=g) * 0.3,
            torch.randn(layer.out_features, 4, generator=g) * 0.3,
            8.0,
            None,
            torch.randn(layer.out_features, generator=g) * 0.1,
        )
    patches["blocks.3.norm3"] = (None, None, None, torch.randn(model.dim, generator=g) * 0.1, None)
    return Lora(patches, 1.0, "test")


class RunsCode:
    """A pickle that would run code when loaded."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def link_copy(src: Path, dst: Path) -> Path:
    """The checkpoint folder as symlinks, so one file can be replaced without copying the rest."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.is_dir():
            link_copy(entry, dst / entry.name)
        else:
            (dst / entry.name).symlink_to(entry)
    return dst


def args_for(ckpt, action_path, out, *extra):
    """`generate` on the tiny checkpoint `ckpt` (9 frames at 64*112, 2 steps, CPU); `action_path` None: no
    camera."""
    return [
        "generate",
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(ROOT / "examples" / "00" / "image.jpg"),
        "--prompt",
        "a castle",
        *(() if action_path is None else ("--action_path", str(action_path))),
        "--size",
        "64*112",
        "--frame_num",
        "9",
        "--sampling_steps",
        "2",
        "--device",
        "cpu",
        "--output",
        str(out),
        *extra,
    ]


def expect_clear_error(capsys, args, out: Path, *needles) -> str:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists() and not list(out.parent.glob(".*partial*"))
    return err


def fast_args(ckpt, example, out, *extra):
    return [
        "fast",
        "--ckpt_dir",
        str(ckpt),
        "--image",
        str(example / "image.jpg"),
        "--prompt",
        "a castle",
        "--size",
        "64*112",
        "--device",
        "cpu",
        "--t5_mode",
        "inprocess",
        "--output",
        str(out),
        *extra,
    ]


def tiny_lora(path, config, seed=0, rank=2):
    """A kohya-layout LoRA on a few of the experts' Linears."""
    g = torch.Generator().manual_seed(seed)
    dim, ffn = config.dim, config.ffn_dim
    tensors = {}
    for name, (out_f, in_f) in {"blocks_0_self_attn_q": (dim, dim), "blocks_1_ffn_0": (ffn, dim)}.items():
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
        tensors[f"lora_unet_{name}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return path


def counting_blocks():
    """(a `speed.CompiledBlocks` whose backend runs each traced graph as is, the list of graphs it traced)."""
    from lingbot_world.wan import speed

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return speed.CompiledBlocks(backend=counting_backend), graphs


def record_forwards(session: FastSession) -> list:
    flows, forward = [], session._forward

    def rec(*args, **kwargs):
        out = forward(*args, **kwargs)
        flows.append(out)
        return out

    session._forward = rec
    return flows


def _gone(proc: psutil.Process, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, *args, nproc: int = 2, **run) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc script args` on a free port, its output captured as text."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    launch += ["--master_port", str(free_port()), str(script), *map(str, args)]
    return subprocess.run(launch, capture_output=True, text=True, **{"timeout": 300, **run})


@contextlib.contextmanager
def one_thread():
    """torch on one thread, as torchrun's and mp.spawn's ranks run: a one-process reference computed like them
    (on some CPUs the thread count changes bf16 matmul rounding, which a few steps amplify)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_torchrun_cli_equals_one_process(argv, folder: Path, frames: int) -> None:
    """`argv(name)`: a CLI command writing folder/name.mp4 and its latent folder/name.latent. Run once in this
    process (one thread), then as two ranks under torchrun (--parallel auto): rank 0 alone reports and writes,
    an MP4 of `frames` frames whose latent is the one-process run's."""
    from lingbot_world.loaders.video import read_mp4_info
    from safetensors.torch import load_file

    with one_thread():
        assert cli.main(argv("one")) == 0
    run = torchrun(Path(__file__).resolve().parents[1] / "lingbot.py", *argv("two"), "--parallel", "auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1
    assert read_mp4_info(folder / "two.mp4")["frames"] == frames
    one, two = load_file(folder / "one.latent"), load_file(folder / "two.latent")
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-3, atol=1e-3)


@contextlib.contextmanager
def headless_chromium(profile: Path):
    """A selenium driver of headless Chromium (its profile in `profile`), quit on leaving; skips the test
    where selenium, chromium or chromedriver is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip(
            "the browser test needs chromium and chromedriver on PATH (Debian: chromium, chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def tiny_fast_inputs(lat=(9, 4, 6), text_dim=32, seed=0):
    """(y, context, cam) of a tiny Fast chunk loop over `lat` latent frames."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(20, *lat, generator=g)
    ctx = torch.randn(5, text_dim, generator=g)
    cam = torch.randn(1, 384, *lat, generator=g)
    return y, ctx, cam


@functools.cache
def tiny_fast_model():
    """A tiny random cam DiT (the model `tiny_fast_inputs` fits), built once."""
    from lingbot_world.loaders import synthetic
    from lingbot_world.wan.dit import WanModel, init_random_

    return init_random_(WanModel.from_config(synthetic.tiny_config("cam")), seed=1).eval()


class TinyRun:
    """A tiny random cam expert (bf16 as loaded, or with fp8 blocks) and one sampling run's inputs."""

    def __init__(self, layers=2, use_fp8=True):
        from lingbot_world.wan.dit import WanModel, init_random_

        self.model = init_random_(WanModel.from_config(S.tiny_config("cam", num_layers=layers)), seed=2)
        self.model.eval().requires_grad_(False)
        if use_fp8:
            from lingbot_world.wan.fp8 import quantize_blocks_

            quantize_blocks_(self.model)
        g = torch.Generator().manual_seed(0)
        self.noise, self.y = torch.randn(16, 2, 4, 6, generator=g), torch.randn(20, 2, 4, 6, generator=g)
        self.context, self.context_null = torch.randn(7, 32, generator=g), torch.randn(5, 32, generator=g)
        self.cam = torch.randn(1, CONTROL_CHANNELS["cam"], 2, 4, 6, generator=g)

    def forward(self):
        with torch.no_grad():
            return self.model(self.noise, torch.tensor([500]), self.context, y=self.y, cam=self.cam)

    def denoise(self, options):
        from lingbot_world.wan import pipeline
        from lingbot_world.wan.config import SampleConfig

        args = (self.noise, self.y, self.context, self.context_null, self.cam, SampleConfig(sample_steps=4))
        return pipeline.denoise(lambda which: self.model, *args, pipeline.Hooks(), speed=options)


def fake_module(monkeypatch, name: str, module) -> None:
    """Stand `module` in for the optional package `name` for one test (None: its import fails), with the attention
    backends' kept imports (`wan.devices.kept_import`) emptied so the next lookup sees it."""
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(devices, "_imported", {})


def fa3_math(q, k, v, q_descale=None, k_descale=None, v_descale=None, keep=None):
    """FlashAttention-3's `flash_attn_func` in plain torch, on [batch, tokens, heads, d]: e4m3 inputs are dequantized
    with their [batch, heads] descales (a missing one is 1, as FA3 takes it) and give bf16, as FA3's fp8 kernel does;
    others give q's dtype. `keep`: [batch, keys] bool, the keys each batch's queries read (all: None)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8:
        q, k, v = (
            t.float() * (1 if s is None else s[:, None, :, None])
            for t, s in ((q, q_descale), (k, k_descale), (v, v_descale))
        )
    mask = None if keep is None else keep[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), attn_mask=mask
    )
    return o.transpose(1, 2).to(torch.bfloat16 if fp8 else q.dtype)


def fa3_cache_math(q, k_cache, v_cache, cache_leftpad=None, num_splits=0, **descales):
    """FlashAttention-3's `flash_attn_with_kvcache` as our adapter calls it, in plain torch: each batch's queries
    read its keys from row `cache_leftpad[b]` on (a mask: no host sync, so compiled blocks trace through it)."""
    assert num_splits == 1, "the adapter asks for one pass over the keys"
    keep = None
    if cache_leftpad is not None:
        assert cache_leftpad.dtype == torch.int32 and cache_leftpad.shape == (q.shape[0],)
        keep = torch.arange(k_cache.shape[1], device=k_cache.device)[None, :] >= cache_leftpad[:, None]
    return fa3_math(q, k_cache, v_cache, keep=keep, **descales)
