"""Recognise and validate one DiT expert checkpoint from its headers alone (no weight is read).

Layouts accepted:
- ``nf4_folder``: the community NF4 repack (cahlen/lingbot-world-base-cam-nf4), ``config.json`` +
  ``model.safetensors`` (+ optional ``quantization_meta.json``); every Linear stored as bitsandbytes
  Params4bit components (``weight``, ``absmax``, ``quant_map``, ``nested_absmax``,
  ``nested_quant_map``, ``quant_state.bitsandbytes__nf4``), biases, norms, modulation and the
  Conv3d patch embedding in 16-bit.
- ``nf4_pt``: the same state dict in a ``model.pt``, as an earlier revision of that repack stored
  it (read with ``torch.load(weights_only=True, mmap=True)``, never unpickled otherwise).
- ``diffusers_folder``: upstream ``high_noise_model/``: ``config.json`` + ``diffusion_pytorch_model.safetensors``
  or shards listed by ``diffusion_pytorch_model.safetensors.index.json`` (or by ``model.safetensors.index.json``,
  as LingBot-World 2.0's 1.3B ships its config-less ``model-0000i-of-00006.safetensors``).
- ``single_safetensors``: one ``.safetensors`` file (ComfyUI ``models/diffusion_models/``).

Any of them may hold fp8 Linears (`wan.fp8`, as ``lingbot.py quantize --format fp8`` writes them in the
NF4 folder's file names): ``<layer>.weight`` float8_e4m3fn [out, in] beside ``<layer>.weight_scale`` fp32
[out], one scale per output row.

The architecture (sizes, cam/act/plain variant) comes from tensor shapes, with ``config.json`` only
filling what shapes cannot tell (num_heads, eps, text_len) and checked against them. For 4-bit
layers the dense shape is the one in the ``quant_state`` JSON, not the packed tensor's.
"""

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from ..wan.config import A14B, CONTROL_CHANNELS, DiTConfig
from ..wan.dit import WanModel
from ..wan.fp8 import FP8, SCALE_SUFFIX
from .tensor_file import (  # noqa: F401 - re-exported: the expert format's readers live there
    MAX_HEADER_BYTES,
    ST_DTYPES,
    ST_NAMES,
    CheckpointError,
    TensorRef,
    check_dir,
    check_file,
    exists,
    file_error,
    load_torch_state,
    name_list,
    path_problem,
    read_safetensors_header,
)

NF4_WEIGHTS = "model.safetensors"
NF4_PT = "model.pt"
NF4_META = "quantization_meta.json"
CONFIG = "config.json"
DIFFUSERS_SINGLE = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
MODEL_INDEX = "model.safetensors.index.json"  # Hugging Face's generic name (the v2 1.3B's flat repo)
SHARD_INDEXES = (DIFFUSERS_INDEX, MODEL_INDEX)
EXPERT_DIRS = {
    "high": ("high_noise_model_bnb_nf4", "high_noise_model"),
    "low": ("low_noise_model_bnb_nf4", "low_noise_model"),
}

DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# bitsandbytes Params4bit serialisation: suffixes after "<layer>.weight."
QS_PREFIX = "quant_state.bitsandbytes__"
QUANT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
NESTED_FIELDS = ("nested_blocksize", "nested_dtype", "nested_offset")
# Prefixes some single-file exports put before the original key names.
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


@dataclass(frozen=True)
class QuantLayer:
    """One bitsandbytes 4-bit Linear weight: its component tensors and parsed quant_state JSON."""

    module: str  # e.g. "blocks.0.self_attn.q"
    parts: dict  # component ("weight", "absmax", ..., "quant_state") -> tensor name
    state: dict  # the JSON (quant_type, blocksize, dtype, shape, nested_*)
    state_bytes: bytes  # the raw JSON bytes, handed to QuantState.from_dict as bnb stores them
    shape: tuple  # dense (out_features, in_features)


