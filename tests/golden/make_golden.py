"""Regenerate the upstream-parity golden files in tests/golden/ by running upstream LingBot-World's code.

Lay upstream's source tree out in a folder outside the repo (a checkout that has its 2026 commits:
the Act packing in `wan/image2video.py`, `wan/utils/wasd_ijkl_to_c2ws.py` and the action-string
control of 7170666/9660e94; the committed files were made from upstream 7ee84e1), then run, from
anywhere, with the pack's test environment:

    python tests/golden/make_golden.py --upstream <folder holding upstream's wan/ package>

(`--only camera dit` regenerates a subset.) The v2 file comes from LingBot-World 2.0's own code, laid out
the same way (`git archive 2648877 -- generate.py wan` of github robbyant/lingbot-world-v2):

    python tests/golden/make_golden.py --only v2 --upstream-v2 <folder holding v2's wan/ package>

CPU only, one to two minutes; the camera part peaks at
~8 GB of memory (upstream builds whole 720p tensors). The output is byte-for-byte reproducible.
It needs torch, numpy, scipy, einops, safetensors and tqdm.
Upstream's other heavy imports (diffusers, flash_attn, transformers, torchvision, cv2, and its T5
module, whose class body queries CUDA) are replaced by the minimal stand-ins below, none of them on a
numeric path except `flash_attention`, replaced by plain fp32 scaled-dot-product attention. Only the
folder's `wan/` package is imported (its __init__ files are bypassed); the camera inputs are the
repo's own examples/00.

Writes (small; tests/test_parity.py compares the pack against them):
- unipc.safetensors: upstream FlowUniPCMultistepScheduler timesteps, sigmas and every step's output for
  70 steps / shift 10 and 40 steps / shift 5 (fp32) and 40 / 5 in bf16, fed stored model outputs.
- camera.safetensors: the camera tensor of upstream `WanI2V.generate` for examples/00 at 464x832 and
  720x1280 for the Cam model (poses.npy), the Act model (poses.npy + action.npy) and act2cam (from
  wasd/ijkl_action.npy, and from an action string), packed in fp32. A 720p tensor is ~0.5 GB, so only
  a seeded sample of elements, the per-channel and per-latent-frame float64 sums, the latent poses
  and intrinsics (and the act2cam trajectory) are kept.
- dit.safetensors: a tiny cam WanModel (weights stored, bf16-representable) and its forward output
  with a camera tensor and without one (plain i2v), upstream `wan/modules/model.py` in fp32.
- vae.safetensors: a tiny Wan2.1 VAE (weights stored) encode and decode through upstream
  `Wan2_1_VAE` (its latent mean/std scaling and output clamp), fp32.
- fast.safetensors: a tiny LingBot-World-Fast causal DiT (upstream `WanModelFast`, cam control, the
  dit part's sizes, weights stored) run through upstream's own chunk loop `WanI2VFast.generate` in
  fp32 with its text encoder and VAE replaced by stand-ins returning stored tensors (the camera comes
  from examples/00 through upstream's code, cast to bf16 by upstream as in a real run): once with the
  unbounded cache on 9 latent frames (3 chunks), once with local_attn_size 6 / sink_size 3 on 12
  latent frames (the cache rolls). Kept: every forward's flow prediction (4 steps + the commit pass per
  chunk), the final latent, the i2v condition y and the camera. Upstream draws its noise from a
  generator on its device (CUDA there); here the device is the CPU, so the noise is the CPU
  generator's for the seed, which is what the pack draws on a CPU device.
- v2.safetensors: the same for LingBot-World 2.0 (upstream v2 `WanModelFast`, cam only, with the
  fast.safetensors model's weights, read from there and not stored again) through v2's own
  `WanI2VCausal` chunk loop with its 4-frame chunks and step indices [0, 250, 500, 750] passed
  explicitly (its private method's default is v1's): once with the 14B's shift 10 on 16 latent frames
  (4 chunks), once with the 1.3B's shift 5 (the 1.3B config's only sampling difference) on 12 (3
  chunks), each with a window scaled down from the documented 18 / 6 so the cache rolls (10 / 2: sink
  and two chunks; 9 / 3: a sink that is not a whole chunk). The camera is kept as a seeded sample and
  float64 sums (as in camera.safetensors); the i2v condition y and the text context whole.
"""

