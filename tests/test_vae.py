"""Wan2.1 VAE: upstream names/shapes, streaming encode/decode, tiling, loading, bad input (CPU, tiny)."""

import functools

import pytest
import torch
from helpers import channels_last_3d
from lingbot_world.loaders.vae import load_vae
from lingbot_world.wan import vae as V
from safetensors.torch import save_file

TINY = {**V.WAN21_VAE_CONFIG, "dim": 4}


@pytest.fixture(scope="module")
def tiny():
    return V.init_random_(V.WanVAE(**TINY).eval(), 7)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --- structure -------------------------------------------------------------------------------------

# Derived by reading upstream vae2_1.py (_video_vae: dim 96, z 16, dim_mult [1,2,4,4], 2 res blocks,
# temperal_downsample [False, True, True]); Sequential indices count the parameter-free layers too.
UPSTREAM_SHAPES = {
    "encoder.conv1.weight": [96, 3, 3, 3, 3],
    "encoder.conv1.bias": [96],
    "encoder.downsamples.0.residual.0.gamma": [96, 1, 1, 1],
    "encoder.downsamples.0.residual.2.weight": [96, 96, 3, 3, 3],
    "encoder.downsamples.0.residual.3.gamma": [96, 1, 1, 1],
    "encoder.downsamples.0.residual.6.weight": [96, 96, 3, 3, 3],
    "encoder.downsamples.2.resample.1.weight": [96, 96, 3, 3],
    "encoder.downsamples.3.residual.2.weight": [192, 96, 3, 3, 3],
    "encoder.downsamples.3.shortcut.weight": [192, 96, 1, 1, 1],
    "encoder.downsamples.5.resample.1.weight": [192, 192, 3, 3],
    "encoder.downsamples.5.time_conv.weight": [192, 192, 3, 1, 1],
    "encoder.downsamples.6.shortcut.weight": [384, 192, 1, 1, 1],
    "encoder.downsamples.8.time_conv.weight": [384, 384, 3, 1, 1],
    "encoder.downsamples.10.residual.6.weight": [384, 384, 3, 3, 3],
    "encoder.middle.1.norm.gamma": [384, 1, 1],
    "encoder.middle.1.to_qkv.weight": [1152, 384, 1, 1],
    "encoder.middle.1.proj.weight": [384, 384, 1, 1],
    "encoder.head.0.gamma": [384, 1, 1, 1],
    "encoder.head.2.weight": [32, 384, 3, 3, 3],
    "conv1.weight": [32, 32, 1, 1, 1],
    "conv2.weight": [16, 16, 1, 1, 1],
    "conv2.bias": [16],
    "decoder.conv1.weight": [384, 16, 3, 3, 3],
    "decoder.middle.0.residual.0.gamma": [384, 1, 1, 1],
    "decoder.middle.2.residual.6.weight": [384, 384, 3, 3, 3],
    "decoder.upsamples.3.time_conv.weight": [768, 384, 3, 1, 1],
    "decoder.upsamples.3.resample.1.weight": [192, 384, 3, 3],
    "decoder.upsamples.4.residual.2.weight": [384, 192, 3, 3, 3],
    "decoder.upsamples.4.shortcut.weight": [384, 192, 1, 1, 1],
    "decoder.upsamples.7.time_conv.weight": [768, 384, 3, 1, 1],
    "decoder.upsamples.7.resample.1.weight": [192, 384, 3, 3],
    "decoder.upsamples.8.residual.2.weight": [192, 192, 3, 3, 3],
    "decoder.upsamples.11.resample.1.weight": [96, 192, 3, 3],
    "decoder.upsamples.11.resample.1.bias": [96],
    "decoder.upsamples.14.residual.6.weight": [96, 96, 3, 3, 3],
    "decoder.head.0.gamma": [96, 1, 1, 1],
    "decoder.head.2.weight": [3, 96, 3, 3, 3],
    "decoder.head.2.bias": [3],
}


def test_full_size_names_match_upstream():
    with torch.device("meta"):
        model = V.WanVAE()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert {k: shapes.get(k) for k in UPSTREAM_SHAPES} == UPSTREAM_SHAPES
    # upsample2d / downsample2d have no time_conv, equal-width blocks no shortcut
    for absent in (
        "encoder.downsamples.2.time_conv.weight",
        "decoder.upsamples.11.time_conv.weight",
        "decoder.upsamples.8.shortcut.weight",
    ):
        assert absent not in shapes
    assert len(shapes) == 194
    assert sum(p.numel() for p in model.parameters()) == 126_892_531  # ~485 MiB in fp32, as the .pth


# --- numerics --------------------------------------------------------------------------------------


