"""umT5 encoder model, checkpoint loading (upstream .pth and ComfyUI safetensors) and tokenizer."""

import math

import pytest
import torch
import torch.nn.functional as F
from lingbot_world.loaders import text_encoder as te
from lingbot_world.loaders.synthetic_text import (
    TINY,
    spiece_model_bytes,
    upstream_state_dict,
    write_hf_safetensors,
    write_pth,
    write_tokenizer_json,
)
from lingbot_world.wan import t5
from safetensors.torch import load_file, save_file

# ---------------------------------------------------------------------------------------------------
# Names and shapes


def test_upstream_names_and_shapes_at_full_size():
    with torch.device("meta"):
        model = t5.T5Encoder(**t5.UMT5_XXL)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    block0 = {n.removeprefix("blocks.0."): s for n, s in shapes.items() if n.startswith("blocks.0.")}
    assert block0 == {
        "norm1.weight": (4096,),
        "attn.q.weight": (4096, 4096),
        "attn.k.weight": (4096, 4096),
        "attn.v.weight": (4096, 4096),
        "attn.o.weight": (4096, 4096),
        "norm2.weight": (4096,),
        "ffn.gate.0.weight": (10240, 4096),
        "ffn.fc1.weight": (10240, 4096),
        "ffn.fc2.weight": (4096, 10240),
        "pos_embedding.embedding.weight": (32, 64),
    }
    assert shapes["token_embedding.weight"] == (256384, 4096)
    assert shapes["norm.weight"] == (4096,)
    assert len(shapes) == 2 + 24 * 10 and "blocks.23.ffn.fc2.weight" in shapes
    # 5.68 G parameters = the 11.36 GB of models_t5_umt5-xxl-enc-bf16.pth.
    assert sum(math.prod(s) for s in shapes.values()) == 5_680_910_336


def test_hf_names_round_trip():
    assert te.hf_name("token_embedding.weight") == "shared.weight"
    assert te.hf_name("norm.weight") == "encoder.final_layer_norm.weight"
    assert te.hf_name("blocks.3.attn.k.weight") == "encoder.block.3.layer.0.SelfAttention.k.weight"
    assert te.hf_name("blocks.0.norm1.weight") == "encoder.block.0.layer.0.layer_norm.weight"
    assert te.hf_name("blocks.0.norm2.weight") == "encoder.block.0.layer.1.layer_norm.weight"
    assert (
        te.hf_name("blocks.7.pos_embedding.embedding.weight")
        == "encoder.block.7.layer.0.SelfAttention.relative_attention_bias.weight"
    )
    # HF's gated GELU is act(wi_0(x)) * wi_1(x): wi_0 is upstream's gate, wi_1 its fc1.
    assert te.hf_name("blocks.1.ffn.gate.0.weight") == "encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    assert te.hf_name("blocks.1.ffn.fc1.weight") == "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"
    assert te.hf_name("blocks.1.ffn.fc2.weight") == "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    with torch.device("meta"):
        names = [n for n, _ in t5.T5Encoder(**t5.UMT5_XXL).named_parameters()]
    assert all(te.upstream_name(te.hf_name(n)) == n for n in names)
    assert len({te.hf_name(n) for n in names}) == len(names)
    assert te.upstream_name("decoder.block.0.layer.0.SelfAttention.q.weight") is None


# ---------------------------------------------------------------------------------------------------
# Numerics


def test_relative_position_buckets():
    rel = t5.T5RelativeEmbedding(32, 4, bidirectional=True)
    pos = torch.tensor([0, 1, -1, 3, -3, 7, 8, 16, -16, 32, 127, 128, 500, -500])
    # 16 buckets per direction: 8 exact, then 8 log-spaced up to distance 128; keys after the query +16.
    expected = [0, 17, 1, 19, 3, 23, 24, 26, 10, 28, 31, 31, 31, 15]
    assert rel.bucket(pos).tolist() == expected