import argparse
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import math
import re
import sys
import tempfile
import types
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "00"
EXAMPLE_FILES = ("poses.npy", "intrinsics.npy", "action.npy", "wasd_action.npy", "ijkl_action.npy")

# UniPC runs: (steps, shift, dtype of the latent)
UNIPC_RUNS = ((70, 10.0, "float32"), (40, 5.0, "float32"), (40, 5.0, "bfloat16"))
UNIPC_SHAPE = (1, 4, 2, 3, 3)

# Camera: upstream size names -> max_area; the example image is 1280x720 (w x h), which gives these
# video sizes through generate()'s rounding.
CAMERA_SIZES = {"464x832": 480 * 832, "720x1280": 720 * 1280}
IMAGE_HW = (720, 1280)
FRAME_NUM = 81
# Mixed case, spaces and a full-width comma (all normalised upstream); 45 frames of 'i' run into the
# +/-85 deg pitch limit; 79 frames are padded to 81 with no-key frames.
ACTION_STRING = "W-6, a-4，d-4,iw-20,i-25,ks-5,jd-6,l-6,none-3"
CAMERA_SAMPLES = 2048

# Tiny DiT (fields of upstream's WanModel constructor)
DIT_CONFIG = dict(
    model_type="i2v",
    patch_size=(1, 2, 2),
    text_len=8,
    in_dim=36,
    dim=32,
    ffn_dim=64,
    freq_dim=16,
    text_dim=24,
    out_dim=16,
    num_heads=2,
    num_layers=2,
    window_size=(-1, -1),
    qk_norm=True,
    cross_attn_norm=True,
    eps=1e-6,
)
DIT_LATENT = (16, 2, 4, 6)  # [C, F, H, W]
DIT_TIMESTEPS = {"cam": 937, "plain": 412}

# Tiny Fast DiT: the dit part's sizes; runs of upstream WanI2VFast.generate (name -> settings)
FAST_RUNS = {
    "full": dict(local_attn_size=-1, sink_size=0, frame_num=33),  # 9 latent frames, 3 chunks
    "window": dict(local_attn_size=6, sink_size=3, frame_num=45),  # 12 latent frames: evicts
}
FAST_IMAGE_HW = (32, 48)  # with max_area 32*48: latent 4 x 6 (6 tokens per latent frame)
FAST_SEED = 42
FAST_SHIFT = 10.0  # generate_fast.py's sample_shift

# Tiny v2 DiT (the dit part's sizes): runs of upstream v2 WanI2VCausal.generate (name -> settings)
V2_RUNS = {
    "14b": dict(shift=10.0, local_attn_size=10, sink_size=2, frame_num=61),  # 16 latent frames, 4 chunks
    "1.3b": dict(shift=5.0, local_attn_size=9, sink_size=3, frame_num=45),  # 12 latent frames, 3 chunks
}
V2_CAMERA_SAMPLES = 1024
V2_CHUNK = 4
V2_TIMESTEPS_INDEX = [0, 250, 500, 750]  # what v2's generate() passes

# Tiny VAE: upstream's Wan2.1 config with dim 2 instead of 96
VAE_DIM = 2
VAE_VIDEO = (3, 9, 16, 24)
VAE_LATENT = (16, 3, 2, 3)


