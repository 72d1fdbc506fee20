"""ComfyUI's `umt5xxl_model_config` read off a umT5 encoder state dict's shapes (plain Python, so the
text-parity script can use it without importing this test node package)."""


def umt5_config(sd: dict) -> dict:
    blocks = {int(k.split(".")[2]) for k in sd if k.startswith("encoder.block.")}
    d_ff, d_model = sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape
    heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    inner = sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0]
    return {
        "d_model": d_model,
        "d_ff": d_ff,
        "num_layers": len(blocks),
        "num_heads": heads,
        "d_kv": inner // heads,
        "vocab_size": sd["shared.weight"].shape[0],
    }
