"""Stream one expert checkpoint straight into a `WanModel` on the target device.

The model is built on the meta device, every nn.Linear swapped for a bitsandbytes Linear4bit
shell there (no dense weight, no init). Each stored tensor is then read with ``safe_open`` (a
zero-copy view of the file's pages) and placed on the device: on CUDA through two reused pinned
staging buffers and async copies, on CPU by one copy. 4-bit weights are rebuilt from their packed
components with bnb's own ``QuantState.from_dict``; bf16/fp32 Linear weights can be quantized to
NF4 (blocksize 64, double quant), or to fp8 with row scales (`wan.fp8`), one at a time as they arrive. Host memory above the start stays
within the staging buffers plus one tensor (for a CPU target, plus the model itself).
"""

import importlib
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from ..wan.config import DiTConfig
from ..wan.dit import WanModel
from ..wan.fp8 import SCALE_SUFFIX, dequantize_rows, fp8_layer, quantize_rows
from ..wan.lora import merge_into_weight
from .formats import (
    CheckpointError,
    ExpertSource,
    QuantLayer,
    detect_expert_format,
    expected_layout,
    meta_model,
    skip_init,
)
from .interrupts import InterruptGuard
from .monitor import free_memory, trim_heap

NF4_ARGS = dict(blocksize=64, compress_statistics=True, quant_type="nf4")
STAGING_BYTES = 64 << 20  # per buffer; two buffers alternate
QUANT_CHUNK = 1 << 18  # elements per CPU quantization step, a multiple of the blocksize
_ALIGN = 256


def preload_libraries() -> None:
    """Import bitsandbytes now (seconds: it registers its kernels with torch), for a caller that is waiting
    anyway (on the text encoder's child process). A failed import is left for the loader to report."""
    try:
        importlib.import_module("bitsandbytes")
    except Exception:  # noqa: BLE001 - the loader's own import raises it where it is needed
        pass


def build_expert_meta(
    cfg: DiTConfig, quantized=True, compute_dtype=torch.bfloat16, quant_type="nf4"
) -> WanModel:
    """The model on the meta device, no memory allocated.

    quantized: True (every nn.Linear becomes a bnb Linear4bit shell), False (none), or the set of
    Linear module names to swap. Shell weights stay meta until a loader assigns real Params4bit.
    """
    import bitsandbytes as bnb

    model = meta_model(cfg)
    chosen = (
        (lambda name: True) if quantized is True else (lambda name: bool(quantized) and name in quantized)
    )
    with torch.device("meta"), skip_init():
        for name, layer in list(model.named_modules()):
            if not isinstance(layer, nn.Linear) or not chosen(name):
                continue
            parent, _, child = name.rpartition(".")
            shell = bnb.nn.Linear4bit(
                layer.in_features,
                layer.out_features,
                layer.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type=quant_type,
                device="meta",
            )
            # bitsandbytes >= 0.50 repacks a layer's weight in place for its AVX512-BF16 CPU kernel on the
            # first CPU forward: that breaks layers narrower than a quant block and rewrites the stored NF4
            # layout that dequantizing, parking and the LoRA side path rely on. Keep the portable kernel.
            shell.support_avx512bf16_for_cpu = False
            setattr(model.get_submodule(parent), child, shell)
    return model


