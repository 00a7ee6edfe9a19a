"""Small test models for the tracer and the executor. Each `make_*()` returns (model, sample_input).

Sizes are small by default so that tracing and running take well under a second each.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt import GPT


# ---- MLP ---------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def make_mlp(batch: int = 32, width: int = 64, depth: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    return MLP(width, depth).train(), torch.randn(batch, width)


# ---- CNN with BatchNorm and residual connections --------------------------------------------------
class ResBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.c1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(ch)
        self.c2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(ch)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        return F.relu(x + self.b2(self.c2(h)))


class ResCNN(nn.Module):
    def __init__(self, ch: int = 8, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(ch) for _ in range(blocks)])
        self.head = nn.Linear(ch, classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


def make_cnn(batch: int = 4, ch: int = 8, size: int = 16, blocks: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return ResCNN(ch, blocks).train(), torch.randn(batch, 3, size, size)


# ---- GPT-style decoder: the one in examples/gpt.py, at test sizes ----------------------------------
def make_gpt(batch: int = 2, seq: int = 16, vocab: int = 64, d_model: int = 32, n_heads: int = 4,
             n_layers: int = 2, dropout: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(vocab, d_model, n_heads, n_layers, seq, dropout).train()
    return model, torch.randint(0, vocab, (batch, seq))


class UntiedGPT(GPT):
    """The same decoder with its own output-head weight (not shared with the token embedding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = nn.Linear(self.tok.embedding_dim, self.tok.num_embeddings, bias=False)


def make_gpt_untied(batch: int = 2, seq: int = 16, vocab: int = 64, d_model: int = 32, n_heads: int = 4,
                    n_layers: int = 2, dropout: float = 0.1, seed: int = 0):
    """GPT with dropout and an untied head: PyTorch's aot_module refuses tied weights."""
    torch.manual_seed(seed)
    model = UntiedGPT(vocab, d_model, n_heads, n_layers, seq, dropout).train()
    return model, torch.randint(0, vocab, (batch, seq))


# ---- U-Net-like model with long skip connections -----------------------------------------------------
def _conv_block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, ch: int = 4, depth: int = 2):
        super().__init__()
        self.downs = nn.ModuleList()
        c = 3
        widths = []
        for k in range(depth):
            w = ch * 2**k
            self.downs.append(_conv_block(c, w))
            widths.append(w)
            c = w
        self.mid = _conv_block(c, c * 2)
        c = c * 2
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for w in reversed(widths):
            self.ups.append(nn.ConvTranspose2d(c, w, 2, stride=2))
            self.up_convs.append(_conv_block(2 * w, w))
            c = w
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)  # long skip: kept until the matching up level
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips)):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def make_unet(batch: int = 2, ch: int = 4, size: int = 16, depth: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return UNet(ch, depth).train(), torch.randn(batch, 3, size, size)


MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "gpt": make_gpt, "unet": make_unet}
