"""The seeds' walk-through shapes of one forward, from a model's config alone."""

from __future__ import annotations

def expected(config, B: int, T: int) -> dict[str, list[int]]:
    """What the seeds' walk-through says each step's shape is, from the config alone."""
    d, H, dh, m, V = config.d_model, config.n_head, config.d_model // config.n_head, config.d_mlp, config.vocab_size
    return {"token ids": [B, T], "token embedding": [V, d], "position embedding": [config.n_ctx, d],
            "token + position embeddings": [B, T, d], "attention norm": [d], "W_QKV": [d, 3 * d],
            "Q, K, V": [B, T, 3 * d], "Q per head": [B, H, T, dh], "K per head": [B, H, T, dh],
            "V per head": [B, H, T, dh], "QKᵀ / √d_head, masked": [B, H, T, T],
            "softmax: attention weights": [B, H, T, T], "weights × V": [B, H, T, dh], "heads merged": [B, T, d],
            "W_O (projection)": [d, d], "attention output": [B, T, d], "W_up (fc)": [d, m],
            "MLP hidden, GELU": [B, T, m], "W_down (proj)": [m, d], "MLP output": [B, T, d],
            "residual + MLP": [B, T, d], "last row": [B, d], "final norm": [d], "lm_head": [d, V],
            "logits": [B, V], "chosen token": [B]}