@dataclass
class ExpertSource:
    """A validated expert checkpoint, ready for `loaders.stream.load_expert`."""

    kind: str  # 'nf4_folder' | 'nf4_pt' | 'diffusers_folder' | 'single_safetensors'
    path: Path
    files: list
    config: dict  # config.json as stored (or the file's metadata config), {} when none
    dit_config: DiTConfig
    tensors: dict  # name -> TensorRef, every stored tensor
    quant_layers: dict = field(default_factory=dict)  # module name -> QuantLayer
    quantization_meta: dict | None = None
    pt_state: dict | None = None  # nf4_pt: the mmap-backed state dict
    fp8_layers: frozenset = frozenset()  # Linear module names stored as fp8 codes + row scales (wan.fp8)

    @property
    def control_type(self) -> str | None:
        return self.dit_config.control_type

    @property
    def quantized(self) -> bool:
        """Whether Linear weights are stored quantized (NF4 or fp8)."""
        return bool(self.quant_layers or self.fp8_layers)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def largest_tensor_bytes(self) -> int:
        return max(t.nbytes for t in self.tensors.values())


# ----------------------------------------------------------------------------- files and folders


def read_bytes(ref: TensorRef, pt_state: dict | None = None) -> bytes:
    """The raw bytes of one (small) stored tensor."""
    if ref.start < 0:
        return pt_state[ref.key].contiguous().view(torch.uint8).numpy().tobytes()
    try:
        with open(ref.file, "rb") as f:
            f.seek(ref.start)
            data = f.read(ref.end - ref.start)
    except OSError as e:
        raise file_error(ref.file, "checkpoint file", e) from None
    if len(data) != ref.end - ref.start:
        raise CheckpointError(f"{ref.file}: truncated while reading tensor {ref.key!r}")
    return data


def _read_json(path: Path, what: str = "JSON file") -> dict:
    check_file(path, what)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise file_error(path, what, e) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _weight_map(index_path: Path) -> dict:
    """The index's {tensor name: shard file name}, checked to be one."""
    weight_map = _read_json(index_path, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and Path(v).name == v for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index_path}: 'weight_map' must map tensor names to shard file names in the same folder"
        )
    return weight_map


def _lacks(path: Path) -> list[str]:
    """[] when `path` is a readable file, else one entry: the path and, unless simply absent, what it is."""
    problem = path_problem(path)
    if problem is None:
        return []
    return [str(path) if problem == "not found" else f"{path} ({problem})"]


def folder_missing(folder: Path, need_config: bool = True) -> list[str] | None:
    """What a folder lacks to be a complete expert (missing or unreadable files), or None when it
    is no expert folder at all. A file that is there but unusable (a folder, a symlink loop, no
    read permission) counts as there, and is listed with what is wrong with it. need_config False:
    a config.json is optional (checked only when present)."""

    def config():
        cfg = folder / CONFIG
        return _lacks(cfg) if need_config or exists(cfg) else []

    for name in (NF4_WEIGHTS, NF4_PT):
        if exists(folder / name):
            return _lacks(folder / name) + config()
    index = shard_index(folder)
    if index is not None:
        missing = config()
        if path_problem(index) is not None:
            return missing + _lacks(index)
        shards = sorted(set(_weight_map(index).values()))
        return missing + [entry for s in shards for entry in _lacks(folder / s)]
    if exists(folder / DIFFUSERS_SINGLE):
        return config() + _lacks(folder / DIFFUSERS_SINGLE)
    return None


def shard_index(folder: Path) -> Path | None:
    """The folder's shard index (diffusers' name first), or None."""
    return next((folder / n for n in SHARD_INDEXES if exists(folder / n)), None)


def find_experts(ckpt_dir) -> dict:
    """{'high': Path, 'low': Path} for an upstream or NF4-repack checkpoint directory.

    Takes ``<role>_noise_model_bnb_nf4/`` when complete, else upstream's ``<role>_noise_model/``.
    Every missing or unreadable file or folder is listed in one FileNotFoundError.
    """
    root = check_dir(ckpt_dir, "checkpoint directory")
    found, missing = {}, []
    for role, names in EXPERT_DIRS.items():
        folders = [root / n for n in names if (root / n).is_dir()]
        complete = [f for f in folders if folder_missing(f) == []]
        if complete or folders:  # a complete one first, else the first present, with what it lacks
            folder = (complete or folders)[0]
            found[role] = folder
            lacks = folder_missing(folder)
            if lacks is None:
                weights = NF4_WEIGHTS if folder.name.endswith("_bnb_nf4") else DIFFUSERS_SINGLE
                lacks = [str(folder / weights)] + _lacks(folder / CONFIG)
            missing += lacks
        else:
            missing.append(
                f"{root / names[0]}/ ({CONFIG} + {NF4_WEIGHTS}) or {root / names[1]}/ "
                f"({CONFIG} + {DIFFUSERS_SINGLE} or {DIFFUSERS_INDEX} + shards)"
            )
    if missing:
        raise FileNotFoundError(f"{root}: incomplete checkpoint, missing: " + "; ".join(missing))
    return found