# Upstream golden encode/decode values: test_parity.py::test_tiny_vae_matches_upstream.


@pytest.mark.parametrize("frames", [1, 5, 9, 17])
def test_roundtrip_shapes(tiny, frames):
    video = torch.rand(3, frames, 16, 16, generator=_gen(frames)) * 2 - 1
    z = tiny.encode(video)
    assert z.shape == (16, (frames - 1) // 4 + 1, 2, 2)
    out = tiny.decode(z)
    assert out.shape == (3, frames, 16, 16) and out.dtype == torch.float32
    assert torch.isfinite(out).all() and out.abs().max() <= 1


def test_streaming_is_causal_and_chunking_exact(tiny):
    # The caches make chunked processing one causal stream: a prefix of the input gives a prefix of
    # the output, and the sub-chunk size after temporal upsampling changes nothing.
    video = torch.rand(3, 9, 16, 16, generator=_gen(1)) * 2 - 1
    torch.testing.assert_close(tiny.encode(video[:, :5]), tiny.encode(video)[:, :2], atol=1e-5, rtol=0)
    z = torch.randn(16, 3, 2, 2, generator=_gen(2))
    full = tiny.decode(z, chunk_frames=4)
    torch.testing.assert_close(tiny.decode(z[:, :2], chunk_frames=1), full[:, :5], atol=1e-5, rtol=0)
    torch.testing.assert_close(tiny.decode(z, chunk_frames=1), full, atol=1e-5, rtol=0)


def _spatially_local(model, part: str = "decoder"):
    """Keep only the centre spatial tap of every conv of `part` (decoder or encoder) and silence its
    attention: each output pixel then depends on its own latent pixel (decoder) or 8x8 block of video
    pixels (encoder) alone, through all frames, so tiling cannot change anything."""
    local = V.WanVAE(**TINY).eval()
    local.load_state_dict(model.state_dict())
    with torch.no_grad():
        for m in getattr(local, part).modules():
            if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)) and m.kernel_size[-1] == 3:
                centre = m.weight[..., 1:2, 1:2].clone()
                m.weight.zero_()[..., 1:2, 1:2] = centre
            if isinstance(m, V.AttentionBlock):
                m.proj.weight.zero_()
    return local


def test_tiled_equals_untiled(tiny):
    z = torch.randn(16, 2, 7, 9, generator=_gen(4))
    # A single tile covering everything is the untiled path.
    torch.testing.assert_close(tiny.decode(z, tile=(7, 9), overlap=4), tiny.decode(z), atol=0, rtol=0)
    # With a spatially local decoder the only possible differences are tile placement and blending
    # mistakes (or a cache shared between tiles), so tiled must match to fp32 rounding: 1e-5 leaves
    # ~100x room over the ~1e-7 error of normalising sum(w_i * x) / sum(w_i) on values in [-1, 1].
    local = _spatially_local(tiny)
    ref = local.decode(z)
    assert ref.std() > 0.1  # not trivially flat
    for tile, overlap in (((4, 5), 2), ((7, 4), 0)):
        out = local.decode(z, tile=tile, overlap=overlap)
        assert (out - ref).abs().max() < 1e-5, (tile, overlap)
    # The real decoder sees zero padding at tile cuts and attends within a tile only, so it differs
    # near cuts; the linear blend keeps it bounded (measured ~0.03 mean / 0.6 max on random weights,
    # which unlike trained ones have no spatial decay; see benchmarks/bench_vae.py for the real VAE).
    out = tiny.decode(z, tile=(5, 6), overlap=3)
    assert (out - tiny.decode(z)).abs().mean() < 0.1


def test_tiled_encode_equals_untiled(tiny):
    video = torch.rand(3, 5, 56, 72, generator=_gen(6)) * 2 - 1
    video[:, 1:] = 0  # the i2v input: one real frame, then zeros
    ref = tiny.encode(video)
    # One tile covering everything, and 'auto' on CPU, are the untiled path, bit for bit.
    assert torch.equal(tiny.encode(video, tile=(7, 9), overlap=4), ref)
    assert torch.equal(tiny.encode(video, tile="auto"), ref)
    local = _spatially_local(tiny, "encoder")
    want = local.encode(video)
    assert want.std() > 0.1 and want.shape == (16, 2, 7, 9)
    for tile, overlap in (((4, 5), 2), ((7, 4), 0), ((3, 3), 1)):
        got = local.encode(video, tile=tile, overlap=overlap)
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-5, (tile, overlap)
    # The real encoder sees zero padding at tile cuts and attends within a tile: close, not equal
    # (measured ~0.04 mean on these random weights, which have no spatial decay; latent std ~0.4).
    got = tiny.encode(video, tile=(5, 6), overlap=3)
    assert not torch.equal(got, ref)
    assert (got - ref).abs().mean() < 0.1
    with pytest.raises(ValueError, match="tile must be"):
        tiny.encode(video, tile=(4,))


