"""A small GPT-style decoder for the demo: token and position embeddings, pre-norm blocks with causal
self-attention (scaled_dot_product_attention) and a GELU MLP, dropout, and an output head tied to the token
embedding. `make_gpt_demo()` returns (model, sample_input) as `python -m planner plan` expects;
`gpt_loss(logits, targets)` is the next-token cross-entropy the demo trains with.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.resid_drop(self.out(y.transpose(1, 2).reshape(b, t, d)))


class DecoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, d_model: int = 128, n_heads: int = 4, n_layers: int = 4,
                 max_seq: int = 128, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList([DecoderBlock(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def make_gpt_demo(batch: int = 8, seq: int = 128, vocab: int = 512, d_model: int = 128, n_heads: int = 4,
                  n_layers: int = 4, dropout: float = 0.1, seed: int = 0):
    """(model in training mode, a batch of token ids of shape (batch, seq))."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab, d_model, n_heads, n_layers, seq, dropout).train()
    return model, torch.randint(0, vocab, (batch, seq))


def gpt_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
