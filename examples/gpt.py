"""The project's GPT-style decoder (the demo's model, and the tests' at smaller sizes): token and position
embeddings, pre-norm blocks with causal self-attention (scaled_dot_product_attention) and a GELU MLP, dropout, and
an output head tied to the token embedding. `make_gpt_demo()` returns (model, sample_input) as
`python -m planner plan` expects; `gpt_loss(logits, targets)` is the next-token cross-entropy the demo trains with.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        # attention dropout 0: on CPU this is one fused flash-attention op (+ its backward)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; the output head shares the token embedding's weight (tied)."""

    def __init__(self, vocab: int = 512, d_model: int = 128, n_heads: int = 4, n_layers: int = 4,
                 seq: int = 128, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d_model, n_heads, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_gpt_demo(batch: int = 8, seq: int = 128, vocab: int = 512, d_model: int = 128, n_heads: int = 4,
                  n_layers: int = 4, dropout: float = 0.1, seed: int = 0):
    """(model in training mode, a batch of token ids of shape (batch, seq))."""
    torch.manual_seed(seed)
    model = GPT(vocab, d_model, n_heads, n_layers, seq, dropout).train()
    return model, torch.randint(0, vocab, (batch, seq))


def gpt_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i + 1."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
