"""umT5-XXL text encoder (the encoder half of umT5), as upstream Wan runs it.

Parameter names and shapes are those of upstream's `models_t5_umt5-xxl-enc-bf16.pth`
(`token_embedding.weight`, `blocks.N.attn.q.weight`, `blocks.N.ffn.gate.0.weight`,
`blocks.N.pos_embedding.embedding.weight`, `norm.weight`, ...), so that file loads with no renaming.
umT5 gives every block its own relative position bias (upstream `shared_pos=False`).

The arithmetic follows upstream op by op, dtypes included: the RMS statistic of T5LayerNorm in fp32,
the tanh GELU written out in the weight dtype, no 1/sqrt(d) attention scaling, additive bias built in
the activation dtype with padding masked to its dtype's minimum, softmax in fp32, and the fp16-only
clamp of the residual stream. Dropout (identity in eval mode, the only mode upstream encodes in)
is left out.
"""

import math

import torch
from torch import nn

# Upstream `umt5_xxl(encoder_only=True)`.
UMT5_XXL = dict(
    vocab=256384, dim=4096, dim_attn=4096, dim_ffn=10240, num_heads=64, num_layers=24, num_buckets=32
)


def fp16_clamp(x: torch.Tensor) -> torch.Tensor:
    """Pull fp16 infinities back into range (a no-op for bf16 and fp32), as upstream."""
    if x.dtype == torch.float16 and torch.isinf(x).any():
        limit = torch.finfo(x.dtype).max - 1000
        x = torch.clamp(x, min=-limit, max=limit)
    return x


class GELU(nn.Module):
    """tanh-approximated GELU written out term by term (runs in the input dtype, like upstream)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class T5LayerNorm(nn.Module):
    """RMS norm without mean subtraction or bias; statistic in fp32, result cast to the weight dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.type_as(self.weight)
        return self.weight * x


class T5Attention(nn.Module):
    def __init__(self, dim: int, dim_attn: int, num_heads: int):
        super().__init__()
        if dim_attn % num_heads:
            raise ValueError(f"dim_attn {dim_attn} is not a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim_attn // num_heads
        self.q = nn.Linear(dim, dim_attn, bias=False)
        self.k = nn.Linear(dim, dim_attn, bias=False)
        self.v = nn.Linear(dim, dim_attn, bias=False)
        self.o = nn.Linear(dim_attn, dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, pos_bias: torch.Tensor) -> torch.Tensor:
        """x: [B, L, C]; mask: [B, L] (0 = padding) or None; pos_bias: [1, heads, L, L]."""
        b, n, c = x.size(0), self.num_heads, self.head_dim
        q = self.q(x).view(b, -1, n, c)
        k = self.k(x).view(b, -1, n, c)
        v = self.v(x).view(b, -1, n, c)

        bias = x.new_zeros(b, n, q.size(1), k.size(1))
        bias += pos_bias
        if mask is not None:
            bias.masked_fill_(mask.view(b, 1, 1, -1) == 0, torch.finfo(x.dtype).min)

        # T5 puts no 1/sqrt(head_dim) scale on the logits.
        attn = torch.einsum("binc,bjnc->bnij", q, k) + bias
        attn = torch.softmax(attn.float(), dim=-1).type_as(attn)
        x = torch.einsum("bnij,bjnc->binc", attn, v)
        return self.o(x.reshape(b, -1, n * c))


class T5FeedForward(nn.Module):
    """Gated GELU: fc2(fc1(x) * gelu(gate(x)))."""

    def __init__(self, dim: int, dim_ffn: int):
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(dim, dim_ffn, bias=False), GELU())
        self.fc1 = nn.Linear(dim, dim_ffn, bias=False)
        self.fc2 = nn.Linear(dim_ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) * self.gate(x))