# ---------------------------------------------------------------------------------------------
# Stand-ins for upstream's imports that the pack's environment does not have.


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _diffusers():
    class ConfigMixin:
        def register_to_config(self, **kw):
            for k, v in kw.items():
                setattr(self.config, k, v)

    def register_to_config(init):
        sig = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self, *a, **kw):
            bound = sig.bind(self, *a, **kw)
            bound.apply_defaults()
            config = types.SimpleNamespace(**{k: v for k, v in bound.arguments.items() if k != "self"})
            object.__setattr__(self, "config", config)
            init(self, *a, **kw)

        return wrapped

    @dataclasses.dataclass
    class SchedulerOutput:
        prev_sample: torch.Tensor

    def randn_tensor(*a, **k):
        raise NotImplementedError("randn_tensor: not used by the golden runs")

    return {
        "diffusers": _module("diffusers"),
        "diffusers.configuration_utils": _module(
            "diffusers.configuration_utils", ConfigMixin=ConfigMixin, register_to_config=register_to_config
        ),
        "diffusers.models": _module("diffusers.models"),
        "diffusers.models.modeling_utils": _module(
            "diffusers.models.modeling_utils", ModelMixin=torch.nn.Module
        ),
        "diffusers.schedulers": _module("diffusers.schedulers"),
        "diffusers.schedulers.scheduling_utils": _module(
            "diffusers.schedulers.scheduling_utils",
            KarrasDiffusionSchedulers=enum.Enum("KarrasDiffusionSchedulers", []),
            SchedulerMixin=type("SchedulerMixin", (), {}),
            SchedulerOutput=SchedulerOutput,
        ),
        "diffusers.utils": _module(
            "diffusers.utils", deprecate=lambda *a, **k: None, is_scipy_available=lambda: False
        ),
        "diffusers.utils.torch_utils": _module("diffusers.utils.torch_utils", randn_tensor=randn_tensor),
    }


def flash_attention(q, k, v, q_lens=None, k_lens=None, softmax_scale=None, causal=False, **_):
    """fp32 stand-in for upstream's flash_attention: [B, L, heads, d] in, same out; keys beyond
    k_lens[b] are ignored, as the varlen kernel does."""
    assert softmax_scale is None and not causal and q_lens is None
    out = []
    for b in range(q.shape[0]):
        n = k.shape[1] if k_lens is None else int(k_lens[b])
        qb, kb, vb = (t[b : b + 1].transpose(1, 2) for t in (q, k[:, :n], v[:, :n]))
        out.append(F.scaled_dot_product_attention(qb, kb, vb).transpose(1, 2))
    return torch.cat(out).type(q.dtype)


def attention(q, k, v, q_lens=None, k_lens=None, causal=False, **_):
    """fp32 stand-in for upstream's attention() (the causal self-attention of WanModelFast)."""
    return flash_attention(q, k, v, q_lens=q_lens, k_lens=k_lens, causal=causal)


def _to_tensor(img):
    arr = np.asarray(img)
    return torch.from_numpy(arr).permute(2, 0, 1).float().div(255)


V1_MODULES = {
    "i2v": "wan.image2video",
    "model": "wan.modules.model",
    "vae": "wan.modules.vae2_1",
    "unipc": "wan.utils.fm_solvers_unipc",
    "act": "wan.utils.wasd_ijkl_to_c2ws",
}
V2_MODULES = {
    "i2v": "wan.image2video",
    "model_fast": "wan.modules.model_fast",
    "unipc": "wan.utils.fm_solvers_unipc",
}


def load_upstream(folder: Path, names: dict = V1_MODULES) -> types.SimpleNamespace:
    """Import upstream's modules from `folder`/wan without running its package __init__ files."""
    need = [folder / (name.replace(".", "/") + ".py") for name in names.values()]
    if not all(p.is_file() for p in need):
        raise SystemExit(
            f"{folder}: expected upstream's source tree with {', '.join(str(p.relative_to(folder)) for p in need)} "
            "(v1: its 2026 act2cam commits; v2: github robbyant/lingbot-world-v2 at 2648877)"
        )
    stubs = _diffusers()
    stubs.update(
        {
            "transformers": _module("transformers", AutoTokenizer=None),
            "regex": re,
            "cv2": _module("cv2"),
            "torchvision": _module("torchvision"),
            "torchvision.transforms": _module("torchvision.transforms"),
            "torchvision.transforms.functional": _module(
                "torchvision.transforms.functional", to_tensor=_to_tensor
            ),
            "wan.modules.attention": _module(
                "wan.modules.attention", flash_attention=flash_attention, attention=attention
            ),
            # its class body calls torch.cuda.current_device(); the text encoder is never used here
            "wan.modules.t5": _module("wan.modules.t5", T5EncoderModel=None),
        }
    )
    for pkg in ("wan", "wan.modules", "wan.utils", "wan.distributed"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(folder.joinpath(*pkg.split(".")))]
        stubs[pkg] = mod
    for name, mod in stubs.items():
        if name in sys.modules and not name.startswith("wan"):
            continue  # the real package is installed
        sys.modules[name] = mod
    import importlib

    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