def _reference_forward(sd: dict, cfg: dict, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Independent fp32 formulation in the Hugging Face T5 style (SDPA with scale 1, F.gelu tanh)."""
    heads = cfg["num_heads"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    x = F.embedding(ids, sd["token_embedding.weight"])
    L = ids.shape[1]
    rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    buckets = t5.T5RelativeEmbedding(cfg["num_buckets"], heads).bucket(rel)
    pad = torch.zeros(mask.shape).masked_fill(mask == 0, -1e30)[:, None, None, :]
    for i in range(cfg["num_layers"]):
        p = {k.removeprefix(f"blocks.{i}."): v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        h = rms(x, p["norm1.weight"])
        q, k, v = ((h @ p[f"attn.{n}.weight"].T).unflatten(-1, (heads, -1)).transpose(1, 2) for n in "qkv")
        bias = p["pos_embedding.embedding.weight"][buckets].permute(2, 0, 1)[None] + pad
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        x = x + a.transpose(1, 2).flatten(2) @ p["attn.o.weight"].T
        h = rms(x, p["norm2.weight"])
        g = F.gelu(h @ p["ffn.gate.0.weight"].T, approximate="tanh") * (h @ p["ffn.fc1.weight"].T)
        x = x + g @ p["ffn.fc2.weight"].T
    return rms(x, sd["norm.weight"])


def test_forward_matches_independent_reference_fp32():
    sd = upstream_state_dict(TINY, seed=1, dtype=torch.float32)
    model = t5.T5Encoder(**TINY)
    model.load_state_dict(sd)
    ids = torch.randint(3, TINY["vocab"], (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        ours = model(ids, mask)
    ref = _reference_forward(sd, TINY, ids, mask)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # Padded keys get no weight: the true tokens of row 1 equal an unpadded run of them.
    with torch.no_grad():
        alone = model(ids[1:, :7], mask[1:, :7])
    torch.testing.assert_close(ours[1, :7], alone[0], rtol=1e-5, atol=1e-5)


def test_bf16_dtype_flow_and_layernorm():
    norm = t5.T5LayerNorm(8).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 8).to(torch.bfloat16) * 50
    y = norm(x)
    assert y.dtype == torch.bfloat16
    # The statistic runs in fp32 and the normalized value is rounded to bf16 before the weight.
    want = norm.weight * (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(y, want)
    # tanh GELU is evaluated term by term in the input dtype, not as torch's fused gelu.
    g = torch.linspace(-4, 4, 101).to(torch.bfloat16)
    inner = math.sqrt(2 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0))
    assert torch.equal(t5.GELU()(g), 0.5 * g * (1.0 + torch.tanh(inner)))
    torch.testing.assert_close(t5.GELU()(g.float()), F.gelu(g.float(), approximate="tanh"))


def test_fp16_clamp_only_touches_fp16_infinities():
    x = torch.tensor([1.0, float("inf"), -float("inf")], dtype=torch.float16)
    y = t5.fp16_clamp(x)
    assert torch.isfinite(y).all() and y[1] == torch.finfo(torch.float16).max - 1000
    b = torch.tensor([float("inf")], dtype=torch.bfloat16)
    assert torch.isinf(t5.fp16_clamp(b)).all()


# ---------------------------------------------------------------------------------------------------
# Loading


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("t5_load")
    sd = upstream_state_dict(TINY, seed=2)
    return dict(
        sd=sd,
        pth=write_pth(d / "models_t5_umt5-xxl-enc-bf16.pth", sd),
        st=write_hf_safetensors(d / "umt5_xxl_bf16.safetensors", sd),
        fp16=write_hf_safetensors(d / "umt5_xxl_fp16.safetensors", sd, dtype=torch.float16),
        fp8=write_hf_safetensors(d / "umt5_xxl_fp8_e4m3fn_scaled.safetensors", sd, fp8_scaled=True),
        dir=d,
    )


def test_both_layouts_load_to_identical_models(tiny_files):
    a = te.load_text_encoder(tiny_files["pth"])
    b = te.load_text_encoder(tiny_files["st"])
    assert a.config == b.config == TINY
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() == tiny_files["sd"].keys()
    for n in sa:
        assert sa[n].dtype == torch.bfloat16 and sa[n].device.type == "cpu"
        assert torch.equal(sa[n], tiny_files["sd"][n]) and torch.equal(sa[n], sb[n]), n
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    ids = torch.tensor([[5, 9, 17, 1, 0, 0]])
    mask = (torch.arange(6) < 4).long()[None]
    assert torch.equal(a(ids, mask), b(ids, mask))


def test_model_is_built_on_meta_without_dense_init(tiny_files, monkeypatch):
    devices = []
    orig = torch.nn.Embedding.reset_parameters

    def spy(self):
        devices.append(self.weight.device.type)
        orig(self)

    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", spy)
    te.load_text_encoder(tiny_files["pth"])
    assert devices and set(devices) == {"meta"}


def test_pth_is_read_only_through_weights_only_mmap(tiny_files, monkeypatch):
    calls = []
    orig = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return orig(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    te.load_text_encoder(tiny_files["pth"])
    assert calls and all(c.get("weights_only") is True and c.get("mmap") is True for c in calls)


def test_fp16_and_scaled_fp8_safetensors(tiny_files):
    sd = tiny_files["sd"]
    m16 = te.load_text_encoder(tiny_files["fp16"]).state_dict()
    for n in sd:
        assert torch.equal(m16[n], sd[n].to(torch.float16).to(torch.bfloat16)), n
    raw = load_file(str(tiny_files["fp8"]))
    assert raw["scaled_fp8"].dtype == torch.float8_e4m3fn
    m8 = te.load_text_encoder(tiny_files["fp8"]).state_dict()
    key = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    w, s = raw[key], raw["encoder.block.1.layer.1.DenseReluDense.wo.scale_weight"]
    assert w.dtype == torch.float8_e4m3fn
    want = w.to(torch.bfloat16) * s.to(torch.bfloat16)
    assert torch.equal(m8["blocks.1.ffn.fc2.weight"], want)
    # fp8 keeps ~2 significant digits of the bf16 weights.
    ref = sd["blocks.1.ffn.fc2.weight"].float()
    assert (m8["blocks.1.ffn.fc2.weight"].float() - ref).abs().max() < 0.1 * ref.abs().max()
    assert torch.equal(m8["token_embedding.weight"], sd["token_embedding.weight"])


def test_read_encoder_config_from_shapes(tiny_files):
    assert te.read_encoder_config(tiny_files["pth"]) == TINY
    assert te.read_encoder_config(tiny_files["fp8"]) == TINY


def test_missing_and_wrong_tensors_are_named(tiny_files, tmp_path):
    sd = dict(tiny_files["sd"])
    del sd["blocks.1.ffn.fc2.weight"]
    with pytest.raises(ValueError, match=r"missing keys.*blocks\.1\.ffn\.fc2\.weight"):
        te.load_text_encoder(write_pth(tmp_path / "a.pth", sd))
    with pytest.raises(
        ValueError, match=r"missing keys.*encoder\.block\.1\.layer\.1\.DenseReluDense\.wo\.weight"
    ):
        te.load_text_encoder(write_hf_safetensors(tmp_path / "a.safetensors", sd))

    bad = dict(tiny_files["sd"])
    bad["blocks.0.attn.v.weight"] = torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"blocks\.0\.attn\.v\.weight has shape \[16, 32\], expected \[32, 32\]"
    ):
        te.load_text_encoder(write_pth(tmp_path / "b.pth", bad))

    extra = dict(tiny_files["sd"], **{"blocks.0.attn.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected keys.*blocks\.0\.attn\.extra\.weight"):
        te.load_text_encoder(write_pth(tmp_path / "c.pth", extra))

    ints = dict(tiny_files["sd"], **{"norm.weight": torch.ones(32, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"norm\.weight: unsupported dtype torch\.int32"):
        te.load_text_encoder(write_pth(tmp_path / "d.pth", ints))


def test_wrong_files_are_rejected_clearly(tiny_files, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        te.load_text_encoder(tmp_path / "nope.pth")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"garbage\.pth.*weights_only=True, mmap=True"):
        te.load_text_encoder(garbage)
    gguf = tmp_path / "umt5.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"unsupported text encoder file type '\.gguf'.*safetensors"):
        te.load_text_encoder(gguf)
    other = tmp_path / "vae.safetensors"
    save_file({"decoder.conv1.weight": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match=r"not a umT5 encoder checkpoint.*decoder\.conv1\.weight"):
        te.load_text_encoder(other)
    quant = load_file(str(tiny_files["st"]))
    quant["encoder.block.0.layer.0.SelfAttention.q.weight_scale"] = torch.ones(())
    save_file(quant, str(tmp_path / "mixed.safetensors"))
    with pytest.raises(ValueError, match=r"unsupported quantization format.*q\.weight_scale.*Supported"):
        te.load_text_encoder(tmp_path / "mixed.safetensors")


def test_hf_extras_are_tolerated(tiny_files, tmp_path):
    """Full-T5 files carry a decoder, lm_head and a tied embed_tokens copy; they are skipped."""
    sd = load_file(str(tiny_files["st"]))
    sd["encoder.embed_tokens.weight"] = torch.zeros_like(sd["shared.weight"])
    sd["decoder.block.0.layer.0.SelfAttention.q.weight"] = torch.zeros(4, 4)
    sd["lm_head.weight"] = torch.zeros(4, 4)
    save_file(sd, str(tmp_path / "full_t5.safetensors"))
    m = te.load_text_encoder(tmp_path / "full_t5.safetensors")
    assert torch.equal(m.token_embedding.weight, tiny_files["sd"]["token_embedding.weight"])


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def test_text_cleaning_as_upstream():
    assert te.clean_text("  A  cat\n\tand\u3000a dog  ") == "A cat and a dog"
    assert te.clean_text("Tom &amp;amp; Jerry &lt;3") == "Tom & Jerry <3"  # unescaped twice
    assert te.clean_text("cafÃ© crÃ¨me") == "café crème"  # ftfy repairs mojibake
    assert te.clean_text("\u201cquoted\u201d") == '"quoted"'  # ftfy straightens curly quotes
    assert te.clean_text("") == ""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer")


def test_json_tokenizer_pads_truncates_and_keeps_eos(tok_dir):
    tok = te.load_tokenizer(tok_dir, text_len=16)
    assert tok.pad_id == 0 and tok.vocab_size <= 120
    ids, mask = tok(["The wind whips", "The wind   whips "])
    assert ids.shape == mask.shape == (2, 16) and ids.dtype == torch.long
    n = int(mask[0].sum())
    assert ids[0, n - 1] == 1 and (ids[0, n:] == 0).all() and (mask[0, n:] == 0).all()
    assert torch.equal(ids[0], ids[1])  # whitespace cleaned before tokenizing
    long_ids, long_mask = tok([" ".join(["castle"] * 40)])
    assert long_mask.all() and long_ids[0, -1] == 1  # truncated to 16 with </s> kept last


def test_spiece_tokenizer_embedded_in_safetensors(tiny_files, tmp_path):
    import sentencepiece as spm

    proto = spiece_model_bytes()
    path = write_hf_safetensors(tmp_path / "umt5_xxl_fp16.safetensors", tiny_files["sd"], spiece=proto)
    src = te.resolve_tokenizer(None, path)
    assert src.kind == "embedded" and src.path == path
    tok = te.UMT5Tokenizer(src, text_len=32)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    text = "A camera glides over a quiet harbor."
    assert tok.encode("  " + text.replace(" ", "   ")) == sp.encode(text) + [1]
    ids, mask = tok([text])
    assert ids[0, : int(mask.sum())].tolist() == sp.encode(text) + [1]
    short = te.UMT5Tokenizer(src, text_len=5).encode(text)
    assert short == sp.encode(text)[:4] + [1]
    # the encoder itself still loads from that file (the tokenizer tensor is not a weight)
    assert te.load_text_encoder(path).config == TINY


def test_tokenizer_resolution_order_and_errors(tiny_files, tmp_path, tok_dir):
    enc = write_pth(tmp_path / "models_t5_umt5-xxl-enc-bf16.pth", tiny_files["sd"])
    with pytest.raises(FileNotFoundError, match=r"no umT5 tokenizer found.*tokenizer_path"):
        te.resolve_tokenizer(None, enc)
    g = tmp_path / "google" / "umt5-xxl"
    g.mkdir(parents=True)
    (g / "spiece.model").write_bytes(spiece_model_bytes())
    assert te.resolve_tokenizer(None, enc) == te.TokenizerSource("spiece", g / "spiece.model")
    write_tokenizer_json(tmp_path / "tokenizer")
    assert te.resolve_tokenizer(None, enc) == te.TokenizerSource(
        "json", tmp_path / "tokenizer" / "tokenizer.json"
    )
    assert te.resolve_tokenizer(g, enc).kind == "spiece"  # an explicit path wins
    assert te.resolve_tokenizer(tok_dir / "tokenizer.json").kind == "json"
    with pytest.raises(FileNotFoundError, match="missing_tok"):
        te.resolve_tokenizer(tmp_path / "missing_tok", enc)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor spiece.model"):
        te.resolve_tokenizer(empty, enc)
    with pytest.raises(ValueError, match="not a tokenizer"):
        te.resolve_tokenizer(tiny_files["st"])  # a safetensors without spiece_model


def test_tokenizer_that_does_not_fit_the_encoder(tok_dir):
    tok = te.load_tokenizer(tok_dir)
    tok.check_fits(tok.vocab_size)
    with pytest.raises(ValueError, match=r"has \d+ tokens but the text encoder .* embeds only 50"):
        tok.check_fits(50)
