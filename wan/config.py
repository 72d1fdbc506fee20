"""Upstream LingBot-World i2v-A14B settings in one place (wan/configs/wan_i2v_A14B.py upstream)."""

from dataclasses import dataclass

NUM_TRAIN_TIMESTEPS = 1000
VAE_STRIDE = (4, 8, 8)
PATCH_SIZE = (1, 2, 2)
TEXT_LEN = 512
# Intrinsics in poses/intrinsics.npy are given at this pixel size (upstream hard-codes it).
INTRINSICS_SIZE = (480, 832)

# Upstream i2v-A14B negative prompt (Wan's default list plus LingBot's additions).
NEGATIVE_PROMPT = (
    "画面突变，色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，"
    "低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，"
    "形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走，镜头晃动，画面闪烁，"
    "模糊，噪点，水印，签名，文字，变形，扭曲，液化，不合逻辑的结构，卡顿，PPT幻灯片感，过暗，欠曝，低对比度，"
    "霓虹灯光感，过度锐化，3D渲染感，人物，行人，游客，身体，皮肤，肢体，面部特征，汽车，电线"
)

# Channels of the packed camera tensor per latent pixel (8x8 pixel block folded in).
CONTROL_CHANNELS = {"cam": 6 * 64, "act": 7 * 64}


@dataclass(frozen=True)
class DiTConfig:
    """Constructor arguments of the diffusion transformer; field names are upstream config.json's."""

    model_type: str = "i2v"
    patch_size: tuple = PATCH_SIZE
    text_len: int = TEXT_LEN
    in_dim: int = 36
    dim: int = 5120
    ffn_dim: int = 13824
    freq_dim: int = 256
    text_dim: int = 4096
    out_dim: int = 16
    num_heads: int = 40
    num_layers: int = 40
    window_size: tuple = (-1, -1)
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    # 'cam' (6 control channels), 'act' (7) or None (plain Wan2.2 i2v, no camera layers).
    control_type: str | None = "cam"


A14B = DiTConfig()
# LingBot-World 2.0 1.3B causal-fast (upstream task i2v-1.3B); its checkpoint ships no config.json.
V2_1_3B = DiTConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)


@dataclass(frozen=True)
class ChunkedKind:
    """What tells the chunk-causal models apart (data for the one chunk loop, not a second loop)."""

    name: str
    dit: DiTConfig
    chunk_frames: int  # latent frames per chunk
    timestep_index: tuple[int, ...]  # indices into the 1000-step shifted schedule, one per step
    shift: float
    local_attn_size: int  # the documented run's self-attention window in latent frames (-1: all)
    sink_size: int  # latent frames at the start the window never evicts


ROPE_FRAMES = 1024  # rows of the chunked models' RoPE tables: the longest clip in latent frames


def max_frame_num(chunk: int) -> int:
    """The longest chunked clip in video frames: whole chunks of `chunk` latent frames within the RoPE table."""
    return (ROPE_FRAMES - ROPE_FRAMES % chunk - 1) * VAE_STRIDE[0] + 1


# v1 Fast keeps upstream's CLI defaults (unbounded cache); v2's documented run is window 18, sink 6.
CHUNKED_KINDS = {
    k.name: k
    for k in (
        ChunkedKind("fast", A14B, 3, (0, 179, 358, 679), 10.0, -1, 0),
        ChunkedKind("v2-14b", A14B, 4, (0, 250, 500, 750), 10.0, 18, 6),
        ChunkedKind("v2-1.3b", V2_1_3B, 4, (0, 250, 500, 750), 5.0, 18, 6),
    )
}


@dataclass(frozen=True)
class SampleConfig:
    """Upstream sampling defaults for LingBot-World i2v-A14B."""

    sample_shift: float = 10.0
    sample_steps: int = 70
    boundary: float = 0.947
    # (low-noise, high-noise), upstream's tuple order.
    guide_scale: tuple = (5.0, 5.0)
    sample_fps: int = 16
    frame_num: int = 81
    max_area: int = 480 * 832
    solver: str = "unipc"
    negative_prompt: str = NEGATIVE_PROMPT
    seed: int = 42


def __getattr__(name: str):
    """T5_DTYPE (torch.bfloat16) without importing torch here: the command line builds its parser from
    this module, and `--help` answers without loading torch."""
    if name == "T5_DTYPE":
        import torch

        return torch.bfloat16
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