# ---------------------------------------------------------------------------------------------


def make_unipc(up) -> tuple[dict, dict]:
    tensors, meta = {}, []
    gen = torch.Generator().manual_seed(4)
    for steps, shift, dtype_name in UNIPC_RUNS:
        dtype = getattr(torch, dtype_name)
        key = f"{steps}_{shift:g}_{dtype_name}"
        sched = up.unipc.FlowUniPCMultistepScheduler(
            num_train_timesteps=1000, shift=1, use_dynamic_shifting=False
        )
        sched.set_timesteps(steps, device="cpu", shift=shift)
        x = torch.randn(UNIPC_SHAPE, generator=gen).to(dtype)
        tensors[f"{key}/x_init"] = x
        outs, vs = [], []
        for t in sched.timesteps:
            # State-dependent fp32 "model output" (as the DiT gives); stored, so tests feed the same.
            v = torch.tanh(x.float() * 1.3) + 0.1 * torch.randn(x.shape, generator=gen)
            x = sched.step(v, t, x, return_dict=False)[0]
            vs.append(v)
            outs.append(x)
        tensors[f"{key}/timesteps"] = sched.timesteps.clone()
        tensors[f"{key}/sigmas"] = sched.sigmas.clone()
        tensors[f"{key}/model_outputs"] = torch.stack(vs)
        tensors[f"{key}/samples"] = torch.stack(outs)
        meta.append({"key": key, "steps": steps, "shift": shift, "dtype": dtype_name})
    return tensors, {"runs": meta}


class _Captured(Exception):
    pass


class _StopAtVae:
    def encode(self, *a, **k):
        raise _Captured


def upstream_camera(up, control_type: str, max_area: int, frame_num: int, act2cam=False, action_string=None):
    """Run upstream WanI2V.generate up to its VAE encode and return its locals (the camera prep)."""
    pipe = object.__new__(up.i2v.WanI2V)
    pipe.device = torch.device("cpu")
    pipe.control_type = control_type
    pipe.param_dtype = torch.float32  # keep the packed tensor in fp32 (upstream casts to bf16)
    pipe.vae_stride = (4, 8, 8)
    pipe.patch_size = (1, 2, 2)
    pipe.sp_size = 1
    pipe.t5_cpu = True
    pipe.sample_neg_prompt = "-"
    pipe.text_encoder = lambda texts, device: [torch.zeros(1, 4)]
    pipe.vae = _StopAtVae()
    img = np.zeros((*IMAGE_HW, 3), dtype=np.uint8)
    try:
        pipe.generate(
            "-",
            img,
            action_path=str(EXAMPLE),
            allow_act2cam=act2cam,
            action_string=action_string,
            vis_ui=False,
            max_area=max_area,
            frame_num=frame_num,
            seed=0,
        )
    except _Captured as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not up.i2v.WanI2V.generate.__code__:
            tb = tb.tb_next
        return dict(tb.tb_frame.f_locals)
    raise RuntimeError("upstream generate() did not reach its VAE encode")