def _resolve(path: Path) -> tuple[str, list[Path], Path | None]:
    """(kind, weight files, config.json or None) for a folder or file path."""
    problem = path_problem(path)
    if problem is None:
        if path.suffix == ".safetensors":
            if path.name == NF4_WEIGHTS and exists(path.parent / CONFIG):
                return "nf4_folder", [path], path.parent / CONFIG
            if path.name == DIFFUSERS_SINGLE and exists(path.parent / CONFIG):
                return "diffusers_folder", [path], path.parent / CONFIG
            return "single_safetensors", [path], None
        if path.suffix in (".pt", ".pth"):
            return "nf4_pt", [path], path.parent / CONFIG
        raise CheckpointError(f"{path}: not a checkpoint file (expected .safetensors or .pt)")
    if not path.is_dir():
        raise file_error(path, "checkpoint file or folder")
    cfg = path / CONFIG
    for name, kind in ((NF4_WEIGHTS, "nf4_folder"), (NF4_PT, "nf4_pt")):
        if exists(path / name):
            return kind, [check_file(path / name, "expert weights file")], cfg
    index = shard_index(path)
    if index is not None:
        shards = sorted(set(_weight_map(index).values()))
        if not shards:
            raise CheckpointError(f"{index}: has no weight_map")
        missing = [str(path / s) for s in shards if not exists(path / s)]
        if missing:
            raise FileNotFoundError(f"{path}: missing shard files: " + ", ".join(missing))
        return "diffusers_folder", [check_file(path / s, "shard file") for s in shards], cfg
    if exists(path / DIFFUSERS_SINGLE):
        return "diffusers_folder", [check_file(path / DIFFUSERS_SINGLE, "expert weights file")], cfg
    raise FileNotFoundError(
        f"{path}: no expert weights found (looked for {NF4_WEIGHTS}, {NF4_PT}, {DIFFUSERS_INDEX}, "
        f"{MODEL_INDEX}, {DIFFUSERS_SINGLE})"
    )


def _strip_prefix(refs: dict) -> dict:
    for prefix in KEY_PREFIXES:
        if refs and all(k.startswith(prefix) for k in refs):
            return {k[len(prefix) :]: _renamed(r, k[len(prefix) :]) for k, r in refs.items()}
    return refs


def _renamed(ref: TensorRef, name: str) -> TensorRef:
    return TensorRef(name, ref.file, ref.key, ref.dtype, ref.shape, ref.start, ref.end)


def _load_pt(path: Path) -> tuple[dict, dict]:
    state = load_torch_state(
        path, "expert weights file", "model.pt holding only tensors, or model.safetensors"
    )
    refs = {k: TensorRef(k, path, k, v.dtype, tuple(v.shape)) for k, v in state.items()}
    return refs, state


# ----------------------------------------------------------------------------- quantized layers


