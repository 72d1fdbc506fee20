"""Benchmark: umT5-XXL prompt encoding that frees itself, vs upstream's way of loading the encoder.

Writes a random umT5 encoder (upstream init distributions, bf16) under --workdir in the ComfyUI layout
(`umt5_xxl_bf16.safetensors`, Hugging Face T5 names, streamed tensor by tensor so RAM stays bounded) and
the upstream layout (`models_t5_umt5-xxl-enc-bf16.pth`, saved from an mmap of the first, no second copy
in RAM), plus a SYNTHETIC tokenizer (`tokenizer/tokenizer.json`): a hand-built unigram vocabulary of
256384 pieces (specials, characters incl. CJK, letter n-grams, fillers) standing in for google/umt5-xxl,
which cannot be downloaded here. Token counts therefore differ from the real tokenizer's; the compute
does not, since upstream always runs the padded 512 tokens.

Measured per layout, encoding the shipped example prompt and the upstream negative prompt:
- ours, mode=subprocess: wall time, the parent's peak RSS / RssAnon growth (sampled every 10 ms), the
  child's own peak VRAM and RSS from its report;
- ours, mode=inprocess: wall time, peak RSS growth, peak VRAM, and RAM/VRAM left after release;
- a cache hit through encode_prompts (no encoder load);
- baseline (upstream T5EncoderModel procedure, .pth only): dense fp32 build + random init, cast to bf16,
  torch.load without mmap + load_state_dict, move to device, encode.
All embeddings are checked equal across modes, layouts and the baseline.

    python benchmarks/bench_t5.py --scale tiny --workdir /tmp/bench_t5
    python benchmarks/bench_t5.py --scale full --workdir /data/bench_t5 --device cuda

Prints one JSON line at the end.
"""

import argparse
import gc
import itertools
import json
import string
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingbot import load_pack  # noqa: E402

load_pack()
from lingbot_world.loaders import text_encode as tx  # noqa: E402
from lingbot_world.loaders.formats import read_safetensors_header  # noqa: E402
from lingbot_world.loaders.monitor import RssSampler, rss_anon  # noqa: E402
from lingbot_world.loaders.text_encoder import hf_name, load_tokenizer, upstream_name  # noqa: E402
from lingbot_world.wan.config import NEGATIVE_PROMPT, T5_DTYPE  # noqa: E402
from lingbot_world.wan.t5 import UMT5_XXL, T5Encoder, encode_trimmed, init_random_, random_param  # noqa: E402

SCALES = {
    "full": UMT5_XXL,
    # full vocabulary (so the synthetic 256384-piece tokenizer fits), tiny everything else
    "tiny": dict(vocab=256384, dim=32, dim_attn=32, dim_ffn=64, num_heads=4, num_layers=2, num_buckets=32),
}
CHUNK_BYTES = 256 << 20  # fp32 rows generated at a time


def param_shapes(config: dict) -> dict:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in T5Encoder(**config).named_parameters()}


