"""Random expert checkpoints in every layout `formats.detect_expert_format` accepts.

For tests, the CLI demo and benchmarks: no real weights can be downloaded here. Key names,
dtypes, tensor order in the file and config files follow the real checkpoints:
- `write_nf4_expert`: the community NF4 repack (``config.json``, ``model.safetensors``,
  ``quantization_meta.json``; or the older ``model.pt``). ``mode="quantize"`` quantizes random
  bf16 weights with bitsandbytes' own ``Linear4bit`` and saves its ``state_dict()`` (authentic,
  small sizes); ``mode="random"`` writes random packed NF4 codes with plausible scales straight
  to disk, one tensor in RAM at a time (full A14B size at disk speed).
- `write_diffusers_expert`: upstream ``high_noise_model/`` (one file or shards + index).
- `write_v2_14b_dit`, `write_v2_1_3b`: LingBot-World 2.0's DiTs as released (``transformers/`` of the
  14B repo; the 1.3B's flat config-less shards).
- `write_single_safetensors`: one file as ComfyUI users keep in ``models/diffusion_models/``.

Dense values follow `wan.dit.init_random_`'s rules, seeded per tensor name, so the same seed
gives the same weights in every layout.
"""

import json
import math
import struct
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..wan.config import DiTConfig
from ..wan.dit import init_random_
from .formats import (
    CONFIG,
    DIFFUSERS_INDEX,
    DIFFUSERS_SINGLE,
    MODEL_INDEX,
    NF4_META,
    NF4_PT,
    NF4_WEIGHTS,
    ST_DTYPES,
    ST_NAMES,
    meta_model,
)

# config.json as upstream writes it: these DiTConfig fields are never saved (ignored for config).
UNSAVED_FIELDS = ("patch_size", "text_dim", "window_size", "qk_norm", "cross_attn_norm", "control_type")
NF4_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
ST_RANK = {dt: i for i, dt in enumerate(ST_DTYPES.values())}
POOL_BYTES = 64 << 20


def tiny_config(control_type: str | None = "cam", **overrides) -> DiTConfig:
    """A DiT small enough for CPU tests (head_dim 16)."""
    base = dict(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=32, text_len=32)
    return DiTConfig(**{**base, "control_type": control_type, **overrides})


def config_json(cfg: DiTConfig) -> dict:
    """The expert's config.json as upstream/the NF4 repack store it."""
    saved = {k: v for k, v in asdict(cfg).items() if k not in UNSAVED_FIELDS}
    return {"_class_name": "WanModel", "_diffusers_version": "0.36.0", **saved}


def model_specs(cfg: DiTConfig) -> tuple[dict, set]:
    """({param name: shape} of the model, {names of nn.Linear modules})."""
    model = meta_model(cfg)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, linears


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class _One:
    """Stand-in module holding one named tensor, so `init_random_` fills it by its name's rule."""

    def __init__(self, name, tensor):
        self.items = [(name, tensor)]

    def named_parameters(self):
        return self.items