def test_encode_auto_tile_budget():
    work = functools.partial(V.encode_work_bytes, 81, 60, 104)  # 480p x 81 frames: 60x104 latent pixels
    assert work(None) == 6 * 81 * 480 * 832 + V.ENCODE_BYTES_PER_LATENT_PIXEL * 60 * 104
    assert work(None, torch.bfloat16) < work(None)  # the activations at the VAE's dtype
    # within 3 GiB 480p needs tiles; the tile's work (times the headroom) fits the budget
    th, tw = V.pick_encode_tile(81, 60, 104, 3 * 2**30)
    assert (th, tw) != (60, 104) and work((th, tw)) * V.ENCODE_SAFETY <= 3 * 2**30
    assert V.pick_encode_tile(81, 60, 104, work((60, 104)) * V.ENCODE_SAFETY) is None  # room: the whole frame
    assert V.pick_encode_tile(81, 60, 104, None) is None  # CPU: untiled


def test_tile_spans_and_auto():
    assert V.tile_spans(10, 16, 4) == [(0, 10)]
    spans = V.tile_spans(160, 64, 16)
    assert spans[0][0] == 0 and spans[-1][1] == 160
    assert all(b - a == 64 for a, b in spans) and all(
        p[1] - n[0] >= 16 for p, n in zip(spans[:-1], spans[1:], strict=True)
    )
    with torch.device("meta"):
        full = V.WanVAE()
    # Cache: 151,328 elements per latent pixel; activations 6144 * (3*2 + 2) + 12,288 held (fp32).
    assert full.decode_bytes_per_latent_pixel(2) == (151_328 + 6144 * 8 + 12_288) * 4
    assert V.pick_tile(full, 90, 160, None) is None  # CPU: untiled
    assert V.pick_tile(full, 90, 160, 40 * 2**30) is None
    th, tw = V.pick_tile(full, 90, 160, 4 * 2**30)
    assert th * tw * full.decode_bytes_per_latent_pixel(2) * V.AUTO_SAFETY <= 4 * 2**30
    assert th >= 40 and tw >= 40


def test_auto_on_cpu_is_untiled(tiny):
    z = torch.randn(16, 2, 3, 4, generator=_gen(5))
    assert torch.equal(tiny.decode(z, tile="auto"), tiny.decode(z))


# --- loading ---------------------------------------------------------------------------------------


def test_pth_and_safetensors_load_identically(tiny, tmp_path):
    sd = tiny.state_dict()
    torch.save(sd, tmp_path / "Wan2.1_VAE.pth")
    save_file(sd, tmp_path / "wan_2.1_vae.safetensors")
    save_file({k: v.bfloat16() for k, v in sd.items()}, tmp_path / "bf16.safetensors")  # like ComfyUI's
    a = load_vae(tmp_path / "Wan2.1_VAE.pth", config=TINY)
    b = load_vae(tmp_path / "wan_2.1_vae.safetensors", config=TINY)
    c = load_vae(tmp_path / "bf16.safetensors", config=TINY)
    for k, v in sd.items():
        assert torch.equal(a.state_dict()[k], v) and torch.equal(b.state_dict()[k], v)
        assert c.state_dict()[k].dtype == torch.float32 and torch.equal(
            c.state_dict()[k], v.bfloat16().float()
        )
    assert not any(p.requires_grad or p.is_meta for p in a.parameters())
    z = torch.randn(16, 1, 2, 2, generator=_gen(6))
    assert torch.equal(a.decode(z), b.decode(z))