class T5RelativeEmbedding(nn.Module):
    """Bucketed relative position bias (T5's log-spaced buckets), one scalar per head."""

    def __init__(self, num_buckets: int, num_heads: int, bidirectional: bool = True, max_dist: int = 128):
        super().__init__()
        self.num_buckets = num_buckets
        self.bidirectional = bidirectional
        self.max_dist = max_dist
        self.embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, lq: int, lk: int) -> torch.Tensor:
        """[1, heads, lq, lk] bias for query i attending key j (relative position j - i)."""
        device = self.embedding.weight.device
        rel_pos = torch.arange(lk, device=device).unsqueeze(0) - torch.arange(lq, device=device).unsqueeze(1)
        embeds = self.embedding(self.bucket(rel_pos))  # [lq, lk, heads]
        return embeds.permute(2, 0, 1).unsqueeze(0).contiguous()

    def bucket(self, rel_pos: torch.Tensor) -> torch.Tensor:
        if self.bidirectional:
            num_buckets = self.num_buckets // 2
            buckets = (rel_pos > 0).long() * num_buckets
            rel_pos = torch.abs(rel_pos)
        else:
            num_buckets = self.num_buckets
            buckets = 0
            rel_pos = -torch.min(rel_pos, torch.zeros_like(rel_pos))
        # Half the buckets are exact offsets, the rest log-spaced out to max_dist.
        max_exact = num_buckets // 2
        large = (
            max_exact
            + (
                torch.log(rel_pos.float() / max_exact)
                / math.log(self.max_dist / max_exact)
                * (num_buckets - max_exact)
            ).long()
        )
        large = torch.min(large, torch.full_like(large, num_buckets - 1))
        return buckets + torch.where(rel_pos < max_exact, rel_pos, large)


class T5Block(nn.Module):
    """Pre-norm self-attention + gated FFN with its own relative position bias (umT5)."""

    def __init__(self, dim: int, dim_attn: int, dim_ffn: int, num_heads: int, num_buckets: int):
        super().__init__()
        self.norm1 = T5LayerNorm(dim)
        self.attn = T5Attention(dim, dim_attn, num_heads)
        self.norm2 = T5LayerNorm(dim)
        self.ffn = T5FeedForward(dim, dim_ffn)
        self.pos_embedding = T5RelativeEmbedding(num_buckets, num_heads, bidirectional=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        e = self.pos_embedding(x.size(1), x.size(1))
        x = fp16_clamp(x + self.attn(self.norm1(x), mask, e))
        return fp16_clamp(x + self.ffn(self.norm2(x)))


class T5Encoder(nn.Module):
    """umT5 encoder stack. forward(ids [B, L] int64, mask [B, L]) -> [B, L, dim] in the weight dtype."""

    def __init__(
        self,
        vocab: int,
        dim: int,
        dim_attn: int,
        dim_ffn: int,
        num_heads: int,
        num_layers: int,
        num_buckets: int,
    ):
        super().__init__()
        self.config = dict(
            vocab=vocab,
            dim=dim,
            dim_attn=dim_attn,
            dim_ffn=dim_ffn,
            num_heads=num_heads,
            num_layers=num_layers,
            num_buckets=num_buckets,
        )
        self.token_embedding = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [T5Block(dim, dim_attn, dim_ffn, num_heads, num_buckets) for _ in range(num_layers)]
        )
        self.norm = T5LayerNorm(dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.token_embedding(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)


@torch.no_grad()
def encode_trimmed(model: T5Encoder, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Run the encoder on padded ids and cut each row to its true token count (upstream's output)."""
    context = model(ids, mask)
    seq_lens = mask.gt(0).sum(dim=1).long()
    return [u[:v] for u, v in zip(context, seq_lens, strict=True)]


def init_random_(model: T5Encoder, seed: int = 0) -> T5Encoder:
    """Fill weights in place with upstream's init distributions (bench_t5's upstream-style baseline)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = param_std(name, model.config)
            p.fill_(1.0) if std is None else p.normal_(0.0, std, generator=g)
    return model


def random_param(name: str, shape: tuple, config: dict, generator: torch.Generator) -> torch.Tensor:
    """An fp32 tensor of `shape` drawn like upstream's init for parameter `name` (upstream naming)."""
    std = param_std(name, config)
    return torch.ones(shape) if std is None else torch.randn(shape, generator=generator) * std


def param_std(name: str, config: dict) -> float | None:
    """Std of upstream's `init_weights` normal init for a parameter; None for norms (ones)."""
    dim, dim_attn, dim_ffn = config["dim"], config["dim_attn"], config["dim_ffn"]
    heads, buckets = config["num_heads"], config["num_buckets"]
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        return None
    std = {
        "token_embedding.weight": 1.0,
        "attn.q.weight": (dim * dim_attn) ** -0.5,
        "attn.k.weight": dim**-0.5,
        "attn.v.weight": dim**-0.5,
        "attn.o.weight": (heads * dim_attn) ** -0.5,
        "ffn.gate.0.weight": dim**-0.5,
        "ffn.fc1.weight": dim**-0.5,
        "ffn.fc2.weight": dim_ffn**-0.5,
        "pos_embedding.embedding.weight": (2 * buckets * heads) ** -0.5,
    }
    for suffix, s in std.items():
        if name.endswith(suffix):
            return s
    raise ValueError(f"no init rule for parameter {name!r}")