def random_tensor(name: str, shape: tuple, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The value of parameter `name` for `seed`, identical in every layout."""
    t = torch.empty(shape, dtype=torch.float32)
    init_random_(_One(name, t), seed=_seed(seed, name))
    return t.to(dtype)


# ----------------------------------------------------------------------------- streaming writer


def write_safetensors(path, specs: dict, fill, metadata: dict | None = None) -> int:
    """Write a safetensors file holding one tensor in memory at a time; returns its size.

    specs: {name: (dtype, shape)}; fill(name) -> that tensor. Tensors are laid out as
    `safetensors.torch.save_file` does (dtype descending, then name), the header padded to 8 bytes.
    """
    order = sorted(specs, key=lambda k: (-ST_RANK[specs[k][0]], k))
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for k in order:
        dtype, shape = specs[k]
        n = math.prod(shape) * dtype.itemsize
        header[k] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in order:
            t = fill(k)
            if t.dtype != specs[k][0] or tuple(t.shape) != tuple(specs[k][1]):
                raise ValueError(f"fill({k!r}) gave {t.dtype} {list(t.shape)}, declared {specs[k]}")
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(raw) + offset


# ----------------------------------------------------------------------------- NF4


def _quantized_state(module: str, weight: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """bitsandbytes' own serialisation of one NF4 Linear (double quant, blocksize 64)."""
    import bitsandbytes as bnb

    out_f, in_f = weight.shape
    layer = bnb.nn.Linear4bit(
        in_f,
        out_f,
        bias is not None,
        compute_dtype=torch.bfloat16,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    layer.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=True,
        quant_type="nf4",
        module=layer,
    )
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    layer = layer.to("cpu")  # Params4bit quantizes on its first move to a real device
    return {f"{module}.{k}": v.as_subclass(torch.Tensor).clone() for k, v in layer.state_dict().items()}


class _BytePool:
    """Random bytes handed out as views; tensors take seeded windows of one 64 MiB pool."""

    def __init__(self, seed: int, size: int = POOL_BYTES):
        self.data = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))

    def take(self, n: int, name: str) -> torch.Tensor:
        if n > self.data.numel():
            return self.data.repeat(math.ceil(n / self.data.numel()))[:n]
        start = zlib.crc32(name.encode()) % (self.data.numel() - n + 1)
        return self.data[start : start + n]


