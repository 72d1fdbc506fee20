"""`lingbot.py quantize`: one bf16/fp32 expert (the Fast model, a LingBot-World 2.0 DiT, an upstream
``high_noise_model/``, a single file) -> an NF4 folder in the community repack's exact format (its
``quantization_meta.json`` also records a v2 DiT's kind, so the NF4 folder is detected as one).

The source streams through `stream.load_expert(quantize=True)`, so the result is bit for bit what
loading the source with streaming quantization gives: each dense tensor cast to bf16 (upstream loads
with torch_dtype=bf16), Linear weights quantized from that bf16 value (NF4, blocksize 64, double
quant). The folder (``config.json``, ``model.safetensors`` with bitsandbytes' own Params4bit
serialisation, ``quantization_meta.json``) is written one tensor in host memory at a time into a
temporary folder beside the destination, then renamed into place: an error or Ctrl-C leaves nothing.

``format="fp8"`` writes the same three files with the DiT blocks' Linears as fp8 e4m3 codes plus one fp32
scale per output row (`wan.fp8`; ``<layer>.weight`` + ``<layer>.weight_scale``), everything else bf16:
what loading the source with ``quantize="fp8"`` gives (an NF4 source is dequantized layer by layer first).
"""

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .fast_checkpoint import DIFFUSERS_DIR, FAST_DIR, KIND_KEY, V2_DIR, fast_model_dir, known_kind
from .formats import CONFIG, NF4_META, NF4_WEIGHTS, CheckpointError, ExpertSource, detect_expert_format
from .monitor import RssSampler
from .stream import load_expert, release
from .synthetic import config_json, write_safetensors
from .tensor_file import exists

PARTIAL = ".partial-"
FORMATS = ("nf4", "fp8")
FP8_QUANT = {"format": "fp8_e4m3_rowwise", "weight": "float8_e4m3fn", "scale": "float32 per output row"}


@dataclass(frozen=True)
class QuantizeResult:
    dst: Path
    source: ExpertSource
    tensors: int
    nbytes: int  # model.safetensors
    seconds: float
    peak_rss: int  # anonymous RSS of this process at its highest
    rss_growth: int  # ... above where it started
    peak_vram: int | None  # CUDA only


def nf4_state(model) -> dict:
    """{name: tensor} of a loaded 4-bit model as bitsandbytes serialises Linear4bit (the repack's keys):
    '<layer>.weight' packed codes plus '<layer>.weight.absmax/quant_map/nested_*/quant_state.*'."""
    out = {}
    for name, p in model.named_parameters():
        qs = getattr(p, "quant_state", None)
        out[name] = p.data if qs is None else p.data.as_subclass(torch.Tensor)
        if qs is not None:
            out.update({f"{name}.{k}": v for k, v in qs.as_dict(packed=True).items()})
    return out


def _check_paths(src: ExpertSource, dst: Path, overwrite: bool) -> None:
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst.parent}: the destination's parent folder does not exist")
    src_dir = (src.path if src.path.is_dir() else src.path.parent).resolve()
    target = dst.resolve()
    if target == src_dir or src_dir.is_relative_to(target):
        raise ValueError(f"{dst}: the destination would replace the source {src.path}; give another folder")
    if src.kind != "single_safetensors" and target.is_relative_to(src_dir):  # a folder's files are the source
        raise ValueError(
            f"{dst}: the destination is inside the source folder {src.path}; give a folder outside it "
            f"(e.g. {src_dir.parent / (src_dir.name + '_nf4')})"
        )
    if exists(dst):
        if not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite to replace it")
        if not dst.is_dir() or (any(dst.iterdir()) and not (dst / NF4_WEIGHTS).is_file()):
            raise FileExistsError(
                f"{dst} exists and is not an NF4 expert folder ({NF4_WEIGHTS}); not replacing it"
            )


def _quant_meta(src: ExpertSource, nbytes: int, format: str = "nf4") -> dict:
    import bitsandbytes as bnb

    cfg = src.dit_config
    folder = src.path if src.path.is_dir() else src.path.parent
    dtypes = sorted({str(r.dtype).removeprefix("torch.") for r in src.tensors.values()})
    kind = known_kind(src)
    return {
        **({KIND_KEY: kind} if kind else {}),
        "source": {"ckpt_dir": str(folder.parent), "subfolder": folder.name, "dtypes": dtypes},
        "model_config": {k: v for k, v in asdict(cfg).items() if k != "control_type"},
        "quant": {**FP8_QUANT, "from_dtype": "bfloat16"}
        if format == "fp8"
        else {
            "format": "bnb_nf4",
            "double_quant": True,
            "compute_dtype": "bfloat16",
            "quant_type": "nf4",
            "blocksize": 64,
            "from_dtype": "bfloat16",
        },
        "files": {"weights": NF4_WEIGHTS, "config": CONFIG},
        "sizes": {
            "original_bytes": src.nbytes,
            "quantized_bytes": nbytes,
            "compression_ratio": round(src.nbytes / nbytes, 2),
        },
        "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_nf4_folder(model, src: ExpertSource, folder: Path, format: str = "nf4") -> tuple[int, int]:
    """config.json, model.safetensors and quantization_meta.json of a loaded 4-bit (format 'fp8': fp8) model
    into `folder`, one tensor copied to the host at a time; returns (tensor count, weight file bytes)."""
    state = nf4_state(model)
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
    nbytes = write_safetensors(
        folder / NF4_WEIGHTS, specs, lambda k: state[k].detach().to("cpu"), {"format": "pt"}
    )
    (folder / CONFIG).write_text(json.dumps(config_json(src.dit_config), indent=2))
    (folder / NF4_META).write_text(json.dumps(_quant_meta(src, nbytes, format), indent=2))
    return len(state), nbytes


def quantize_expert(source, dst, device=None, overwrite: bool = False, format: str = "nf4") -> QuantizeResult:
    """Quantize the expert at `source` (a path or ExpertSource) into the NF4 (format 'fp8': fp8) folder `dst`.

    device: where the weights are quantized (default CUDA when present, else CPU). Refuses an
    existing `dst` unless `overwrite`, a `dst` that is or holds the source, an fp8 source, and an NF4
    source for format 'nf4' (format 'fp8' dequantizes an NF4 source layer by layer).
    """
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {format!r}")
    if not isinstance(source, ExpertSource):
        source = detect_expert_format(
            fast_model_dir(source, (FAST_DIR, V2_DIR, DIFFUSERS_DIR)), require_config=False
        )
    if source.fp8_layers or (source.quantized and format == "nf4"):
        stored = "fp8" if source.fp8_layers else "4-bit"
        raise CheckpointError(
            f"{source.path}: already quantized ({stored} layers stored); quantize the original bf16/fp32 expert"
        )
    dst = Path(dst)
    _check_paths(source, dst, overwrite)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    tmp = dst.parent / f".{dst.name}{PARTIAL}{os.getpid()}"
    old = dst.parent / f".{dst.name}.replaced-{os.getpid()}"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        tmp.mkdir()
        with RssSampler() as rss:
            quantize = "fp8" if format == "fp8" else True
            model = load_expert(source, device, quantize=quantize, dtype=torch.bfloat16)
            try:
                count, nbytes = write_nf4_folder(model, source, tmp, format)
            finally:
                release(model)
                del model
        detect_expert_format(tmp)  # what was written loads (headers and layout checked)
        if exists(dst):
            dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if exists(old) and not exists(dst):
            old.rename(dst)
        raise
    peak_vram = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return QuantizeResult(
        dst, source, count, nbytes, time.perf_counter() - t0, rss.peak, rss.growth, peak_vram
    )