def make_camera(up) -> tuple[dict, dict]:
    tensors, variants = {}, []
    act_frames = up.act.pad_frame_num_to_4n_plus_1(up.act.infer_frame_num_from_action_string(ACTION_STRING))
    runs = {
        "cam": dict(control_type="cam", frame_num=FRAME_NUM),
        "act": dict(control_type="act", frame_num=FRAME_NUM),
        "act2cam_files": dict(control_type="cam", frame_num=FRAME_NUM, act2cam=True),
        "act2cam_string": dict(
            control_type="cam", frame_num=act_frames, act2cam=True, action_string=ACTION_STRING
        ),
    }
    gen = torch.Generator().manual_seed(5)
    for size, max_area in CAMERA_SIZES.items():
        for name, kw in runs.items():
            loc = upstream_camera(up, max_area=max_area, **kw)
            cam = loc["dit_cond_dict"]["c2ws_plucker_emb"][0]
            h, w = int(loc["h"]), int(loc["w"])
            assert f"{h}x{w}" == size, (size, h, w)
            key = f"{name}_{size}"
            idx = torch.randint(0, cam.numel(), (CAMERA_SAMPLES,), generator=gen).unique()
            tensors[f"{key}/index"] = idx
            tensors[f"{key}/values"] = cam.flatten()[idx].clone()
            tensors[f"{key}/channel_sums"] = cam.sum(dim=(0, 2, 3, 4), dtype=torch.float64)
            tensors[f"{key}/frame_sums"] = cam.sum(dim=(0, 1, 3, 4), dtype=torch.float64)
            tensors[f"{key}/latent_c2w"] = loc["c2ws_infer"].clone()
            tensors[f"{key}/K"] = loc["Ks"][0].clone()
            if kw.get("act2cam"):
                tensors[f"{key}/c2w"] = torch.from_numpy(np.ascontiguousarray(loc["c2ws"]))
            variants.append(
                {
                    "key": key,
                    "kind": name,
                    "height": h,
                    "width": w,
                    "lat_h": int(loc["lat_h"]),
                    "lat_w": int(loc["lat_w"]),
                    "frame_num": int(loc["F"]),
                    "shape": list(cam.shape),
                    "act2cam": bool(kw.get("act2cam")),
                    "action_string": kw.get("action_string"),
                }
            )
            print(f"camera {key}: {list(cam.shape)} frames {int(loc['F'])}", flush=True)
            del loc, cam
    hashes = {f: hashlib.sha256((EXAMPLE / f).read_bytes()).hexdigest() for f in EXAMPLE_FILES}
    return tensors, {"variants": variants, "example_sha256": hashes, "samples": CAMERA_SAMPLES}


def _seeded_weights(module: torch.nn.Module, seed: int) -> dict:
    """Random weights of the module's shapes, rounded to bf16 (stored as bf16, loaded as fp32):
    std 1/sqrt(fan_in) matrices, 1 + 0.1 N gains, 0.1 N biases and modulations."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in module.state_dict().items():
        r = torch.randn(p.shape, generator=g)
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight", "gamma")):
            v = 1 + 0.1 * r
        elif p.dim() >= 2 and "modulation" not in name:
            v = r / math.sqrt(p[0].numel())
        else:
            v = 0.1 * r
        out[name] = v.to(torch.bfloat16)
    return out


@torch.no_grad()
def make_dit(up) -> tuple[dict, dict]:
    model = up.model.WanModel(control_type="cam", **DIT_CONFIG).eval()
    weights = _seeded_weights(model, 11)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    g = torch.Generator().manual_seed(12)
    c, f, h, w = DIT_LATENT
    x = torch.randn(c, f, h, w, generator=g)
    y = torch.randn(DIT_CONFIG["in_dim"] - c, f, h, w, generator=g)
    context = torch.randn(5, DIT_CONFIG["text_dim"], generator=g)
    cam = torch.randn(1, 6 * 64, f, h, w, generator=g)
    seq_len = f * h * w // 4
    tensors = {f"weights/{k}": v for k, v in weights.items()}
    tensors.update({"x": x, "y": y, "context": context, "cam": cam})
    for name, t in DIT_TIMESTEPS.items():
        cond = {"c2ws_plucker_emb": cam.chunk(1, dim=0)} if name == "cam" else None
        ts = torch.tensor([t])  # int64, as generate() passes the scheduler's timesteps
        out = model([x], t=ts, context=[context], seq_len=seq_len, y=[y], dit_cond_dict=cond)[0]
        tensors[f"out_{name}"] = out
        tensors[f"t_{name}"] = ts
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in DIT_CONFIG.items()}
    return tensors, {"config": cfg}


@torch.no_grad()
def make_vae(up) -> tuple[dict, dict]:
    mod = up.vae
    with torch.device("meta"):
        shapes = mod.WanVAE_(
            dim=VAE_DIM,
            z_dim=16,
            dim_mult=[1, 2, 4, 4],
            num_res_blocks=2,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            dropout=0.0,
        )
    weights = _seeded_weights(shapes, 13)
    with tempfile.TemporaryDirectory() as tmp:
        pth = Path(tmp) / "vae.pth"
        torch.save({k: v.float() for k, v in weights.items()}, pth)
        original = mod._video_vae
        mod._video_vae = functools.partial(original, dim=VAE_DIM)
        try:
            vae = mod.Wan2_1_VAE(vae_pth=str(pth), dtype=torch.float32, device="cpu")
        finally:
            mod._video_vae = original
    g = torch.Generator().manual_seed(14)
    video = torch.rand(VAE_VIDEO, generator=g) * 2 - 1
    latent = torch.randn(VAE_LATENT, generator=g)
    tensors = {f"weights/{k}": v for k, v in weights.items()}
    tensors.update(
        {
            "video": video,
            "latent": latent,
            "encoded": vae.encode([video])[0],
            "decoded": vae.decode([latent])[0],
        }
    )
    return tensors, {"dim": VAE_DIM}


class _StandInVae:
    """encode -> a stored image latent cut to the clip's latent frames; decode -> records the latent."""

    def __init__(self, latent):
        self.latent, self.decoded = latent, None

    def encode(self, videos):
        lat_f = (videos[0].shape[1] - 1) // 4 + 1
        return [self.latent[:, :lat_f].clone()]

    def decode(self, latents):
        self.decoded = latents[0].clone()
        return [self.decoded]