def test_load_errors(tiny, tmp_path):
    sd = tiny.state_dict()
    with pytest.raises(FileNotFoundError, match="not found"):
        load_vae(tmp_path / "nope.pth")

    partial = {k: v for k, v in sd.items() if k != "decoder.head.2.bias"} | {"extra.weight": torch.zeros(1)}
    save_file(partial, tmp_path / "partial.safetensors")
    with pytest.raises(
        ValueError, match=r"1 missing keys \[decoder.head.2.bias\].*1 unexpected keys \[extra.weight\]"
    ):
        load_vae(tmp_path / "partial.safetensors", config=TINY)

    bad = dict(sd) | {"decoder.conv1.weight": sd["decoder.conv1.weight"][:, :-1].contiguous()}
    save_file(bad, tmp_path / "bad_shape.safetensors")  # one tensor inconsistent with the rest
    with pytest.raises(ValueError, match=r"'decoder.conv1.weight' has shape \[.*\], expected \["):
        load_vae(tmp_path / "bad_shape.safetensors")

    wan22 = {"decoder.middle.0.residual.0.gamma": torch.ones(3), "conv2.weight": torch.zeros(48, 48, 1, 1, 1)}
    save_file(wan22, tmp_path / "wan2.2_vae.safetensors")
    with pytest.raises(ValueError, match="Wan2.2 VAE"):
        load_vae(tmp_path / "wan2.2_vae.safetensors")

    save_file({"blocks.0.weight": torch.zeros(2)}, tmp_path / "dit.safetensors")
    with pytest.raises(ValueError, match="not a Wan VAE"):
        load_vae(tmp_path / "dit.safetensors")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk\.pth: could not read it as a torch state dict"):
        load_vae(tmp_path / "junk.pth")

    # a VAE stored under a prefix (single-file bundles) is found and stripped
    torch.save({"first_stage_model." + k: v for k, v in sd.items()}, tmp_path / "bundle.pt")
    assert torch.equal(load_vae(tmp_path / "bundle.pt", config=TINY).conv2.weight, sd["conv2.weight"])


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, msg",
    [
        ((4, 5, 16, 16), r"\[3, F, H, W\]"),
        ((3, 16, 16), r"\[3, F, H, W\]"),
        ((3, 4, 16, 16), "4n\\+1"),
        ((3, 5, 20, 16), "height must be a multiple of 8"),
        ((3, 5, 16, 8), "width must be a multiple of 8 and at least 16"),
    ],
)
def test_bad_video(tiny, shape, msg):
    with pytest.raises(ValueError, match=msg):
        tiny.encode(torch.zeros(shape))