def release(model: nn.Module) -> None:
    """Free every weight of a loaded model (device and host), leaving meta placeholders."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
                )
        if hasattr(module, "quant_state"):
            module.quant_state = None
    if isinstance(model, WanModel):
        model._freqs = None
    free_memory()


class _Placer:
    """Copies CPU views (mmap'd file pages) into fresh tensors on the device.

    With staging, bytes go file pages -> pinned buffer -> async H2D copy; small tensors share a
    buffer, large ones go through in buffer-sized chunks; two buffers alternate so the host copy
    of one overlaps the DMA of the other. Without, a CPU target gets one plain copy.
    """

    def __init__(self, device: torch.device, staging_bytes: int | None):
        self.device = device
        if staging_bytes is None:
            staging_bytes = STAGING_BYTES if device.type == "cuda" else 0
        self.size = staging_bytes
        self.buffers, self.events, self.cur, self.used = [], [None, None], 0, 0
        if staging_bytes:
            pin = device.type == "cuda"
            self.buffers = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

    def place(self, view: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or view.dtype
        if not self.buffers:
            if self.device.type == "cpu" and dtype == view.dtype:
                return view.clone(memory_format=torch.contiguous_format)
            return view.to(self.device, dtype)
        out = torch.empty(view.shape, dtype=view.dtype, device=self.device)
        src = view.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        off, n = 0, src.numel()
        while off < n:
            if self.used >= self.size:
                self._switch()
            k = min(n - off, self.size - self.used)
            buf = self.buffers[self.cur][self.used : self.used + k]
            buf.copy_(src[off : off + k])
            dst[off : off + k].copy_(buf, non_blocking=self.device.type == "cuda")
            off += k
            self.used += -(-k // _ALIGN) * _ALIGN
        return out if dtype == out.dtype else out.to(dtype)

    def _switch(self):
        if self.device.type == "cuda":
            self.events[self.cur] = torch.cuda.Event()
            self.events[self.cur].record()
        self.cur, self.used = 1 - self.cur, 0
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()  # its previous copies are done; safe to overwrite

    def close(self):
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.buffers, self.events = [], [None, None]


def _stored_order(src: ExpertSource) -> list:
    """Every stored tensor, file by file, in on-disk order (sequential reads)."""
    by_file = defaultdict(list)
    for ref in src.tensors.values():
        by_file[ref.file].append(ref)
    return [r for f in src.files for r in sorted(by_file[Path(f)], key=lambda r: r.start)]


def _views(src: ExpertSource):
    """Yield (TensorRef, CPU view) in stored order; views of safetensors files are mmap'd pages."""
    if src.pt_state is not None:
        for ref in _stored_order(src):
            yield ref, src.pt_state[ref.key]
        return
    from safetensors import SafetensorError, safe_open

    refs = _stored_order(src)
    i = 0
    for file in map(Path, src.files):
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except SafetensorError as e:  # e.g. changed on disk since detection
            raise CheckpointError(f"{file}: unreadable ({e})") from None
        with handle as f:
            while i < len(refs) and refs[i].file == file:
                try:
                    view = f.get_tensor(refs[i].key)
                except SafetensorError as e:
                    raise CheckpointError(f"{file}: tensor {refs[i].key!r} unreadable ({e})") from None
                yield refs[i], view
                i += 1


def _params4bit(packed: torch.Tensor, qs):
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(
        packed.reshape(-1, 1),
        requires_grad=False,
        quant_state=qs,
        blocksize=qs.blocksize,
        compress_statistics=qs.nested,
        quant_type=qs.quant_type,
        quant_storage=packed.dtype,
        bnb_quantized=True,
    )


def _restore_quant_state(layer: QuantLayer, parts: dict, device: torch.device):
    """bitsandbytes' own deserialisation of one layer's stored components."""
    from bitsandbytes.functional import QuantState

    qs_key = layer.parts["quant_state"].rsplit(".weight.", 1)[1]
    qs_dict = {k: v for k, v in parts.items() if k != "weight"}
    qs_dict[qs_key] = torch.frombuffer(bytearray(layer.state_bytes), dtype=torch.uint8)
    return QuantState.from_dict(qs_dict, device=device)


def _set(model: nn.Module, name: str, value: torch.Tensor, quant_state=None) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if not isinstance(value, nn.Parameter):
        value = nn.Parameter(value, requires_grad=False)
    module._parameters[attr] = value
    if quant_state is not None:
        module.quant_state = quant_state


def quantize_nf4(weight: torch.Tensor, dtype: torch.dtype):
    """(packed, QuantState) equal to ``bnb.functional.quantize_4bit(weight.to(dtype), blocksize=64,
    compress_statistics=True, quant_type="nf4")``.

    On CPU, bnb's quantizer makes fp32/int32 copies worth ~20 bytes per element; running it over
    chunks of whole blocks (independent by construction) keeps that to a few MB, and reads a
    file-backed `weight` without first copying it whole.
    """
    import bitsandbytes.functional as bnb_f

    if weight.device.type != "cpu":
        return bnb_f.quantize_4bit(weight.to(dtype), quant_storage=torch.uint8, **NF4_ARGS)
    flat, n = weight.reshape(-1), weight.numel()
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8)
    absmax = torch.empty(-(-n // NF4_ARGS["blocksize"]), dtype=torch.float32)
    for start in range(0, n, QUANT_CHUNK):
        chunk = flat[start : start + QUANT_CHUNK].to(dtype)
        p, a = torch.ops.bitsandbytes.quantize_4bit.default(chunk, NF4_ARGS["blocksize"], "nf4", torch.uint8)
        packed[start // 2 : start // 2 + p.shape[0]] = p
        absmax[start // NF4_ARGS["blocksize"] :][: a.numel()] = a
        del chunk, p, a
    trim_heap()  # the temporaries' heap pages would otherwise pile up between persistent tensors
    # second level, as quantize_4bit(compress_statistics=True): 8-bit block scales around their mean
    offset = absmax.mean()
    qabsmax, state2 = bnb_f.quantize_blockwise(absmax - offset, blocksize=256)
    qs = bnb_f.QuantState(
        absmax=qabsmax,
        shape=weight.shape,
        dtype=dtype,
        blocksize=NF4_ARGS["blocksize"],
        code=bnb_f.get_4bit_type("nf4", device="cpu"),
        quant_type="nf4",
        offset=offset,
        state2=state2,
    )
    return packed, qs


def _load(
    src: ExpertSource,
    device: torch.device,
    quantize,
    dtype,
    compute_dtype,
    staging_bytes,
    check_interrupt=lambda: None,
    merge=(),
) -> WanModel:
    import bitsandbytes.functional as bnb_f

    _, linears = expected_layout(src.dit_config)
    stored_4bit = set(src.quant_layers)
    if quantize is False or quantize == "fp8":
        four_bit = set()
    elif quantize:
        four_bit = set(linears)
    else:
        four_bit = stored_4bit
    # fp8 codes + row scales: the blocks' Linears when asked for, else as stored (False: dense)
    fp8 = {m for m, shape in linears.items() if fp8_layer(m, shape)} if quantize == "fp8" else set()
    fp8 = fp8 | (set(src.fp8_layers) if quantize is None or quantize == "fp8" else set())
    # NF4 checkpoints keep each stored dtype; original bf16/fp32 experts are cast to `dtype`.
    dense_dtype = None if stored_4bit else dtype
    owner = {t: (m, part) for m, q in src.quant_layers.items() for part, t in q.parts.items()}
    scale_of = {f"{m}.weight{SCALE_SUFFIX}": m for m in src.fp8_layers}
    stored_fp8 = {}  # module -> codes or scale read so far, until its pair is complete

    def set_fp8(module, codes, scale):
        if module in fp8:
            _set(model, f"{module}.weight", codes)
            _set(model, f"{module}.weight{SCALE_SUFFIX}", scale)
        else:  # quantize=False: dense from the codes; quantize=True refused before loading
            _set(model, f"{module}.weight", dequantize_rows(codes, scale, dtype))

    model = build_expert_meta(src.dit_config, four_bit, compute_dtype)
    model.compute_dtype = compute_dtype
    placer = _Placer(device, staging_bytes)
    pending = defaultdict(dict)
    try:
        for ref, view in _views(src):
            check_interrupt()
            if ref.name in owner:
                module, part = owner[ref.name]
                if part == "quant_state":  # parsed at detection; handed over as bytes
                    continue
                pending[module][part] = placer.place(view)
                layer = src.quant_layers[module]
                if len(pending[module]) == len(layer.parts) - 1:
                    parts = pending.pop(module)
                    qs = _restore_quant_state(layer, parts, device)
                    if module in four_bit:
                        _set(model, f"{module}.weight", _params4bit(parts["weight"], qs), qs)
                    else:  # quantize False or 'fp8': dense weights from bnb's dequantization
                        dense = bnb_f.dequantize_4bit(parts["weight"].reshape(-1, 1), qs)
                        if module in fp8:
                            set_fp8(module, *quantize_rows(dense.to(qs.dtype)))
                        else:
                            _set(model, f"{module}.weight", dense.to(dtype or qs.dtype))
                        del dense
                    del parts, qs
            elif ref.name in scale_of or ref.name[:-7] in src.fp8_layers:  # stored fp8: codes and scale
                module = scale_of.get(ref.name, ref.name[:-7])
                stored_fp8.setdefault(module, {})[ref.name == f"{module}.weight"] = placer.place(view)
                if len(stored_fp8[module]) == 2:
                    pair = stored_fp8.pop(module)
                    set_fp8(module, pair[True], pair[False])
            elif ref.name.endswith(".weight") and ref.name[:-7] in four_bit:
                # the dense weight exists once, transiently: on the device, or (CPU) as file pages
                weight = view if device.type == "cpu" else placer.place(view)
                weight = merge_into_weight(ref.name, weight, merge)  # LoRAs merged before quantizing
                packed, qs = quantize_nf4(weight, dtype or view.dtype)
                del weight
                _set(model, ref.name, _params4bit(packed, qs), qs)
            elif ref.name.endswith(".weight") and ref.name[:-7] in fp8:  # from the `dtype` value, as NF4
                weight = merge_into_weight(ref.name, placer.place(view, dtype or view.dtype), merge)
                set_fp8(ref.name[:-7], *quantize_rows(weight))
                del weight
            else:
                target = dense_dtype if view.dtype.is_floating_point else None
                _set(model, ref.name, merge_into_weight(ref.name, placer.place(view, target), merge))
            del view
    finally:
        placer.close()
    if pending or stored_fp8:
        raise CheckpointError(
            f"{src.path}: incomplete quantized layers after loading: {sorted([*pending, *stored_fp8])}"
        )
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"{src.path}: no stored tensor for {left}")
    return model.eval().requires_grad_(False)


def load_expert(
    source,
    device=None,
    quantize: bool | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    staging_bytes: int | None = None,
    merge_loras=(),
) -> WanModel:
    """Load one expert into a `WanModel` on `device` (default: CUDA when present, else CPU).

    source: a path (anything `detect_expert_format` takes) or an ExpertSource.
    quantize: None keeps the stored form (NF4 stays 4-bit, bf16 stays dense); True quantizes
    dense Linear weights to NF4 while streaming (blocksize 64, double quant); False dequantizes
    4-bit weights to dense `dtype`; 'fp8' makes the DiT blocks' Linears fp8 codes with row scales
    (`wan.fp8`): from a bf16/fp32 expert quantized from the `dtype` value as it streams in, from an NF4 one
    by dequantizing each layer first (both errors add up), an fp8 folder as stored. An fp8 folder loads with
    None or 'fp8' as stored, with False dequantized; True (NF4 from fp8) is refused.
    dtype: dtype of dense weights from original (bf16/fp32) experts and the input of streaming
    quantization; NF4 checkpoints keep every stored 16-bit tensor as stored.
    staging_bytes: pinned staging buffer size for CUDA (default 64 MiB x 2; 0 copies straight
    from the file's pages).
    merge_loras: `wan.lora.Lora`s added into the dense tensors of an original (bf16/fp32) expert as
    they stream in, before quantization; an NF4 checkpoint's 4-bit weights cannot take them.

    The model is in eval mode with requires_grad False. Free it with `release(model)`. On any
    error everything allocated so far is freed before the exception propagates; an interrupt
    (Ctrl-C, or a SIGTERM handler that raises) always propagates as itself (see InterruptGuard).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    outer = sys.exc_info()[1]  # an exception the caller is handling: not ours to clear
    try:
        with InterruptGuard() as guard:
            if quantize not in (None, True, False, "fp8"):
                raise ValueError(f"quantize: expected None, True, False or 'fp8', got {quantize!r}")
            src = source if isinstance(source, ExpertSource) else detect_expert_format(source)
            guard.check()
            if merge_loras and src.quantized:
                raise ValueError(
                    f"{src.path}: LoRAs can be merged only into original bf16/fp32 experts quantized while "
                    f"loading; this expert is stored as {'fp8' if src.fp8_layers else 'NF4'} (use the LoRA "
                    "side path instead)"
                )
            if quantize is True and src.fp8_layers:
                raise CheckpointError(
                    f"{src.path}: stored as fp8; NF4 quantizing needs the original bf16/fp32 expert "
                    "(load this one as stored, or give the original)"
                )
            args = (
                src,
                device,
                quantize,
                dtype,
                compute_dtype,
                staging_bytes,
                guard.check,
                tuple(merge_loras),
            )
            if device.type == "cuda":
                with torch.cuda.device(device):
                    return _load(*args)
            return _load(*args)
    except BaseException as exc:
        # The traceback keeps every frame's locals (the half-built model, staged tensors) alive;
        # clear them so the memory goes back now, not when the caller drops the exception.
        clear_traceback_frames(exc, stop=outer)
        try:
            free_memory()
        except Exception:  # noqa: BLE001 - e.g. a CUDA fault; the original error matters more
            pass
        raise


def clear_traceback_frames(exc: BaseException, stop: BaseException | None = None) -> None:
    """Drop the locals of every frame in the tracebacks of `exc` and the exceptions chained to it
    (an interrupt re-raised by InterruptGuard carries the error it replaced), up to `stop`."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or e is stop or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