def _parse_quant_layers(refs: dict, pt_state) -> dict:
    """Group Params4bit components by layer and check them completely against their JSON."""
    layers, stray = {}, []
    for name in refs:
        if f".weight.{QS_PREFIX}" in name:
            module, qs_type = name.split(f".weight.{QS_PREFIX}")
            if qs_type not in ("nf4", "fp4"):
                raise CheckpointError(f"{refs[name].file}: tensor {name}: unknown quant type {qs_type!r}")
            layers[module] = name
    for name in refs:
        for part in QUANT_PARTS:
            if name.endswith(f".weight.{part}") and name[: -len(f".weight.{part}")] not in layers:
                stray.append(name)
    if stray:
        first = refs[stray[0]].file
        raise CheckpointError(
            f"{first}: incomplete quantization components: {name_list(stray)} present but no "
            f"'<layer>.weight.{QS_PREFIX}nf4' tensor for their layer"
        )
    out = {}
    for module, qs_name in layers.items():
        ref = refs[qs_name]
        where = f"{ref.file}: tensor {qs_name}"
        if ref.dtype != torch.uint8 or len(ref.shape) != 1:
            raise CheckpointError(
                f"{where}: expected a 1-D uint8 JSON blob, got {ref.dtype} {list(ref.shape)}"
            )
        raw = read_bytes(ref, pt_state)
        try:
            state = json.loads(raw.decode("utf-8"))
            shape = tuple(int(s) for s in state["shape"])
            blocksize = int(state["blocksize"])
            qdtype = getattr(torch, str(state["dtype"]), None)
            if state["quant_type"] not in ("nf4", "fp4") or len(shape) != 2 or blocksize <= 0:
                raise ValueError(f"bad quant_type/shape/blocksize {state}")
            if not isinstance(qdtype, torch.dtype) or not qdtype.is_floating_point:
                raise ValueError(f"bad dtype {state['dtype']!r}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: corrupt quant_state JSON ({e})") from None
        nested = any(k in state for k in NESTED_FIELDS)
        parts = {
            "weight": f"{module}.weight",
            "quant_state": qs_name,
            "absmax": f"{module}.weight.absmax",
            "quant_map": f"{module}.weight.quant_map",
        }
        if nested:
            parts["nested_absmax"] = f"{module}.weight.nested_absmax"
            parts["nested_quant_map"] = f"{module}.weight.nested_quant_map"
            if not all(k in state for k in NESTED_FIELDS):
                raise CheckpointError(f"{where}: quant_state JSON lacks some of {NESTED_FIELDS}")
        missing = [t for t in parts.values() if t not in refs]
        extra = [f"{module}.weight.{p}" for p in QUANT_PARTS if f"{module}.weight.{p}" in refs]
        extra = [t for t in extra if t not in parts.values()]
        if missing or extra:
            raise CheckpointError(
                f"{ref.file}: incomplete quantization components for layer {module}: "
                + (f"missing {name_list(missing)}" if missing else "")
                + (
                    f"{'; ' if missing else ''}unexpected {name_list(extra)} (JSON says not nested)"
                    if extra
                    else ""
                )
            )
        _check_quant_shapes(parts, state, shape, nested, refs)
        out[module] = QuantLayer(module, parts, state, raw, shape)
    return out