def write_random_safetensors(path: Path, config: dict, seed: int = 0) -> None:
    """Stream a bf16 HF-layout safetensors file; only one chunk of one tensor is in RAM at a time."""
    shapes = param_shapes(config)
    header, offset = {"__metadata__": {"format": "pt", "note": "random umT5 weights (benchmark)"}}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[hf_name(name)] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    g = torch.Generator().manual_seed(seed)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in shapes.items():
            rows = max(1, CHUNK_BYTES // (4 * int(np.prod(shape[1:], dtype=np.int64))))
            for start in range(0, shape[0], rows):
                chunk = random_param(name, (min(rows, shape[0] - start), *shape[1:]), config, g)
                f.write(chunk.to(torch.bfloat16).view(torch.uint8).numpy().data)
    tmp.replace(path)


def write_pth_from_safetensors(st_path: Path, pth_path: Path) -> None:
    """torch.save an upstream-named state dict whose tensors are views of an mmap of the safetensors."""
    refs, _ = read_safetensors_header(st_path)
    raw = np.memmap(st_path, dtype=np.uint8, mode="r")
    sd = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: never written
        for key, ref in refs.items():
            count = (ref.end - ref.start) // ref.dtype.itemsize
            sd[upstream_name(key)] = torch.frombuffer(
                raw, dtype=ref.dtype, count=count, offset=ref.start
            ).view(ref.shape)
    tmp = pth_path.with_suffix(".partial")
    torch.save(sd, tmp)
    tmp.replace(pth_path)


def write_synthetic_tokenizer(folder: Path, vocab: int) -> None:
    """A T5-style unigram tokenizer.json with exactly `vocab` pieces (<pad>=0, </s>=1, <unk>=2)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces, seen = [], set()

    def add(piece, score):
        if piece not in seen and len(pieces) < vocab:
            seen.add(piece)
            pieces.append((piece, score))

    for special in ("<pad>", "</s>", "<unk>"):
        add(special, 0.0)
    add("\u2581", -2.0)
    chars = [c for c in string.printable if not c.isspace()]
    chars += [chr(c) for c in range(0x4E00, 0x9FA6)] + list("，。、；：？！（）")
    for c in chars:
        add(c, -3.0)
        add("\u2581" + c, -2.5)
    for n in (2, 3, 4):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            add("\u2581" + "".join(letters), -1.0)
            add("".join(letters), -1.5)
    i = 0
    while len(pieces) < vocab:
        add(f"\u2581x{i}", -5.0)
        i += 1
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>", "eos_token": "</s>"}))
    (folder / "SYNTHETIC.txt").write_text("Synthetic benchmark tokenizer, not google/umt5-xxl.\n")


def memory_summary(mem: RssSampler) -> dict:
    """This process's RSS growth during a `with RssSampler() as mem:` block, and what stayed."""
    gc.collect()
    return dict(
        parent_peak_rss_growth_gb=round((mem.peak_total - mem.start_total) / 1e9, 3),
        parent_peak_rss_anon_growth_gb=round(mem.growth / 1e9, 3),
        parent_rss_anon_left_gb=round((rss_anon() - mem.start_bytes) / 1e9, 3),
    )


def gb(x) -> float:
    return round(x / 1e9, 3) if x else 0.0


def upstream_style(pth: Path, prompts: list, device: str, text_len: int, config: dict, tokenizer_dir: Path):
    """Upstream T5EncoderModel's procedure (dense fp32 init, bf16 cast, full torch.load, .to(device))."""
    dev = torch.device(device)
    tok = load_tokenizer(tokenizer_dir, text_len=text_len)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model = init_random_(T5Encoder(**config)).to(T5_DTYPE).eval().requires_grad_(False)
    model.load_state_dict(torch.load(pth, map_location="cpu", weights_only=True))
    model.to(dev)
    t1 = time.perf_counter()
    embs = []
    for p in prompts:
        ids, mask = tok([p])
        (e,) = encode_trimmed(model, ids.to(dev), mask.to(dev))
        embs.append(e.cpu().clone())
    vram_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return embs, dict(load_s=t1 - t0, encode_s=time.perf_counter() - t1, vram_peak=vram_peak)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_t5"))
    ap.add_argument("--device", default=None, help="default: cuda if available at full scale, else cpu")
    ap.add_argument("--layout", choices=["pth", "safetensors", "both"], default="both")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--no-baseline", action="store_true", help="skip the upstream-style baseline")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if args.scale == "full" and torch.cuda.is_available() else "cpu")
    config = SCALES[args.scale]
    work = args.workdir / args.scale
    work.mkdir(parents=True, exist_ok=True)
    st_path, pth_path = work / "umt5_xxl_bf16.safetensors", work / "models_t5_umt5-xxl-enc-bf16.pth"
    result = dict(bench="t5", scale=args.scale, device=device, config=config, text_len=args.text_len)
    if device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(device))

    t0 = time.perf_counter()
    if not st_path.is_file():
        write_random_safetensors(st_path, config)
    if args.layout != "safetensors" and not pth_path.is_file():
        write_pth_from_safetensors(st_path, pth_path)
    if not (work / "tokenizer" / "tokenizer.json").is_file():
        write_synthetic_tokenizer(work / "tokenizer", config["vocab"])
    result.update(prepare_s=round(time.perf_counter() - t0, 1), checkpoint_gb=gb(st_path.stat().st_size))
    result["tokenizer"] = "synthetic unigram, 256384 pieces" if config["vocab"] == 256384 else "synthetic"

    prompts = [(ROOT / "examples" / "00" / "prompt.txt").read_text(encoding="utf-8").strip(), NEGATIVE_PROMPT]
    layouts = {"pth": [pth_path], "safetensors": [st_path], "both": [pth_path, st_path]}[args.layout]
    reference, equal = None, True
    for path in layouts:
        name = "pth" if path.suffix == ".pth" else "safetensors"
        runs = {}
        for mode, fn in (("subprocess", tx.encode_in_subprocess), ("inprocess", tx.encode_in_process)):
            kw = dict(timeout=args.timeout) if mode == "subprocess" else {}
            gc.collect()
            with RssSampler(interval=0.01) as mem:
                t = time.perf_counter()
                embs, rep = fn(path, prompts, None, device, args.text_len, **kw)
                wall = time.perf_counter() - t
            runs[mode] = dict(
                wall_s=round(wall, 2),
                load_s=round(rep["load_s"], 2),
                encode_s=round(rep["encode_s"], 3),
                tokens=rep["tokens"],
                vram_peak_gb=gb(rep.get("vram_peak")),
                vram_left_gb=gb(rep.get("vram_after", 0) - rep.get("vram_before", 0)),
                **memory_summary(mem),
            )
            if mode == "subprocess":
                runs[mode]["child_peak_rss_gb"] = gb(rep.get("child_peak_rss"))
            reference = reference or embs
            equal &= all(torch.equal(a, b) for a, b in zip(reference, embs, strict=True))
        cache = work / "cache"
        tx.encode_prompts(
            path, prompts, None, device, "subprocess", cache, text_len=args.text_len, timeout=args.timeout
        )
        t = time.perf_counter()
        hit = tx.encode_prompts(path, prompts, None, device, "subprocess", cache, text_len=args.text_len)
        runs["cache_hit_s"] = round(time.perf_counter() - t, 3)
        equal &= all(torch.equal(a, b) for a, b in zip(reference, hit, strict=True))
        result[name] = runs

    if not args.no_baseline and pth_path.is_file():
        gc.collect()
        with RssSampler(interval=0.01) as mem:
            t = time.perf_counter()
            embs, rep = upstream_style(pth_path, prompts, device, args.text_len, config, work / "tokenizer")
            wall = time.perf_counter() - t
        result["baseline_upstream_style"] = dict(
            wall_s=round(wall, 2),
            load_s=round(rep["load_s"], 2),
            encode_s=round(rep["encode_s"], 3),
            vram_peak_gb=gb(rep["vram_peak"]),
            **memory_summary(mem),
        )
        equal &= all(torch.equal(a, b) for a, b in zip(reference, embs, strict=True))
    result["all_embeddings_equal"] = bool(equal)
    print(json.dumps(result))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