def test_bad_values_and_latents(tiny):
    video = torch.zeros(3, 1, 16, 16)
    video[0, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        tiny.encode(video)
    with pytest.raises(ValueError, match=r"\[16, T, h, w\].*got shape \[48, 2, 4, 4\]"):
        tiny.decode(torch.zeros(48, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\[16, T, h, w\]"):
        tiny.decode(torch.zeros(1, 16, 2, 4, 4))
    with pytest.raises(ValueError, match="h, w >= 2"):
        tiny.decode(torch.zeros(16, 2, 1, 4))
    latent = torch.zeros(16, 1, 2, 2)
    latent[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        tiny.decode(latent)
    with pytest.raises(ValueError, match="tile must be"):
        tiny.decode(torch.zeros(16, 1, 4, 4), tile=(4,))
    with pytest.raises(ValueError, match="overlap must be"):
        tiny.decode(torch.zeros(16, 1, 4, 4), tile=(4, 4), overlap=4)


# --- chunked decode (LingBot-World-Fast hands the latent over 3 frames at a time) ---------------------


def test_chunk_decoder_equals_full_decode(tiny):
    z = torch.randn(16, 9, 3, 4, generator=_gen(11))
    full = tiny.decode(z)
    with tiny.chunk_decoder() as dec:
        parts = [dec.decode(z[:, i : i + 3]) for i in range(0, 9, 3)]
        assert (dec.latent_frames, dec.frames) == (9, 33)
    assert [p.shape[1] for p in parts] == [9, 12, 12]
    assert torch.equal(torch.cat(parts, dim=1), full)
    # any piece size: the first call gives 4(n-1)+1 frames, later ones 4n
    with tiny.chunk_decoder(chunk_frames=1) as dec:
        parts = [dec.decode(z[:, a:b]) for a, b in ((0, 1), (1, 5), (5, 7), (7, 9))]
    assert [p.shape[1] for p in parts] == [1, 16, 8, 8]
    assert torch.equal(torch.cat(parts, dim=1), tiny.decode(z, chunk_frames=1))


def test_chunk_decoder_tiled_equals_tiled_decode(tiny):
    z = torch.randn(16, 6, 7, 9, generator=_gen(12))
    full = tiny.decode(z, tile=(5, 6), overlap=3)
    assert not torch.equal(full, tiny.decode(z))  # the tiles really blend
    with tiny.chunk_decoder(tile=(5, 6), overlap=3) as dec:
        got = torch.cat([dec.decode(z[:, :3]), dec.decode(z[:, 3:])], dim=1)
    assert torch.equal(got, full)
    with tiny.chunk_decoder(tile="auto") as dec:  # CPU: no budget, one tile
        got = torch.cat([dec.decode(z[:, :3]), dec.decode(z[:, 3:])], dim=1)
        assert dec.tile is None
    assert torch.equal(got, tiny.decode(z))


def test_one_shot_tiled_decode_holds_one_tile_cache(tiny, monkeypatch):
    """`decode` (no chunk follows) frees each tile's causal caches once the tile is done: while a tile
    streams, every tile before it holds none, so memory is one tile's, not all of them (chunked
    decoding keeps them all: the next chunk continues each tile's stream)."""
    z = torch.randn(16, 3, 7, 9, generator=_gen(13))
    live = []
    real = type(tiny.decoder).stream

    def stream(self, x, cache, chunk_frames):
        live.append(sum(1 for *_, c in dec._tiles if c and c is not cache))
        yield from real(self, x, cache, chunk_frames)

    monkeypatch.setattr(type(tiny.decoder), "stream", stream)
    dec = tiny.chunk_decoder(tile=(5, 6), overlap=3)
    tiles = []
    real_close = dec.close
    dec.close = lambda: (tiles.extend(dec._tiles), real_close())[1]  # what the tiles held when it closed
    out = dec.decode(z, last=True)
    assert len(tiles) == 4 and not any(c for *_, c in tiles)
    assert live and max(live) == 0
    with pytest.raises(ValueError, match="closed"):  # nothing follows a last chunk
        dec.decode(z)
    dec = tiny.chunk_decoder(tile=(5, 6), overlap=3)
    assert torch.equal(dec.decode(z), out)  # the same frames; the caches stay for a next chunk
    assert max(live) == 3 and all(c for *_, c in dec._tiles)


def test_chunk_decoder_bad_input(tiny):
    dec = tiny.chunk_decoder()
    dec.decode(torch.zeros(16, 3, 4, 4))
    with pytest.raises(ValueError, match=r"4x6 latent pixels but the stream started at 4x4"):
        dec.decode(torch.zeros(16, 3, 4, 6))
    with pytest.raises(ValueError, match=r"\[16, T, h, w\]"):
        dec.decode(torch.zeros(16, 3, 4))
    dec.close()
    with pytest.raises(ValueError, match="closed"):
        dec.decode(torch.zeros(16, 3, 4, 4))
    with pytest.raises(ValueError, match="tile must be"):
        tiny.chunk_decoder(tile=(4,))
    with pytest.raises(ValueError, match="chunk_frames must be"):
        tiny.chunk_decoder(chunk_frames=0)


# --- the fast decoder (bf16/fp16 channels-last copy) and per-latent-frame streaming -------------------


def _psnr(x, ref):
    """PSNR in dB of frames in [-1, 1] (peak-to-peak 2)."""
    return (10 * torch.log10(4 / ((x - ref) ** 2).mean())).item()


def test_exact_decode_is_the_default(tiny):
    """No dtype (or the VAE's own without channels-last) decodes with the VAE's own decoder, no copy."""
    z = torch.randn(16, 3, 5, 6, generator=_gen(21))
    ref = tiny.decode(z)
    with tiny.chunk_decoder() as dec:
        assert dec.decoder is tiny.decoder and dec.dtype == torch.float32
    with tiny.chunk_decoder(dtype=torch.float32, channels_last=False) as dec:
        assert dec.decoder is tiny.decoder
        assert torch.equal(dec.decode(z), ref)
    assert torch.equal(tiny.decode(z, dtype=None), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_decoder_close_to_exact(tiny, dtype):
    z = torch.randn(16, 3, 5, 6, generator=_gen(22))
    ref = tiny.decode(z)
    before = {k: v.clone() for k, v in tiny.decoder.state_dict().items()}
    with tiny.chunk_decoder(dtype=dtype) as dec:
        copy = dec.decoder
        assert copy is not tiny.decoder and dec.dtype == dtype
        conv = copy.upsamples[0].residual[2].weight
        assert conv.dtype == dtype and conv.is_contiguous(memory_format=torch.channels_last_3d)
        out = dec.decode(z)
    assert dec.decoder is None  # closing frees the copy
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not torch.equal(out, ref)  # really another precision
    assert _psnr(out, ref) > 35  # ~48 dB (bf16), ~66 dB (fp16) measured on these random weights
    assert all(torch.equal(v, before[k]) for k, v in tiny.decoder.state_dict().items())  # VAE untouched
    # channels-last or not, the same math: only the memory layout differs. How the CPU's kernels round the two
    # layouts depends on the CPU (in bf16 up to 0.06 apart on an AVX2-only one, where earlier CI machines kept them
    # within 2e-2), so the check is that they agree far closer (>= 6 dB) than either is to the exact decode
    plain = tiny.decode(z, dtype=dtype)
    with tiny.chunk_decoder(dtype=dtype, channels_last=False) as dec:
        assert dec.decoder.upsamples[0].residual[2].weight.is_contiguous()
        other = dec.decode(z)
    assert _psnr(other, plain) > _psnr(plain, ref) + 6


def test_fast_decoder_bad_dtype(tiny):
    with pytest.raises(ValueError, match="decode dtype"):
        tiny.chunk_decoder(dtype=torch.int8)


def test_decode_bytes_scale_with_dtype():
    with torch.device("meta"):
        full = V.WanVAE()
    fp32 = full.decode_bytes_per_latent_pixel(2)
    assert full.decode_bytes_per_latent_pixel(2, torch.bfloat16) * 2 == fp32
    assert full.decode_bytes_per_latent_pixel(2, torch.float16) * 2 == fp32
    # 'auto' tiles for the fast decoder's smaller figure: a budget the fp32 decode needs tiles for fits whole
    budget = int(60 * 104 * fp32 * V.AUTO_SAFETY * 0.6)
    assert V.pick_tile(full, 60, 104, budget) is not None
    bpp = full.decode_bytes_per_latent_pixel(2, torch.bfloat16)
    assert V.pick_tile(full, 60, 104, budget, bytes_per_pixel=bpp) is None


@pytest.mark.parametrize(
    ("tile", "dtype", "levers"),
    [
        (None, None, {}),
        ((5, 6), None, {}),
        ((5, 6), torch.bfloat16, {}),
        ((5, 6), torch.float16, {"subpixel": True}),
    ],
)
def test_stream_equals_decode(tiny, tile, dtype, levers):
    """Frames handed out per latent frame, concatenated, are the chunked decode's bit for bit (tiles and
    the fast decoder, with its sub-pixel upsampling, included), and the two can be mixed within one stream."""
    z = torch.randn(16, 7, 7, 9, generator=_gen(23))
    with tiny.chunk_decoder(tile, overlap=3, dtype=dtype, **levers) as dec:
        whole = torch.cat([dec.decode(z[:, :3]), dec.decode(z[:, 3:])], dim=1)
    with tiny.chunk_decoder(tile, overlap=3, dtype=dtype, **levers) as dec:
        pieces = list(dec.stream(z[:, :3]))
        assert [p.shape[1] for p in pieces] == [1, 4, 4]
        pieces += list(dec.stream(z[:, 3:5]))
        pieces.append(dec.decode(z[:, 5:]))
        assert (dec.latent_frames, dec.frames) == (7, 25)
    assert torch.equal(torch.cat(pieces, dim=1), whole)
    if dtype is None:
        assert torch.equal(whole, tiny.decode(z, tile=tile, overlap=3))


# --- the fast decoder's levers: sub-pixel upsampling, compiled blocks ----------------------------------


def _rel(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_subpixel_up_equals_upsample_then_conv(bias, channels_last):
    """Nearest 2x then a 3x3 conv (padding 1) == the folded 2x2 conv on the low-res input, phases
    interleaved, in fp32 up to rounding, borders included; the output keeps the input's layout."""
    conv = torch.nn.Conv2d(6, 5, 3, padding=1, bias=bias)
    torch.nn.init.normal_(conv.weight, generator=_gen(30))
    x = torch.randn(2, 6, 5, 7, generator=_gen(31))
    ref = conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest-exact"))
    w, b = V.subpixel_weight(conv.weight, conv.bias)
    assert w.shape == (20, 6, 2, 2) and (b is None) == (not bias)
    if channels_last:
        x, w = (
            x.contiguous(memory_format=torch.channels_last),
            w.contiguous(memory_format=torch.channels_last),
        )
    out = V.subpixel_up(x, w, b)
    assert out.shape == ref.shape and _rel(out, ref) <= 1e-6
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last


def test_subpixel_decoder_equals_plain(tiny):
    """The sub-pixel decoder in fp32 (levers on an fp32 copy) equals the exact decode up to fp32 rounding;
    in fp16 it stays as close to fp32 as the plain fp16 decoder; the VAE and its decoder are untouched."""
    z = torch.randn(16, 5, 5, 6, generator=_gen(32))
    ref = tiny.decode(z)
    before = {k: v.clone() for k, v in tiny.decoder.state_dict().items()}
    for channels_last in (False, True):
        with tiny.chunk_decoder(dtype=torch.float32, channels_last=channels_last, subpixel=True) as dec:
            assert dec.decoder is not tiny.decoder and len(dec.decoder.levers.spatial) == 3
            assert dec.decoder.state_dict().keys() == before.keys()  # no new parameters
            out = torch.cat([dec.decode(z[:, :2]), dec.decode(z[:, 2:])], dim=1)
        assert not torch.equal(out, ref) and _rel(out, ref) <= 1e-5
    with tiny.chunk_decoder(dtype=torch.float16, subpixel=True) as dec:
        assert _psnr(dec.decode(z), ref) > 60  # the plain fp16 decoder: ~66 dB
    assert all(torch.equal(v, before[k]) for k, v in tiny.decoder.state_dict().items())
    assert torch.equal(tiny.decode(z), ref) and tiny.decoder.levers is None


def test_levers_need_the_fast_decoder(tiny):
    assert V.decoder_levers(torch.float16, True) == {"compile": True, "subpixel": True}
    assert V.decoder_levers(torch.float16, False) == V.decoder_levers(None, True) == {}
    for lever in ("compile", "subpixel"):
        with pytest.raises(ValueError, match="levers of the fast decoder; they need a dtype"):
            tiny.chunk_decoder(**{lever: True})


@pytest.mark.slow
def test_compiled_decoder_equals_eager(tiny):
    """torch.compile'd decoder blocks (CPU inductor, fp32, with sub-pixel upsampling) equal the exact decode
    up to fp32 rounding; streaming equals decoding; a second stream of the same size compiles nothing new."""
    from lingbot_world.wan import speed
    from lingbot_world.wan.speed import compiler_missing

    reason = compiler_missing(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"inductor cannot build CPU kernels here: {reason}")
    from torch._dynamo.utils import counters

    z = torch.randn(16, 5, 5, 6, generator=_gen(33))
    ref = tiny.decode(z)
    levers = dict(dtype=torch.float32, compile=True, subpixel=True)
    before = counters["stats"]["unique_graphs"]
    with tiny.chunk_decoder(**levers) as dec:
        out = torch.cat([dec.decode(z[:, :2]), dec.decode(z[:, 2:])], dim=1)
    runner = speed._shared_runners.get(V._call_step)
    assert runner is not None and not runner.failed
    graphs = counters["stats"]["unique_graphs"]
    # one graph per block shape: residual blocks at 4 sizes (one with a shortcut conv), 3 upsamples (the
    # last at 1 and 2 frames), the head, the middle's attention; views and layouts do not add any
    assert 0 < graphs - before <= 11 and _rel(out, ref) <= 1e-5
    with tiny.chunk_decoder(**levers) as dec:  # another stream, same size: the graphs serve it
        pieces = list(dec.stream(z[:, :2])) + list(dec.stream(z[:, 2:]))
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(torch.cat(pieces, dim=1), out)


def test_the_attention_step_equals_the_attention_block_and_keeps_channels_last():
    """The compiled decoder's attention (`_attention_step`: two GEMMs, the scores and softmax in fp32) equals the
    block's own per-frame SDPA up to fp32 rounding, frame by frame, and hands its output on with channels-last-3d's
    strides (so `DecoderLevers._canonical` copies nothing before the next block)."""
    g = _gen(47)
    block = V.AttentionBlock(16).requires_grad_(False)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 3 else 0.0))
    x = torch.randn(1, 16, 2, 5, 6, generator=g).contiguous(memory_format=torch.channels_last_3d)
    gain = (block.norm.gamma.float() * block.norm.scale).flatten()
    qkv, proj = block.to_qkv, block.proj
    assert not V.scores_in_fp32(x) and not V.scores_in_fp32(x.half())  # CPU: the scores from fp32 copies
    y = V._attention_step(
        x, gain, qkv.weight[:, :, 0, 0], qkv.bias, proj.weight[:, :, 0, 0], proj.bias, False
    )
    ref = block(x)
    assert y.shape == ref.shape and _rel(y, ref) <= 1e-5 and (y - x).abs().max() > 0.1
    assert y.stride() == x.stride()
    assert _rel(y[:, :, 1], block(x[:, :, 1:])[:, :, 0]) <= 1e-5  # frames attend within themselves


def test_tap_conv_equals_the_3d_conv_and_keeps_its_layout(monkeypatch):
    """The fast decoder's per-time-tap conv (`_tap_conv`): on a channels-last input with fewer than
    TAP_CONV_BELOW channels it is one 2-D conv over the three time taps' frames side by side in the channels,
    equal to the 3-D conv up to fp32 rounding and channels-last-3d; wider or contiguous inputs take the 3-D
    conv itself."""
    import torch.nn.functional as F

    g = _gen(41)
    x = torch.randn(1, 8, 5, 6, 7, generator=g).contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(8, 8, 3, 3, 3, generator=g).contiguous(memory_format=torch.channels_last_3d)
    b = torch.randn(8, generator=g)
    ref = F.conv3d(x, w, b, padding=(0, 1, 1))
    calls = []
    conv2d = F.conv2d
    monkeypatch.setattr(
        V.F, "conv2d", lambda *a, **k: calls.append((a[0].shape, a[1].shape)) or conv2d(*a, **k)
    )
    out = V._tap_conv(x, w, b)
    assert calls == [((3, 24, 6, 7), (8, 24, 3, 3))]  # one conv: 3 output frames, 3 taps x 8 channels in
    assert out.shape == ref.shape == (1, 8, 3, 6, 7) and _rel(out, ref) <= 1e-6
    assert out.stride() == (8 * 3 * 6 * 7, 1, 6 * 7 * 8, 7 * 8, 8) and not torch.equal(out, ref)
    assert torch.equal(V._tap_conv(x.contiguous(), w, b), F.conv3d(x.contiguous(), w, b, padding=(0, 1, 1)))
    wide = V.TAP_CONV_BELOW
    xw = torch.randn(1, wide, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last_3d)
    ww = torch.randn(wide, wide, 3, 3, 3, generator=g) * 0.05
    assert torch.equal(V._tap_conv(xw, ww, None), F.conv3d(xw, ww, None, padding=(0, 1, 1)))


def test_a_narrow_residual_step_runs_both_convs_per_tap_and_keeps_canonical_strides(monkeypatch):
    """Both convs of a channels-last residual block under TAP_CONV_BELOW channels go over their stacked time taps,
    not through a 3-D conv (the second conv's input, made from the first's output, stays channels-last), and the
    output and both new caches have channels-last-3d's strides, so the compiled decoder's `_canonical` copies
    none of them."""
    import torch.nn.functional as F

    calls = []
    conv3d = F.conv3d
    monkeypatch.setattr(V.F, "conv3d", lambda *a, **k: calls.append(a[0].shape) or conv3d(*a, **k))
    g = _gen(43)
    cl = torch.channels_last_3d

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).contiguous(memory_format=cl)

    c, t, h, w = 8, 2, 5, 6
    x, c1, c2 = rand(1, c, t, h, w), rand(1, c, 2, h, w), rand(1, c, 2, h, w)
    gain = torch.ones(c, 1, 1, 1) * c**0.5
    w1, w2 = rand(c, c, 3, 3, 3, scale=0.1), rand(c, c, 3, 3, 3, scale=0.1)
    b1, b2 = torch.randn(c, generator=g), torch.randn(c, generator=g)
    y, n1, n2 = V._residual_step(x, c1, c2, gain, w1, b1, gain, w2, b2, None, None)
    assert calls == []

    assert y.shape == x.shape and n1.shape == n2.shape == (1, c, 2, h, w)
    assert channels_last_3d(y) and channels_last_3d(n1) and channels_last_3d(n2)


def test_a_full_sub_chunk_keeps_its_frames_as_the_cache_and_views_are_not_copied():
    """With exactly CACHE_T new frames, `_causal_pad`'s next cache is those frames themselves (no copy), equal to
    the padded input's last CACHE_T; with fewer it is a dense copy. `DecoderLevers._canonical` gives a
    sub-chunk's view (strides off only in its size-1 batch dim) channels-last-3d's strides without a copy, and
    still copies a tensor in another layout."""
    g = _gen(47)
    cl = torch.channels_last_3d
    cache = torch.randn(1, 4, 2, 3, 5, generator=g).contiguous(memory_format=cl)
    x = torch.randn(1, 4, 2, 3, 5, generator=g).contiguous(memory_format=cl)
    padded, nxt = V._causal_pad(x, cache)
    assert nxt is x and torch.equal(padded[:, :, -V.CACHE_T :], nxt) and padded.shape[2] == 4
    one = x[:, :, :1].contiguous(memory_format=cl)
    padded, nxt = V._causal_pad(one, cache)
    assert nxt.data_ptr() != padded.data_ptr() and torch.equal(nxt, padded[:, :, -V.CACHE_T :])
    assert torch.equal(nxt, torch.cat([cache[:, :, 1:], one], dim=2))

    levers = V.DecoderLevers.__new__(V.DecoderLevers)
    levers.fmt = cl
    whole = torch.randn(1, 4, 6, 3, 5, generator=g).contiguous(memory_format=cl)
    view = whole[:, :, 2:4]
    assert view.stride()[0] != 4 * 2 * 3 * 5  # the view's batch stride is the whole tensor's
    out = levers._canonical(view)
    assert out.data_ptr() == view.data_ptr() and torch.equal(out, view)
    assert out.stride() == (4 * 2 * 3 * 5, 1, 3 * 5 * 4, 5 * 4, 4)
    dense = torch.randn(1, 4, 2, 3, 5, generator=g)  # contiguous, not channels-last: copied
    copied = levers._canonical(dense)
    assert copied.data_ptr() != dense.data_ptr() and torch.equal(copied, dense)
    assert copied.stride() == out.stride()