def _record_forwards(model, calls: list):
    """Wrap the model's forward: record every call's inputs and flow prediction. The camera arrives
    in upstream's param_dtype (bf16, as in a real run) and is cast to the fp32 weights' dtype."""
    real = model.forward

    def forward(x, t, context, seq_len, y=None, dit_cond_dict=None, **kw):
        cams = tuple(c.float() for c in dit_cond_dict["c2ws_plucker_emb"])
        out = real(x, t, context, seq_len, y=y, dit_cond_dict={"c2ws_plucker_emb": cams}, **kw)
        calls.append(
            {
                "t": t.clone(),
                "y": y[0].clone(),
                "cam": cams[0].clone(),
                "start": kw["current_start"],
                "out": out[0].clone(),
            }
        )
        return out

    model.forward = forward


def _chunk_inputs(seed: int, runs: dict, text_dim: int):
    """(lat_h, lat_w, the stand-in VAE's image latent for the longest run, the text context)."""
    g = torch.Generator().manual_seed(seed)
    lat_h, lat_w = FAST_IMAGE_HW[0] // 8, FAST_IMAGE_HW[1] // 8
    max_f = max((r["frame_num"] - 1) // 4 + 1 for r in runs.values())
    return (
        lat_h,
        lat_w,
        torch.randn(16, max_f, lat_h, lat_w, generator=g),
        torch.randn(5, text_dim, generator=g),
    )


def _chunk_loop(
    up, pipe_cls, state: dict, model, image_latent, context, run, chunk, tensors, name, **generate
):
    """One run of an upstream chunk loop (`pipe_cls.generate`, built without its __init__: `state` adds to the
    attributes both versions read) with stand-in text encoder and VAE; records every forward's flow, timestep
    and cache start and the final latent into `tensors` under `name`/. Returns (lat_f, y, cam) of the run."""
    calls = []
    _record_forwards(model, calls)
    pipe = object.__new__(pipe_cls)
    pipe.__dict__.update(
        **state,
        device=torch.device("cpu"),
        rank=0,
        t5_cpu=True,
        num_train_timesteps=1000,
        param_dtype=torch.bfloat16,
        pipe_dtype=torch.float32,
        local_attn_size=run["local_attn_size"],
        sink_size=run["sink_size"],
        vae_stride=(4, 8, 8),
        patch_size=(1, 2, 2),
        sp_size=1,
        model=model,
        vae=_StandInVae(image_latent),
        _t5_cache={},
        _cross_attn_initialized=False,
        text_encoder=lambda texts, device: [context],
        scheduler=up.unipc.FlowUniPCMultistepScheduler(
            num_train_timesteps=1000, shift=1, use_dynamic_shifting=False
        ),
    )
    img = np.zeros((*FAST_IMAGE_HW, 3), dtype=np.uint8)
    pipe.generate(
        "-",
        img,
        action_path=str(EXAMPLE),
        chunk_size=chunk,
        max_area=math.prod(FAST_IMAGE_HW),
        frame_num=run["frame_num"],
        seed=FAST_SEED,
        offload_model=False,
        max_sequence_length=model.text_len,
        **generate,
    )
    latent = pipe.vae.decoded
    lat_f = latent.shape[1]
    assert len(calls) == 5 * (lat_f // chunk), len(calls)  # 4 steps + the commit pass per chunk
    firsts = calls[::5]  # the first forward of each chunk
    tensors[f"{name}/latent"] = latent
    tensors[f"{name}/flows"] = torch.stack([c["out"] for c in calls])
    tensors[f"{name}/t"] = torch.stack([c["t"].reshape(()).double() for c in calls])
    tensors[f"{name}/start"] = torch.tensor([c["start"] for c in calls])
    print(f"{pipe_cls.__name__} {name}: latent {list(latent.shape)}, {len(calls)} forwards", flush=True)
    return lat_f, torch.cat([c["y"] for c in firsts], dim=1), torch.cat([c["cam"] for c in firsts], dim=2)


def _longest_y(conds) -> torch.Tensor:
    """One y kept: the longest run's (the others' are its prefixes)."""
    y_all = max((y for y, _ in conds), key=lambda y: y.shape[1])
    for y, _ in conds:
        assert torch.equal(y_all[:, : y.shape[1]], y)
    return y_all


@torch.no_grad()
def make_fast(up) -> tuple[dict, dict]:
    import importlib

    fast = importlib.import_module("wan.image2video_fast")
    model_fast = importlib.import_module("wan.modules.model_fast")
    config = {k: v for k, v in DIT_CONFIG.items() if k != "window_size"}
    weights = None
    lat_h, lat_w, image_latent, context = _chunk_inputs(22, FAST_RUNS, config["text_dim"])
    tensors, runs, conds = {"context": context}, [], []
    for name, run in FAST_RUNS.items():
        model = model_fast.WanModelFast(
            control_type="cam", local_attn_size=run["local_attn_size"], sink_size=run["sink_size"], **config
        ).eval()
        if weights is None:
            weights = _seeded_weights(model, 21)
        model.load_state_dict({k: v.float() for k, v in weights.items()})
        state = dict(control_type="cam")
        lat_f, y, cam = _chunk_loop(
            up, fast.WanI2VFast, state, model, image_latent, context, run, 3, tensors, name, shift=FAST_SHIFT
        )
        conds.append((y, cam))
        runs.append({"key": name, "lat_f": lat_f, "lat_h": lat_h, "lat_w": lat_w, **run})
    # each run's camera (the relative poses differ with the clip length), in bf16 as upstream fed it
    tensors["y"] = _longest_y(conds)
    for (_, cam), run in zip(conds, runs, strict=True):
        tensors[f"{run['key']}/cam"] = cam.to(torch.bfloat16)
        assert torch.equal(tensors[f"{run['key']}/cam"].float(), cam)
    tensors.update({f"weights/{k}": v for k, v in weights.items()})
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    return tensors, {"config": cfg, "runs": runs, "seed": FAST_SEED, "shift": FAST_SHIFT}


@torch.no_grad()
def make_v2(up) -> tuple[dict, dict]:
    """LingBot-World 2.0's chunk loop (`WanI2VCausal._generate_causal_fast` through `generate`) on a tiny
    v2 `WanModelFast`, for the 14B's and the 1.3B's schedules (see the module docstring)."""
    config = {k: v for k, v in DIT_CONFIG.items() if k != "window_size"}
    # the v1 Fast golden model's weights (same keys and shapes): read from fast.safetensors, not stored twice
    with safe_open(HERE / "fast.safetensors", "pt") as f:
        weights = {k.removeprefix("weights/"): f.get_tensor(k) for k in f.keys() if k.startswith("weights/")}
    lat_h, lat_w, image_latent, context = _chunk_inputs(32, V2_RUNS, config["text_dim"])
    tensors, runs, conds = {"context": context}, [], []
    for name, run in V2_RUNS.items():
        model = up.model_fast.WanModelFast(
            local_attn_size=run["local_attn_size"], sink_size=run["sink_size"], **config
        ).eval()
        model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
        lat_f, y, cam = _chunk_loop(
            up,
            up.i2v.WanI2VCausal,
            dict(infer_mode="causal_fast"),
            model,
            image_latent,
            context,
            run,
            V2_CHUNK,
            tensors,
            name,
            timesteps_index=list(V2_TIMESTEPS_INDEX),
            shift=run["shift"],
        )
        conds.append((y, cam))
        runs.append({"key": name, "lat_f": lat_f, "lat_h": lat_h, "lat_w": lat_w, **run})
    # the camera (bf16, as upstream fed it) as a seeded sample and float64 sums per run, as for
    # camera.safetensors: the pack builds its own.
    tensors["y"] = _longest_y(conds)
    gen = torch.Generator().manual_seed(33)
    for (_, cam), run in zip(conds, runs, strict=True):
        cam = cam.to(torch.bfloat16)
        idx = torch.randint(0, cam.numel(), (V2_CAMERA_SAMPLES,), generator=gen).unique()
        tensors[f"{run['key']}/cam_index"] = idx
        tensors[f"{run['key']}/cam_values"] = cam.flatten()[idx].clone()
        tensors[f"{run['key']}/cam_frame_sums"] = cam.sum(dim=(0, 1, 3, 4), dtype=torch.float64)
        tensors[f"{run['key']}/cam_channel_sums"] = cam.sum(dim=(0, 2, 3, 4), dtype=torch.float64)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    meta = {"config": cfg, "runs": runs, "seed": FAST_SEED, "chunk": V2_CHUNK, "weights": "fast.safetensors"}
    meta.update(timesteps_index=V2_TIMESTEPS_INDEX, image_hw=list(FAST_IMAGE_HW), upstream="2648877")
    return tensors, meta


def _save(name: str, tensors: dict, meta: dict):
    path = HERE / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"golden": json.dumps(meta)})
    print(f"wrote {path.name}: {path.stat().st_size / 1024:.0f} KiB", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, help="folder holding upstream v1's wan/ package")
    parser.add_argument("--upstream-v2", type=Path, help="folder holding upstream v2's wan/ package (for v2)")
    makers = {
        "unipc": make_unipc,
        "camera": make_camera,
        "dit": make_dit,
        "vae": make_vae,
        "fast": make_fast,
        "v2": make_v2,
    }
    parser.add_argument("--only", nargs="+", choices=tuple(makers), help="regenerate only these files")
    args = parser.parse_args(argv)
    names = args.only or list(makers)
    v1 = [n for n in names if n != "v2"]
    if v1 and args.upstream is None:
        parser.error(f"--upstream is needed for {' '.join(v1)}")
    if "v2" in names and args.upstream_v2 is None:
        parser.error("--upstream-v2 is needed for v2")
    warnings.filterwarnings("ignore", message=".*autocast.*")  # upstream's CUDA autocast blocks on CPU
    torch.set_grad_enabled(False)
    up = None
    for name in sorted(names, key=lambda n: n == "v2"):  # v2's modules take the same wan.* names: last
        if name == "v2":
            for mod in [m for m in sys.modules if m == "wan" or m.startswith("wan.")]:
                del sys.modules[mod]
            up = load_upstream(args.upstream_v2.resolve(), V2_MODULES)
        elif up is None:
            up = load_upstream(args.upstream.resolve())
        tensors, meta = makers[name](up)
        meta["generator"] = "tests/golden/make_golden.py"
        _save(f"{name}.safetensors", tensors, meta)


if __name__ == "__main__":
    main()