def _random_nf4_parts(module: str, shape: tuple, seed: int) -> dict:
    """Shapes/dtypes/JSON of one packed NF4 weight as bnb stores it, with plausible scales:
    absmax (8-bit codes) dequantizes to about offset +- 50%, offset = 0.25 / sqrt(fan_in): a tenth of
    the block maximum of std 1/sqrt(fan_in) weights. Undamped, the random modulation gates and camera
    scales grow the residual ~200x per block and a 40-block model overflows."""
    import bitsandbytes.functional as bnb_f
    from bitsandbytes.utils import pack_dict_to_tensor

    n = shape[0] * shape[1]
    blocks = math.ceil(n / NF4_BLOCKSIZE)
    g = torch.Generator().manual_seed(_seed(seed, module))
    offset = 0.25 / math.sqrt(shape[1]) * (0.9 + 0.2 * torch.rand((), generator=g).item())
    nested_blocks = math.ceil(blocks / NESTED_BLOCKSIZE)
    state = {
        "quant_type": "nf4",
        "blocksize": NF4_BLOCKSIZE,
        "dtype": "bfloat16",
        "shape": list(shape),
        "nested_blocksize": NESTED_BLOCKSIZE,
        "nested_dtype": "float32",
        "nested_offset": offset,
    }
    w = f"{module}.weight"
    return {
        w: (torch.uint8, ((n + 1) // 2, 1)),
        f"{w}.absmax": (torch.uint8, (blocks,)),
        f"{w}.quant_map": bnb_f.get_4bit_type("nf4", device="cpu"),
        f"{w}.nested_absmax": 0.5 * offset * (1 + 0.1 * torch.rand(nested_blocks, generator=g)),
        f"{w}.nested_quant_map": bnb_f.create_dynamic_map().float(),
        f"{w}.quant_state.bitsandbytes__nf4": pack_dict_to_tensor(state),
    }


def write_nf4_expert(
    directory,
    cfg: DiTConfig,
    seed: int = 0,
    *,
    mode: str = "quantize",
    pt: bool = False,
    meta: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """An NF4 expert folder like ``high_noise_model_bnb_nf4/``; returns the folder.

    mode "quantize": bnb quantizes the `random_tensor` weights (every tensor in RAM; small
    configs). mode "random": packed codes from a random pool, streamed to disk (any size).
    pt: write the older ``model.pt`` (torch.save of the same state dict) instead of safetensors.
    dtype: stored dtype of the 16-bit tensors (biases, norms, modulation, patch_embedding).
    """
    if mode not in ("quantize", "random"):
        raise ValueError(f"mode must be 'quantize' or 'random', got {mode!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    params, linears = model_specs(cfg)
    dense = {k: s for k, s in params.items() if not (k.endswith(".weight") and k[:-7] in linears)}
    if mode == "quantize" or pt:
        state, pool = {k: random_tensor(k, s, seed, dtype) for k, s in dense.items()}, _BytePool(seed)
        for m in sorted(linears):
            w = f"{m}.weight"
            if mode == "quantize":
                state.update(
                    _quantized_state(m, random_tensor(w, params[w], seed, dtype), state.pop(f"{m}.bias"))
                )
            else:
                state.update(_materialise(_random_nf4_parts(m, params[w], seed), pool))
        if pt:
            torch.save(state, out / NF4_PT)
        else:
            from safetensors.torch import save_file

            save_file(state, out / NF4_WEIGHTS)
    else:
        pool = _BytePool(seed)
        specs, fixed = {k: (dtype, s) for k, s in dense.items()}, {}
        for m in linears:
            for k, v in _random_nf4_parts(m, params[f"{m}.weight"], seed).items():
                specs[k] = (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v
                if isinstance(v, torch.Tensor):
                    fixed[k] = v

        def fill(k):
            if k in fixed:
                return fixed[k]
            if k in dense:
                return random_tensor(k, dense[k], seed, dtype)
            return pool.take(math.prod(specs[k][1]), k).view(specs[k][1])

        write_safetensors(out / NF4_WEIGHTS, specs, fill)
    (out / CONFIG).write_text(json.dumps(config_json(cfg), indent=2))
    if meta:  # the repack's quantized_bytes is its weight file's size
        size = (out / (NF4_PT if pt else NF4_WEIGHTS)).stat().st_size
        (out / NF4_META).write_text(json.dumps(_quant_meta(cfg, params, size, pt), indent=2))
    return out


def _materialise(parts: dict, pool: _BytePool) -> dict:
    return {
        k: v if isinstance(v, torch.Tensor) else pool.take(math.prod(v[1]), k).view(v[1]).clone()
        for k, v in parts.items()
    }


def _quant_meta(cfg: DiTConfig, params: dict, nbytes: int, pt: bool) -> dict:
    import bitsandbytes as bnb

    original = 2 * sum(math.prod(s) for s in params.values())
    model_config = {k: v for k, v in asdict(cfg).items() if k != "control_type"}
    return {
        "source": {"ckpt_dir": "synthetic", "subfolder": "high_noise_model"},
        "model_config": model_config,
        "quant": {
            "format": "bnb_nf4",
            "double_quant": True,
            "compute_dtype": "bfloat16",
            "quant_type": "nf4",
        },
        "files": {"weights": NF4_PT if pt else NF4_WEIGHTS, "config": CONFIG},
        "sizes": {
            "original_bytes": original,
            "quantized_bytes": nbytes,
            "compression_ratio": round(original / nbytes, 2),
        },
        "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ----------------------------------------------------------------------------- dense layouts


def write_diffusers_expert(
    directory,
    cfg: DiTConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    *,
    shard_prefix: str = "diffusion_pytorch_model",
    index: str = DIFFUSERS_INDEX,
    config: dict | None = None,
) -> Path:
    """Upstream's ``<role>_noise_model/``: config.json + ``diffusion_pytorch_model.safetensors``,
    or `shards` files ``<shard_prefix>-0000i-of-0000n.safetensors`` and their `index`.
    config: what config.json holds (default `config_json(cfg)`; {} writes none)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    params, _ = model_specs(cfg)
    names = list(params)
    sizes = [math.prod(params[k]) * dtype.itemsize for k in names]
    total = sum(sizes)
    if shards <= 1:
        groups = {DIFFUSERS_SINGLE: names}
    else:  # consecutive runs of about total/shards bytes, as diffusers' max_shard_size splits; none empty
        groups, acc, i = {}, 0, 0
        for left, (k, n) in enumerate(zip(names, sizes, strict=True), start=-len(names)):
            i = max(min(shards - 1, acc * shards // total, i + 1), i, shards + left)
            groups.setdefault(f"{shard_prefix}-{i + 1:05d}-of-{shards:05d}.safetensors", []).append(k)
            acc += n
    for file, keys in groups.items():
        specs = {k: (dtype, params[k]) for k in keys}
        write_safetensors(
            out / file, specs, lambda k: random_tensor(k, params[k], seed, dtype), {"format": "pt"}
        )
    if shards > 1:
        index_name, index = (
            index,
            {
                "metadata": {"total_size": total},
                "weight_map": {k: f for f, ks in groups.items() for k in ks},
            },
        )
        (out / index_name).write_text(json.dumps(index, indent=2))
    config = config_json(cfg) if config is None else config
    if config:
        (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


# ----------------------------------------------------------------------------- LingBot-World 2.0


def v2_config_json(cfg: DiTConfig) -> dict:
    """The 14B's ``transformers/config.json``: upstream WanModelFast's registered arguments (diffusers
    leaves out its ignore_for_config: patch_size, cross_attn_norm, qk_norm, text_dim), with the CLI's
    window defaults it was saved with."""
    keep = (
        "model_type",
        "text_len",
        "in_dim",
        "dim",
        "ffn_dim",
        "freq_dim",
        "out_dim",
        "num_heads",
        "num_layers",
    )
    saved = {k: getattr(cfg, k) for k in keep}
    return {
        "_class_name": "WanModelFast",
        "_diffusers_version": "0.35.1",
        **saved,
        "local_attn_size": -1,
        "sink_size": 0,
        "eps": cfg.eps,
    }


def write_v2_14b_dit(repo, cfg: DiTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """robbyant/lingbot-world-v2-14b-causal-fast's DiT in `repo`: ``transformers/`` with
    ``model-0000{1..8}-of-00008.safetensors``, their ``diffusion_pytorch_model.safetensors.index.json``
    and the WanModelFast ``config.json``; returns that folder. The repo root's text encoder, tokenizer
    (``google/umt5-xxl/``) and VAE are the caller's to place (any tiny ones); its root ``config.json``
    (content not seen) is not written: nothing here reads it."""
    return write_diffusers_expert(
        Path(repo) / "transformers",
        cfg,
        seed,
        dtype,
        shards=8,
        shard_prefix="model",
        config=v2_config_json(cfg),
    )


def write_v2_1_3b(folder, cfg: DiTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """robbyant/lingbot-world-v2-1.3b-causal-fast: the DiT alone, flat, stored fp32:
    ``model-0000{1..6}-of-00006.safetensors`` + ``model.safetensors.index.json``, no config.json (the
    architecture comes from the headers, num_heads as dim / 128) and no text encoder or VAE."""
    return write_diffusers_expert(
        folder, cfg, seed, dtype, shards=6, shard_prefix="model", index=MODEL_INDEX, config={}
    )


def write_single_safetensors(
    path,
    cfg: DiTConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    *,
    prefix: str = "",
    config_metadata: bool = True,
) -> Path:
    """One ``.safetensors`` file of the whole expert, keys optionally prefixed (e.g.
    ``model.diffusion_model.``). config_metadata: store config.json in the header's metadata
    (needed when num_heads is not dim/128)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    params, _ = model_specs(cfg)
    specs = {prefix + k: (dtype, s) for k, s in params.items()}
    metadata = {"format": "pt"}
    if config_metadata:
        metadata["config"] = json.dumps(config_json(cfg))
    write_safetensors(
        path, specs, lambda k: random_tensor(k[len(prefix) :], specs[k][1], seed, dtype), metadata
    )
    return path