def _check_quant_shapes(parts, state, shape, nested, refs):
    n = shape[0] * shape[1]
    blocks = math.ceil(n / int(state["blocksize"]))
    want = {
        "weight": (torch.uint8, ((n + 1) // 2, 1)),
        "absmax": (torch.uint8 if nested else torch.float32, (blocks,)),
        "quant_map": (torch.float32, (16,)),
    }
    if nested:
        want["nested_absmax"] = (torch.float32, (math.ceil(blocks / int(state["nested_blocksize"])),))
        want["nested_quant_map"] = (torch.float32, (256,))
    for part, (dtype, wshape) in want.items():
        ref = refs[parts[part]]
        numel_ok = math.prod(ref.shape) == math.prod(wshape)
        shape_ok = ref.shape == wshape or (part == "weight" and numel_ok and len(ref.shape) <= 2)
        if ref.dtype != dtype or not shape_ok:
            raise CheckpointError(
                f"{ref.file}: tensor {parts[part]}: expected {dtype} {list(wshape)} for a "
                f"{list(shape)} layer (blocksize {state['blocksize']}), got {ref.dtype} {list(ref.shape)}"
            )


# ----------------------------------------------------------------------------- architecture


def _logical_shapes(refs: dict, quant: dict) -> dict:
    """Dense shape of every parameter-like tensor; 4-bit weights take their JSON shape."""
    owned = {t for q in quant.values() for t in q.parts.values()}
    shapes = {k: r.shape for k, r in refs.items() if k not in owned}
    shapes.update({f"{m}.weight": q.shape for m, q in quant.items()})
    return shapes


def infer_dit_config(shapes: dict, config: dict, where: str) -> DiTConfig:
    """DiTConfig from tensor shapes, config.json filling only what shapes cannot tell.

    Raises CheckpointError where config.json holds a value of the wrong kind or disagrees with the
    tensors.
    """
    _check_config_values(config, where)
    found, basis = {}, {}

    def take(name, key, value):
        if key in shapes:
            found[name], basis[name] = value(shapes[key]), key

    take("dim", "patch_embedding.weight", lambda s: s[0])
    take("in_dim", "patch_embedding.weight", lambda s: s[1])
    take("patch_size", "patch_embedding.weight", lambda s: tuple(s[2:]))
    take("ffn_dim", "blocks.0.ffn.0.weight", lambda s: s[0])
    take("freq_dim", "time_embedding.0.weight", lambda s: s[1])
    take("text_dim", "text_embedding.0.weight", lambda s: s[1])
    blocks = {int(k.split(".")[1]) for k in shapes if k.startswith("blocks.") and k.split(".")[1].isdigit()}
    if blocks:
        found["num_layers"], basis["num_layers"] = max(blocks) + 1, f"blocks.0..{max(blocks)}"
    if blocks or "blocks.0.self_attn.q.weight" in shapes:
        found["qk_norm"] = "blocks.0.self_attn.norm_q.weight" in shapes
        basis["qk_norm"] = "blocks.0.self_attn.norm_q.weight (present or not)"
        found["cross_attn_norm"] = "blocks.0.norm3.weight" in shapes
        basis["cross_attn_norm"] = "blocks.0.norm3.weight (present or not)"
    patch = found.get("patch_size", tuple(config.get("patch_size", A14B.patch_size)))
    if "head.head.weight" in shapes and math.prod(patch):
        rows = shapes["head.head.weight"][0]
        found["out_dim"], basis["out_dim"] = rows // math.prod(patch), "head.head.weight"
    cam_key = "patch_embedding_wancamctrl.weight"
    if cam_key in shapes:
        cin = shapes[cam_key][1]
        kinds = {c * math.prod(patch): k for k, c in CONTROL_CHANNELS.items()}
        if cin not in kinds:
            raise CheckpointError(
                f"{where}: tensor {cam_key} has {cin} in-features; expected "
                + " or ".join(f"{n} ({k})" for n, k in kinds.items())
            )
        found["control_type"] = kinds[cin]
    elif "patch_embedding.weight" in shapes:
        found["control_type"] = None
    basis["control_type"] = f"{cam_key} in-features (absent = plain Wan2.2 i2v)"

    values = {}
    for f in fields(DiTConfig):
        stated = config.get(f.name)
        if isinstance(stated, list):
            stated = tuple(stated)
        if f.name in found:
            if f.name in config and stated != found[f.name]:
                raise CheckpointError(
                    f"{where}: config says {f.name}={config[f.name]!r} but the tensors give "
                    f"{found[f.name]!r} (from {basis[f.name]})"
                )
            values[f.name] = found[f.name]
        else:
            values[f.name] = stated if f.name in config else getattr(A14B, f.name)
    if "num_heads" not in config:  # Wan uses 128-wide heads at every size
        if values["dim"] % 128:
            raise CheckpointError(
                f"{where}: num_heads is not stated and dim {values['dim']} is no multiple of 128"
            )
        values["num_heads"] = values["dim"] // 128
    try:
        _layout(DiTConfig(**values))  # the model's own argument checks
    except (ValueError, TypeError, ArithmeticError) as e:
        raise CheckpointError(f"{where}: unusable architecture ({e})") from None
    return DiTConfig(**values)


def _check_config_values(config: dict, where: str) -> None:
    """Each DiTConfig field config.json states has the kind of value the model takes."""
    for f in fields(DiTConfig):
        if f.name not in config:
            continue
        value, default = config[f.name], f.default
        if f.name == "control_type":
            ok, want = (
                value is None or value in CONTROL_CHANNELS,
                f"null or one of {sorted(CONTROL_CHANNELS)}",
            )
        elif isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, want = type(value) is int and value > 0, "a positive integer"
        elif isinstance(default, float):
            ok = type(value) in (int, float) and 0 < value < math.inf
            want = "a positive number"
        elif isinstance(default, tuple):
            ok = isinstance(value, list) and len(value) == len(default)
            ok = ok and all(type(v) is int and (v > 0 or f.name == "window_size") for v in value)
            want = (
                f"a list of {len(default)} {'integers' if f.name == 'window_size' else 'positive integers'}"
            )
        else:
            ok, want = isinstance(value, type(default)), f"a {type(default).__name__}"
        if not ok:
            raise CheckpointError(f"{where}: config {f.name}={value!r:.80} is not {want}")


@contextmanager
def skip_init():
    """Weight init is pointless on meta tensors and costs ~0.5 s of Python for A14B."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.modules.conv._ConvNd)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def meta_model(cfg: DiTConfig) -> WanModel:
    """The model's structure on the meta device: no memory, no init."""
    with torch.device("meta"), skip_init():
        return WanModel.from_config(cfg)


@lru_cache(maxsize=8)
def _layout(cfg: DiTConfig) -> tuple:
    model = meta_model(cfg)
    linears = {
        n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    params = {
        n: tuple(p.shape)
        for n, p in model.named_parameters()
        if not (n.endswith(".weight") and n[: -len(".weight")] in linears)
    }
    return params, linears


def expected_layout(cfg: DiTConfig) -> tuple[dict, dict]:
    """({param name: shape} without Linear weights, {Linear module name: (out, in)}) of a model."""
    params, linears = _layout(cfg)
    return dict(params), dict(linears)


def _fp8_layers(refs: dict) -> frozenset:
    """The modules stored as fp8 codes + row scales; each code tensor with its fp32 [out] scale."""
    scales = {k[: -len(".weight" + SCALE_SUFFIX)] for k in refs if k.endswith(".weight" + SCALE_SUFFIX)}
    codes = {k[: -len(".weight")] for k, r in refs.items() if k.endswith(".weight") and r.dtype == FP8}
    bad = [f"{m}.weight{SCALE_SUFFIX} (no fp8 {m}.weight)" for m in sorted(scales - codes)]
    bad += [f"{m}.weight (fp8 without {m}.weight{SCALE_SUFFIX})" for m in sorted(codes - scales)]
    for m in sorted(scales & codes):
        ref, rows = refs[f"{m}.weight{SCALE_SUFFIX}"], refs[f"{m}.weight"].shape[:1]
        if ref.dtype != torch.float32 or ref.shape != rows:
            bad.append(f"{ref.name} ({ref.dtype} {list(ref.shape)}, expected float32 {list(rows)})")
    if bad:
        first = next(iter(refs.values())).file
        raise CheckpointError(f"{first}: incomplete fp8 layers: {name_list(bad)}")
    return frozenset(codes)


def _check_layout(cfg: DiTConfig, refs: dict, quant: dict, where: str, fp8=frozenset()) -> None:
    params, linears = expected_layout(cfg)
    missing, wrong_shape, wrong_dtype, used = [], [], [], set()
    for module, shape in linears.items():
        if module in fp8:
            used.add(f"{module}.weight{SCALE_SUFFIX}")
        if module not in quant:
            params[f"{module}.weight"] = shape
            continue
        used.update(quant[module].parts.values())
        if quant[module].shape != shape:
            wrong_shape.append(
                f"{module}.weight (quant_state shape {list(quant[module].shape)}, expected {list(shape)})"
            )
    for name, shape in params.items():
        ref = refs.get(name)
        if ref is None:
            missing.append(name)
            continue
        used.add(name)
        if ref.shape != shape:
            wrong_shape.append(f"{name} ({list(ref.shape)}, expected {list(shape)})")
        if ref.dtype not in DENSE_DTYPES and not (ref.dtype == FP8 and name[: -len(".weight")] in fp8):
            wrong_dtype.append(f"{name} ({ref.dtype}, expected float16/bfloat16/float32)")
    unexpected = [k for k in refs if k not in used]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {name_list(missing)}")
    if unexpected:
        hint = ""
        if any(".attn1." in k or k.startswith("condition_embedder.") for k in unexpected):
            hint = " (diffusers WanTransformer3DModel naming; expected the original Wan key names)"
        problems.append(f"unexpected keys ({len(unexpected)}): {name_list(unexpected)}{hint}")
    if wrong_shape:
        problems.append(f"shape mismatch ({len(wrong_shape)}): {name_list(wrong_shape)}")
    if wrong_dtype:
        problems.append(f"dtype mismatch ({len(wrong_dtype)}): {name_list(wrong_dtype)}")
    if problems:
        variant = cfg.control_type or "plain"
        raise CheckpointError(
            f"{where}: does not match a {variant} WanModel (dim {cfg.dim}, {cfg.num_layers} blocks): "
            + "; ".join(problems)
        )


def _check_quant_meta(meta: dict, cfg: DiTConfig, quant: dict, path: Path) -> None:
    for section in ("model_config", "quant"):
        if not isinstance(meta.get(section) or {}, dict):
            raise CheckpointError(f"{path}: '{section}' is not a JSON object")
    for key, value in (meta.get("model_config") or {}).items():
        if key in DiTConfig.__dataclass_fields__:
            ours = getattr(cfg, key)
            if (tuple(value) if isinstance(value, list) else value) != ours:
                raise CheckpointError(
                    f"{path}: model_config {key}={value!r} disagrees with the tensors ({ours!r})"
                )
    block = meta.get("quant") or {}
    states = [q.state for q in quant.values()]
    if not states:
        return
    checks = {
        "quant_type": lambda s: s["quant_type"],
        "blocksize": lambda s: int(s["blocksize"]),
        "double_quant": lambda s: "nested_offset" in s,
    }
    for key, get in checks.items():
        if key in block and any(get(s) != block[key] for s in states):
            raise CheckpointError(f"{path}: quant {key}={block[key]!r} disagrees with the stored quant_state")


# ----------------------------------------------------------------------------- entry point


def detect_expert_format(path, require_config: bool = True) -> ExpertSource:
    """Identify, read headers of and fully validate one expert checkpoint (no weights are read).

    ``path``: an expert folder (NF4 repack or diffusers layout), a ``model.safetensors`` /
    ``model.pt`` inside one, or a single ``.safetensors`` file. Raises FileNotFoundError or
    CheckpointError (a ValueError) naming the file and tensors at fault.
    require_config: False accepts a folder without ``config.json`` (LingBot-World-Fast ships none):
    the architecture then comes from the tensor shapes alone, num_heads as dim / 128 and text_len,
    eps and the rest as the A14B config's.
    """
    path = Path(path)
    kind, files, cfg_path = _resolve(path)
    if not require_config and cfg_path is not None and not exists(cfg_path):
        cfg_path = None
    config = (
        _read_json(cfg_path, f"expert config (the {kind} layout needs it)") if cfg_path is not None else {}
    )

    refs, pt_state, metadata = {}, None, {}
    if kind == "nf4_pt":
        refs, pt_state = _load_pt(files[0])
    else:
        for f in files:
            file_refs, meta = read_safetensors_header(f)
            metadata = metadata or meta
            for k, r in file_refs.items():
                if k in refs:
                    raise CheckpointError(f"{f}: tensor {k!r} also stored in {refs[k].file}")
                refs[k] = r
        index = shard_index(files[0].parent) if kind == "diffusers_folder" else None
        if index is not None and index.is_file():
            _check_index(index, refs)
    refs = _strip_prefix(refs)
    if kind == "single_safetensors" and "config" in metadata:
        try:
            config = json.loads(metadata["config"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{files[0]}: metadata 'config' is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{files[0]}: metadata 'config' is not a JSON object")
    where = str(cfg_path) if cfg_path is not None else str(files[0])
    if not refs:
        raise CheckpointError(f"{files[0]}: holds no tensors")

    quant = _parse_quant_layers(refs, pt_state)
    fp8 = _fp8_layers(refs)
    shapes = {
        k: v for k, v in _logical_shapes(refs, quant).items() if not k.endswith(".weight" + SCALE_SUFFIX)
    }
    cfg = infer_dit_config(shapes, config, f"{where} (with {files[0].name})")
    _check_layout(cfg, refs, quant, str(files[0]) if len(files) == 1 else str(path), fp8)
    meta = None
    meta_path = (cfg_path.parent if cfg_path is not None else files[0].parent) / NF4_META
    if kind.startswith("nf4") and meta_path.is_file():
        meta = _read_json(meta_path, NF4_META)
        _check_quant_meta(meta, cfg, quant, meta_path)
    return ExpertSource(kind, path, files, config, cfg, refs, quant, meta, pt_state, fp8)


def _check_index(index_path: Path, refs: dict) -> None:
    weight_map = _weight_map(index_path)
    absent = [k for k, shard in weight_map.items() if k not in refs or refs[k].file.name != Path(shard).name]
    unlisted = [k for k in refs if k not in weight_map]
    if absent or unlisted:
        raise CheckpointError(
            f"{index_path}: disagrees with its shards: "
            + (f"listed but not in the named shard: {name_list(absent)}" if absent else "")
            + ("; " if absent and unlisted else "")
            + (f"in a shard but not listed: {name_list(unlisted)}" if unlisted else "")
        )
