"""Random architectures for the whole-model planner's property test (issue 50: no silent wrong answer).

`random_model(seed) -> (model, sample_input, description)` builds, deterministically from the seed, a small
random network in train mode, one sample input for it and a `Description` naming every grammar choice (its
`str()` is the failure report; `loss_fn` is the loss the training step computes from the output, None for the
default one; `plan_loss_fn` is what to pass to `plan(loss_fn=)`).

The grammar. Every value is a (B, T, D) activation (B 2-4, T 8 or 16, widths 8-32; a cat can go up to 48):

- input: float features (B, T, Din) through a Linear stem or used as is; token ids (B, T) through an Embedding;
  an image (B, C, H, W) with H*W = T through a Conv2d stem;
- the input's form: a tensor, a tuple (positional), a dict of keyword arguments, or (args, kwargs); a dict or
  (args, kwargs) sometimes carries a non-tensor keyword constant (`scale=0.5`);
- 3-10 ops, each reading earlier values (mostly recent ones):
  linear (bias or not, sometimes fused with an activation, an in-place relu_ or a slice mul_), conv1d (k 1/3/5,
  sometimes BatchNorm1d), conv2d on the (H, W) grid (sometimes BatchNorm2d), a norm (LayerNorm, RMSNorm,
  BatchNorm1d on (B, D, T) or on (B*T, D)), an activation (relu, gelu, silu, tanh; functional or module), dropout
  (functional or module), a residual add (torch.add with alpha sometimes), an in-place add_ or mul_ (of a fresh
  product, by another value or its sigmoid), cat, chunk, split, a view/reshape/transpose shuffle, a manual
  rms-normalisation with a broadcast mean, scaled_dot_product_attention (1/2/4 heads; no mask, is_causal, a bool
  tril buffer, a data-dependent bool mask, or a learned float bias; dropout 0 or 0.1), an attention written as
  matmuls of activations (softmax(a b^T) c), a gram product (einsum of a^T b with a), a custom
  torch.autograd.Function (softsign saving its input; scaled tanh saving its output, with a non-tensor argument),
  a running-average buffer and a step counter updated in forward, a second call of an earlier Linear (a shared
  module), a Linear tied to an earlier one's weight (as is or transposed), a dead branch whose only effect is
  a BatchNorm's statistics update, and a value read in Python (a branch on `.item()` or on a tensor comparison,
  or the value itself as a constant);
- the outputs: every value no op read is gathered (cat + Linear where there are several) into one to three heads;
- the loss: computed in the model (mse, cross-entropy with or without label smoothing, smooth_l1) against a target
  input, returned as a scalar, a dict {"loss", "pred"} or a tuple (loss, pred), the head of a cross-entropy over
  token ids sometimes tied to the embedding; or outputs (a tensor, a tuple or a dict) with a loss_fn passed to
  plan (mse against fixed targets, cross-entropy against fixed labels, sum of squares); or outputs with the default
  loss (the sum of the outputs) and no loss_fn.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

WIDTHS = (8, 12, 16, 24, 32)
MAX_WIDTH = 48


# ---- custom autograd functions -------------------------------------------------------------------
class SoftsignFn(torch.autograd.Function):
    """x / (1 + |x|), saving its input."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        d = 1 + x.abs()
        return g / (d * d)


class ScaledTanhFn(torch.autograd.Function):
    """scale * tanh(x), saving its output; `scale` is a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, scale: float):
        y = torch.tanh(x) * scale
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        s = ctx.scale
        return g * (s - y * y / s), None


# ---- ops: each reads the values `srcs` and returns a tuple of new (B, T, D) values ----------------------------
class Op(nn.Module):
    def __init__(self, srcs: list[int]):
        super().__init__()
        self.srcs = list(srcs)


ACTS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
ACT_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}


class LinearOp(Op):
    def __init__(self, srcs, d_in, d_out, bias, post):
        super().__init__(srcs)
        self.lin = nn.Linear(d_in, d_out, bias=bias)
        self.post = post  # None, an activation name, "relu_" or "slice_mul_"

    def forward(self, x):
        h = self.lin(x)
        if self.post == "relu_":
            h.relu_()
        elif self.post == "slice_mul_":
            h[..., : h.shape[-1] // 2].mul_(0.5)
        elif self.post is not None:
            h = ACTS[self.post](h)
        return (h,)


class Conv1dOp(Op):
    def __init__(self, srcs, d_in, d_out, k, bn):
        super().__init__(srcs)
        self.conv = nn.Conv1d(d_in, d_out, k, padding=k // 2)
        self.bn = nn.BatchNorm1d(d_out) if bn else None

    def forward(self, x):
        h = self.conv(x.transpose(1, 2))
        if self.bn is not None:
            h = self.bn(h)
        return (h.transpose(1, 2),)


class Conv2dOp(Op):
    def __init__(self, srcs, d_in, d_out, hw, bn):
        super().__init__(srcs)
        self.hw = hw
        self.conv = nn.Conv2d(d_in, d_out, 3, padding=1, bias=not bn)
        self.bn = nn.BatchNorm2d(d_out) if bn else None

    def forward(self, x):
        b, t, d = x.shape
        h = self.conv(x.transpose(1, 2).reshape(b, d, *self.hw))
        if self.bn is not None:
            h = F.relu(self.bn(h))
        return (h.flatten(2).transpose(1, 2),)


class NormOp(Op):
    def __init__(self, srcs, kind, d):
        super().__init__(srcs)
        self.kind = kind
        self.norm = {"layernorm": lambda: nn.LayerNorm(d), "rmsnorm": lambda: nn.RMSNorm(d),
                     "batchnorm1d_3d": lambda: nn.BatchNorm1d(d), "batchnorm1d_2d": lambda: nn.BatchNorm1d(d),
                     "batchnorm1d_cma": lambda: nn.BatchNorm1d(d, momentum=None)}[kind]()

    def forward(self, x):
        if self.kind in ("batchnorm1d_3d", "batchnorm1d_cma"):
            return (self.norm(x.transpose(1, 2)).transpose(1, 2),)
        if self.kind == "batchnorm1d_2d":
            return (self.norm(x.reshape(-1, x.shape[-1])).view(x.shape),)
        return (self.norm(x),)


class ActOp(Op):
    def __init__(self, srcs, kind, as_module):
        super().__init__(srcs)
        self.kind = kind
        self.act = ACT_MODULES[kind]() if as_module else None

    def forward(self, x):
        return (self.act(x) if self.act is not None else ACTS[self.kind](x),)


class DropoutOp(Op):
    def __init__(self, srcs, p, as_module):
        super().__init__(srcs)
        self.p = p
        self.drop = nn.Dropout(p) if as_module else None

    def forward(self, x):
        return (self.drop(x) if self.drop is not None else F.dropout(x, self.p, self.training),)


class AddOp(Op):
    def __init__(self, srcs, alpha):
        super().__init__(srcs)
        self.alpha = alpha

    def forward(self, a, b):
        return (a + b if self.alpha is None else torch.add(a, b, alpha=self.alpha),)


class InplaceOp(Op):
    """An in-place update of a fresh product: `h = a * 0.5; h.add_(b)`, `h = a * 1.0; h.mul_(b)` or
    `h.mul_(sigmoid(b))`."""

    def __init__(self, srcs, kind):
        super().__init__(srcs)
        self.kind = kind

    def forward(self, a, b):
        if self.kind == "add_":
            h = a * 0.5
            h.add_(b)
        elif self.kind == "mul_":
            h = a * 1.0
            h.mul_(b)
        else:  # "mul_sigmoid_"
            h = a * 2.0
            h.mul_(torch.sigmoid(b))
        return (h,)


class CatOp(Op):
    def forward(self, a, b):
        return (torch.cat([a, b], dim=-1),)


class ChunkOp(Op):
    def forward(self, x):
        return tuple(x.chunk(2, dim=-1))


class SplitOp(Op):
    def __init__(self, srcs, sizes):
        super().__init__(srcs)
        self.sizes = list(sizes)

    def forward(self, x):
        return tuple(x.split(self.sizes, dim=-1))


class ShuffleOp(Op):
    """A shape-preserving mix of views, reshapes and transposes."""

    def __init__(self, srcs, kind, groups):
        super().__init__(srcs)
        self.kind = kind
        self.groups = groups

    def forward(self, x):
        b, t, d = x.shape
        if self.kind == "group_transpose":
            return (x.view(b, t, self.groups, d // self.groups).transpose(-1, -2).reshape(b, t, d),)
        if self.kind == "time_feature":
            return (x.transpose(1, 2).reshape(b, t, d),)
        # "permute_contiguous": batch and time swapped, made contiguous, swapped back, then a flat view
        y = x.permute(1, 0, 2).contiguous().permute(1, 0, 2)
        return (y.flatten(1).unflatten(1, (t, d)),)


class RmsBroadcastOp(Op):
    def forward(self, x):
        y = x - x.mean(1, keepdim=True)
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5),)


class SdpaOp(Op):
    def __init__(self, srcs, d, heads, mask, p, t):
        super().__init__(srcs)
        self.heads, self.mask, self.p = heads, mask, p
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        if mask == "bool_buffer":
            self.register_buffer("tril", torch.ones(t, t, dtype=torch.bool).tril(), persistent=False)
        elif mask == "param_bias":
            self.bias = nn.Parameter(0.1 * torch.randn(heads, t, t))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        p = self.p if self.training else 0.0
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            if self.mask == "bool_buffer":
                m = self.tril
            elif self.mask == "data_bool":  # keys attended where the input's first feature is positive, and itself
                m = (x.detach()[:, None, :, 0] > 0) | torch.eye(t, dtype=torch.bool)
                m = m[:, None]
            elif self.mask == "param_bias":
                m = self.bias
            else:
                m = None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
        return (self.out(y.transpose(1, 2).reshape(b, t, d)),)


class MatmulAttnOp(Op):
    def forward(self, a, b, c):
        s = (a @ b.transpose(-1, -2)) * a.shape[-1] ** -0.5
        return (torch.matmul(s.softmax(-1), c),)


class GramOp(Op):
    def forward(self, a, b):
        g = a.transpose(1, 2) @ b / a.shape[1]
        return (torch.einsum("btd,bde->bte", a, g),)


class CustomFnOp(Op):
    def __init__(self, srcs, kind):
        super().__init__(srcs)
        self.kind = kind

    def forward(self, x):
        return (SoftsignFn.apply(x) if self.kind == "softsign" else ScaledTanhFn.apply(x, 1.5),)


class EmaOp(Op):
    """Buffers updated in forward: a running mean of the input's features and a step counter."""

    def __init__(self, srcs, d):
        super().__init__(srcs)
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean((0, 1)), alpha=0.1)
            self.count += 1
        return (x + self.ema * (0.5 + 0.01 * self.count.float()),)


class SharedOp(Op):
    """A second call of an earlier op's Linear (one module, two calls)."""

    def __init__(self, srcs, lin: nn.Linear):
        super().__init__(srcs)
        self.lin = lin

    def forward(self, x):
        return (self.lin(x),)


class TiedOp(Op):
    """A Linear whose weight is an earlier Linear's: as is (a second Linear module given the same Parameter) or
    transposed (a tied decoder, `F.linear(x, lin.weight.t(), own bias)`)."""

    def __init__(self, srcs, lin: nn.Linear, transposed: bool):
        super().__init__(srcs)
        self.transposed = transposed
        if transposed:
            self.src_lin = lin
            self.bias = nn.Parameter(torch.zeros(lin.in_features))
        else:
            self.tied = nn.Linear(lin.in_features, lin.out_features)
            self.tied.weight = lin.weight

    def forward(self, x):
        if self.transposed:
            return (F.linear(x, self.src_lin.weight.t(), self.bias),)
        return (self.tied(x),)


class DeadBranchOp(Op):
    """A BatchNorm whose output is discarded: its only effect is the update of its statistics."""

    def __init__(self, srcs, d):
        super().__init__(srcs)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        self.bn(x.transpose(1, 2))
        return ()


class ReadOp(Op):
    """A forward that reads a value in Python: a branch on `.item()`, a branch on a tensor comparison, or the value
    itself used as a constant."""

    def __init__(self, srcs, kind):
        super().__init__(srcs)
        self.kind = kind

    def forward(self, x):
        if self.kind == "item_branch":
            return (x * (2.0 if x.detach().mean().item() > 0 else 0.5),)
        if self.kind == "tensor_branch":
            return (x * 3 if x.mean() > 0.2 else x + 1,)
        return (x / (1.0 + float(x.detach().abs().max())),)


class MergeOp(Op):
    """Several values gathered into one: cat along the features, then a Linear."""

    def __init__(self, srcs, d_in, d_out):
        super().__init__(srcs)
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, *xs):
        return (self.lin(torch.cat(xs, dim=-1)) if len(xs) > 1 else self.lin(xs[0]),)


# ---- the model ---------------------------------------------------------------------------------------------
class RandomNet(nn.Module):
    def __init__(self, cfg: dict, stem: nn.Module | None, ops: list[Op], heads: list[nn.Module], head_srcs: list[int]):
        super().__init__()
        self.cfg = cfg
        self.stem = stem
        self.ops = nn.ModuleList(ops)
        self.heads = nn.ModuleList(heads)
        self.head_srcs = head_srcs

    def _stem(self, x):
        kind = self.cfg["input"]
        if kind == "tokens":
            return self.stem(x)
        if kind == "image":
            return self.stem(x).flatten(2).transpose(1, 2)
        return x if self.stem is None else self.stem(x)

    def _head(self, k, h):
        if self.cfg.get("tied_head") and k == 0:
            return F.linear(h, self.stem.weight)
        return self.heads[k](h)

    def forward(self, x, target=None, scale: float = 1.0):
        env = [self._stem(x)]
        for op in self.ops:
            env.extend(op(*[env[i] for i in op.srcs]))
        outs = [self._head(k, env[i]) for k, i in enumerate(self.head_srcs)]
        if scale != 1.0:
            outs = [o * scale for o in outs]
        loss = self.cfg["loss"]
        if loss.startswith("own_"):
            pred = outs[0]
            if loss == "own_mse":
                value = F.mse_loss(pred, target)
            elif loss == "own_smooth_l1":
                value = F.smooth_l1_loss(pred, target, beta=0.5)
            else:
                value = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1),
                                        label_smoothing=self.cfg["label_smoothing"])
            form = self.cfg["own_form"]
            if form == "scalar":
                return value
            if form == "dict":
                return {"loss": value, "pred": pred}
            return value, pred
        form = self.cfg["out_form"]
        if form == "tensor":
            return outs[0]
        if form == "tuple":
            return tuple(outs)
        return {f"out{k}": o for k, o in enumerate(outs)}


class LossFn:
    """A loss computed outside the model from its output (a tensor, a tuple or a dict)."""

    def __init__(self, kind: str, targets: list[torch.Tensor]):
        self.kind = kind
        self.targets = targets

    def __call__(self, out) -> torch.Tensor:
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self.kind == "mse":
            total = F.mse_loss(leaves[0], self.targets[0])
            for t, y in zip(leaves[1:], self.targets[1:]):
                total = total + F.mse_loss(t, y)
            return total
        if self.kind == "ce":
            first = leaves[0]
            total = F.cross_entropy(first.reshape(-1, first.shape[-1]), self.targets[0].reshape(-1))
            for t in leaves[1:]:
                total = total + t.square().mean()
            return total
        total = leaves[0].square().sum()  # "sumsq"
        for t in leaves[1:]:
            total = total + t.square().sum()
        return total

    def __repr__(self) -> str:
        return f"LossFn({self.kind})"


def _own_loss_of(form: str) -> Callable:
    """The training step's loss of a model returning its own loss in `form`."""
    if form == "dict":
        return lambda out: out["loss"]
    if form == "tuple":
        return lambda out: out[0]
    return lambda out: out


@dataclass
class Description:
    seed: int
    lines: list[str] = field(default_factory=list)
    choices: dict = field(default_factory=dict)  # grammar choice -> value (op kinds counted under "ops")
    loss_fn: Callable | None = None  # the step's loss from the output; None: planner.tools.measure.default_loss
    plan_loss_fn: Callable | None = None  # what plan(loss_fn=) gets

    def __str__(self) -> str:
        return f"random_model({self.seed}):\n  " + "\n  ".join(self.lines)


# ---- the generator -----------------------------------------------------------------------------------------
class _Builder:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.widths: list[int] = []
        self.used: list[bool] = []
        self.linears: list[tuple[str, nn.Linear]] = []  # (value name of its op, module)
        self.ops: list[Op] = []
        self.lines: list[str] = []
        self.kinds: list[str] = []

    def new(self, d: int) -> int:
        self.widths.append(d)
        self.used.append(False)
        return len(self.widths) - 1

    def pick(self, pred=lambda i: True) -> int | None:
        """A value satisfying `pred`: mostly one of the last four, sometimes any, unread ones preferred."""
        ok = [i for i in range(len(self.widths)) if pred(i)]
        if not ok:
            return None
        recent = ok[-4:]
        fresh = [i for i in recent if not self.used[i]]
        r = self.r.random()
        if fresh and r < 0.5:
            return self.r.choice(fresh)
        if r < 0.85:
            return self.r.choice(recent)
        return self.r.choice(ok)

    def add(self, op: Op, out_widths: list[int], text: str, kind: str) -> None:
        for i in op.srcs:
            self.used[i] = True
        outs = [self.new(d) for d in out_widths]
        self.ops.append(op)
        names = ", ".join(f"v{i}" for i in outs) or "_"
        self.lines.append(f"{names} = {text}")
        self.kinds.append(kind)


OP_KINDS = ("linear", "conv1d", "conv2d", "norm", "act", "dropout", "add", "inplace", "cat", "chunk", "split",
            "shuffle", "rms_broadcast", "sdpa", "matmul_attn", "gram", "custom_fn", "ema", "shared", "tied", "dead",
            "read")
OP_WEIGHTS = (10, 4, 3, 5, 4, 3, 5, 4, 2, 2, 2, 3, 1, 4, 2, 1, 2, 1, 1, 1, 1, 2)


def _try_op(b: _Builder, kind: str, hw: tuple[int, int], t: int) -> bool:
    r = b.r
    w = b.widths
    if kind == "linear":
        i = b.pick()
        d = r.choice(WIDTHS)
        bias = r.random() < 0.7
        post = r.choice([None, None, "relu", "gelu", "silu", "tanh", "relu_", "slice_mul_"])
        op = LinearOp([i], w[i], d, bias, post)
        b.add(op, [d], f"linear(v{i}, {w[i]}->{d}, bias={bias}, post={post})", kind)
        b.linears.append((f"v{len(w) - 1}", op.lin))
    elif kind == "conv1d":
        i = b.pick()
        d, k, bn = r.choice(WIDTHS), r.choice((1, 3, 5)), r.random() < 0.4
        b.add(Conv1dOp([i], w[i], d, k, bn), [d], f"conv1d(v{i}, {w[i]}->{d}, k={k}, batchnorm={bn})", kind)
    elif kind == "conv2d":
        i = b.pick()
        d, bn = r.choice(WIDTHS), r.random() < 0.5
        b.add(Conv2dOp([i], w[i], d, hw, bn), [d], f"conv2d(v{i}, {w[i]}->{d}, grid={hw}, batchnorm+relu={bn})",
              kind)
    elif kind == "norm":
        i = b.pick()
        nk = r.choice(("layernorm", "rmsnorm", "batchnorm1d_3d", "batchnorm1d_2d", "batchnorm1d_cma"))
        b.add(NormOp([i], nk, w[i]), [w[i]], f"{nk}(v{i})", kind)
    elif kind == "act":
        i = b.pick()
        ak, mod = r.choice(tuple(ACTS)), r.random() < 0.5
        b.add(ActOp([i], ak, mod), [w[i]], f"{ak}(v{i}, module={mod})", kind)
    elif kind == "dropout":
        i = b.pick()
        p, mod = r.choice((0.1, 0.5)), r.random() < 0.5
        b.add(DropoutOp([i], p, mod), [w[i]], f"dropout(v{i}, p={p}, module={mod})", kind)
    elif kind in ("add", "inplace", "gram"):
        i = b.pick()
        j = b.pick(lambda k: w[k] == w[i] and (k != i or kind == "gram")) if kind != "gram" else b.pick()
        if j is None:
            return False
        if kind == "add":
            alpha = r.choice((None, None, 0.5))
            b.add(AddOp([i, j], alpha), [w[i]], f"add(v{i}, v{j}, alpha={alpha})", kind)
        elif kind == "inplace":
            ik = r.choice(("add_", "mul_", "mul_sigmoid_"))
            b.add(InplaceOp([i, j], ik), [w[i]], f"inplace_{ik}(v{i}, v{j})", kind)
        else:
            b.add(GramOp([i, j]), [w[j]], f"gram(v{i}, v{j})", kind)
    elif kind == "cat":
        i = b.pick()
        j = b.pick(lambda k: w[k] + w[i] <= MAX_WIDTH)
        if j is None:
            return False
        b.add(CatOp([i, j]), [w[i] + w[j]], f"cat(v{i}, v{j})", kind)
    elif kind == "chunk":
        i = b.pick(lambda k: w[k] % 2 == 0 and w[k] >= 8)
        if i is None:
            return False
        b.add(ChunkOp([i]), [w[i] // 2] * 2, f"chunk(v{i}, 2)", kind)
    elif kind == "split":
        i = b.pick(lambda k: w[k] >= 12)
        if i is None:
            return False
        first = r.choice(range(4, w[i] - 3))
        b.add(SplitOp([i], [first, w[i] - first]), [first, w[i] - first], f"split(v{i}, [{first}, {w[i] - first}])",
              kind)
    elif kind == "shuffle":
        i = b.pick()
        sk = r.choice(("group_transpose", "time_feature", "permute_contiguous"))
        groups = r.choice([g for g in (2, 4) if w[i] % g == 0] or [1])
        b.add(ShuffleOp([i], sk, groups), [w[i]], f"shuffle_{sk}(v{i}, groups={groups})", kind)
    elif kind == "rms_broadcast":
        i = b.pick()
        b.add(RmsBroadcastOp([i]), [w[i]], f"rms_broadcast(v{i})", kind)
    elif kind == "sdpa":
        i = b.pick(lambda k: w[k] in WIDTHS)
        if i is None:
            return False
        heads = r.choice([h for h in (1, 2, 4) if w[i] % h == 0 and w[i] // h >= 4])
        mask = r.choice(("none", "causal", "bool_buffer", "data_bool", "param_bias"))
        p = r.choice((0.0, 0.1))
        b.add(SdpaOp([i], w[i], heads, mask, p, t), [w[i]], f"sdpa(v{i}, heads={heads}, mask={mask}, dropout={p})",
              kind)
    elif kind == "matmul_attn":
        i = b.pick()
        j = b.pick(lambda k: w[k] == w[i])
        c = b.pick()
        b.add(MatmulAttnOp([i, j, c]), [w[c]], f"matmul_attn(q=v{i}, k=v{j}, v=v{c})", kind)
    elif kind == "custom_fn":
        i = b.pick()
        ck = r.choice(("softsign", "scaled_tanh"))
        b.add(CustomFnOp([i], ck), [w[i]], f"custom_fn_{ck}(v{i})", kind)
    elif kind == "ema":
        i = b.pick()
        b.add(EmaOp([i], w[i]), [w[i]], f"ema_buffer(v{i})", kind)
    elif kind in ("shared", "tied"):
        if not b.linears:
            return False
        name, lin = r.choice(b.linears)
        transposed = kind == "tied" and r.random() < 0.5
        d_in = lin.out_features if transposed else lin.in_features
        i = b.pick(lambda k: w[k] == d_in)
        if i is None:
            return False
        if kind == "shared":
            b.add(SharedOp([i], lin), [lin.out_features], f"shared_call(linear of {name}, v{i})", kind)
        else:
            d_out = lin.in_features if transposed else lin.out_features
            b.add(TiedOp([i], lin, transposed), [d_out], f"tied_linear(weight of {name}, transposed={transposed}, "
                                                         f"v{i})", kind)
    elif kind == "dead":
        i = b.pick()
        b.add(DeadBranchOp([i], w[i]), [], f"dead_branch_batchnorm(v{i})", kind)
    elif kind == "read":
        i = b.pick()
        rk = r.choice(("item_branch", "tensor_branch", "item_value"))
        b.add(ReadOp([i], rk), [w[i]], f"read_{rk}(v{i})", kind)
    else:
        raise ValueError(kind)
    return True


def random_model(seed: int):
    """(model, sample_input, description) for `seed`: see the module docstring. The model is in train mode."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.choice((2, 3, 4))
    hw = rng.choice(((2, 4), (4, 4)))
    t = hw[0] * hw[1]
    input_kind = rng.choice(("float", "float", "tokens", "image"))
    loss_kind = rng.choice(("own_mse", "own_ce", "own_smooth_l1", "loss_fn", "loss_fn", "default"))
    desc = Description(seed)
    choices = desc.choices
    choices.update(batch=batch, grid=hw, input=input_kind, loss=loss_kind)

    b = _Builder(seed * 7919 + 1)
    d0 = rng.choice(WIDTHS)
    vocab = rng.choice((16, 24, 32))
    if input_kind == "tokens":
        stem = nn.Embedding(vocab, d0)
        x = torch.randint(0, vocab, (batch, t), generator=gen)
        stem_text = f"embedding(ids (B={batch}, T={t}), vocab={vocab}, D={d0})"
    elif input_kind == "image":
        c = rng.choice((1, 3))
        stem = nn.Conv2d(c, d0, 3, padding=1)
        x = torch.randn(batch, c, *hw, generator=gen)
        stem_text = f"conv2d stem(image (B={batch}, C={c}, H,W={hw}), D={d0}), flattened to (B, T, D)"
    else:
        d_in = rng.choice(WIDTHS)
        stem = nn.Linear(d_in, d0) if rng.random() < 0.6 else None
        if stem is None:
            d0 = d_in
        x = torch.randn(batch, t, d_in, generator=gen)
        stem_text = f"float input (B={batch}, T={t}, D={d_in})" + (f" through linear stem -> {d0}" if stem else "")
    b.new(d0)
    desc.lines.append(f"v0 = {stem_text}")

    n_ops = rng.randint(3, 10)
    while len(b.ops) < n_ops:
        kind = b.r.choices(OP_KINDS, OP_WEIGHTS)[0]
        _try_op(b, kind, hw, t)
    choices["ops"] = sorted(set(b.kinds))

    # the outputs: every value no op read (the last one included) gathered into the heads' input
    sinks = [i for i in range(len(b.widths)) if not b.used[i]]
    if not sinks:  # the last op was a dead branch reading the last value
        sinks = [len(b.widths) - 1]
    n_heads = 1 if loss_kind.startswith("own_") else rng.choice((1, 1, 2, 3))
    head_srcs = []
    if len(sinks) > n_heads:
        d = rng.choice(WIDTHS)
        merge = MergeOp(sinks, sum(b.widths[i] for i in sinks), d)
        b.add(merge, [d], f"merge(cat({', '.join(f'v{i}' for i in sinks)}) -> linear {d})", "merge")
        head_srcs = [len(b.widths) - 1] * n_heads
    else:
        head_srcs = [sinks[k % len(sinks)] for k in range(n_heads)]

    tied_head = False
    heads: list[nn.Module] = []
    loss_fn = plan_loss_fn = None
    target = None
    classes = rng.choice((5, 10))
    out_widths = []
    for k, i in enumerate(head_srcs):
        d_out = rng.choice((4, 8, 10))
        if k == 0 and loss_kind == "own_ce":
            d_out = classes
            if input_kind == "tokens" and b.widths[i] == d0 and rng.random() < 0.6:
                tied_head, d_out = True, vocab
        heads.append(nn.Linear(b.widths[i], d_out))
        out_widths.append(d_out)
    cfg = {"input": input_kind, "loss": loss_kind, "tied_head": tied_head}
    if tied_head:
        heads[0] = nn.Identity()  # unused: the head is the embedding's weight
    heads_text = ", ".join(f"head{k}(v{i}) -> {d}" + (" tied to the embedding" if k == 0 and tied_head else "")
                           for k, (i, d) in enumerate(zip(head_srcs, out_widths)))
    desc.lines.append(f"heads: {heads_text}")

    if loss_kind.startswith("own_"):
        own_form = rng.choice(("scalar", "dict", "tuple"))
        cfg["own_form"] = own_form
        cfg["label_smoothing"] = rng.choice((0.0, 0.1)) if loss_kind == "own_ce" else 0.0
        if loss_kind == "own_ce":
            target = torch.randint(0, out_widths[0], (batch, t), generator=gen)
        else:
            target = torch.randn(batch, t, out_widths[0], generator=gen)
        loss_fn = _own_loss_of(own_form)
        choices.update(own_form=own_form)
        desc.lines.append(f"loss: {loss_kind} in the model (label_smoothing={cfg['label_smoothing']}), returned as "
                          f"{own_form}; the step's loss is {'out' if own_form == 'scalar' else 'its loss entry'}")
    else:
        out_form = rng.choice(("tensor", "tuple", "dict")) if n_heads == 1 else rng.choice(("tuple", "dict"))
        cfg["out_form"] = out_form
        choices.update(out_form=out_form)
        if loss_kind == "loss_fn":
            lk = rng.choice(("mse", "ce", "sumsq"))
            if lk == "ce":
                targets = [torch.randint(0, out_widths[0], (batch, t), generator=gen)]
            else:
                targets = [torch.randn(batch, t, d, generator=gen) for d in out_widths]
            loss_fn = plan_loss_fn = LossFn(lk, targets)
            choices.update(loss_fn=lk)
            desc.lines.append(f"outputs: {out_form}; loss_fn={lk} passed to plan")
        else:
            desc.lines.append(f"outputs: {out_form}; default loss (sum of the outputs), no loss_fn")

    scale = None
    forms = ("tuple", "dict", "args_kwargs") if target is not None else ("tensor", "tuple", "dict", "args_kwargs")
    input_form = rng.choice(forms)
    if input_form in ("dict", "args_kwargs") and rng.random() < 0.3:
        scale = 0.5
    args = [x] if target is None else [x, target]
    if input_form == "tensor":
        sample = x
    elif input_form == "tuple":
        sample = tuple(args)
    elif input_form == "dict":
        sample = dict(zip(("x", "target"), args))
        if scale is not None:
            sample["scale"] = scale
    else:
        kwargs = {} if target is None else {"target": target}
        if scale is not None:
            kwargs["scale"] = scale
        sample = ((x,), kwargs)
    choices.update(input_form=input_form, scale_kwarg=scale is not None)
    desc.lines.insert(0, f"batch={batch}, T={t}, input={input_kind} as {input_form}" +
                      (", keyword constant scale=0.5" if scale is not None else ""))

    model = RandomNet(cfg, stem, b.ops, heads, head_srcs).train()
    for line in b.lines:
        desc.lines.insert(len(desc.lines) - 2, line)
    desc.loss_fn, desc.plan_loss_fn = loss_fn, plan_loss_fn
    return model, sample, desc


# ---- the checker -------------------------------------------------------------------------------------------
# Outcome classes of one case. `passed` and `documented` are what issue 50 allows; the rest are failures.
PASSED, DOCUMENTED = "passed", "documented"
MISMATCH, OVER_BUDGET, CRASH, CONTRADICTION, GENERATOR = (
    "mismatch", "over_budget", "crash", "contradiction", "generator_error")
ALLOWED = (PASSED, DOCUMENTED)
PROJECT_DIRS = ("capture/", "planner/", "graphs/", "solvers/")
TIME_LIMIT_S = 3.0
COST_MODEL = "flops"  # deterministic schedules, so that a failing seed reproduces
STEP_SEEDS = (11, 12)  # torch.manual_seed before each of the two training steps compared


@dataclass
class CaseResult:
    seed: int
    fraction: float
    outcome: str  # passed, documented, mismatch, over_budget, crash, contradiction, generator_error
    detail: str = ""  # what differs, by how much, or the exception ("Type: message")
    where: str = ""  # the innermost project frames of an exception (file:line function)
    budget_bytes: int | None = None  # the budget asked for (after an InfeasibleBudgetError: its min_budget_bytes)
    smallest_bytes: int | None = None  # planner.smallest_budget
    eager_peak_bytes: int | None = None  # measure_peak_bytes of eager
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    solver: str = ""
    overhead: float | None = None
    notes: list[str] = field(default_factory=list)  # facts that are not failures (a retry, a clamped budget)
    description: str = ""
    choices: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome in ALLOWED

    def summary(self) -> str:
        s = f"seed {self.seed} fraction {self.fraction}: {self.outcome}"
        if self.detail:
            s += f" ({self.detail})"
        if self.where:
            s += f"\n  at {self.where}"
        if self.notes:
            s += "\n  notes: " + "; ".join(self.notes)
        return s + "\n" + self.description


def _where(exc: BaseException) -> str:
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if any(f"/{d}" in f.filename.replace("\\", "/") for d in PROJECT_DIRS) and "/tests/" not in f.filename]
    return " <- ".join(f"{f.filename.split('/main/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _exc_text(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def _step(module: nn.Module, params_of: nn.Module, sample, loss_fn, seed: int) -> dict:
    """One training step of `module` (the planned wrapper or the model) under torch.manual_seed(seed): the output's
    tensors, the loss, every gradient and buffer of `params_of` (the model), and the RNG state after the step."""
    from planner.tools.measure import _call, default_loss

    for p in params_of.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = _call(module, sample)
    loss = (loss_fn or default_loss)(out)
    loss.backward()
    state = {
        "outputs": [t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor)],
        "loss": loss.detach().clone(),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params_of.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in params_of.named_buffers()},
        "rng": torch.get_rng_state(),
    }
    for p in params_of.parameters():
        p.grad = None
    return state


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if not a.is_floating_point():
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    d = (a.double() - b.double()).abs()
    rel = float(d.norm() / max(float(b.double().norm()), 1e-30))
    return f"max abs {float(d.max()):.3g}, rel {rel:.3g}, {int((a != b).sum())} of {a.numel()} elements differ"


def compare_states(got: dict, want: dict, step: str) -> str | None:
    """The first difference between two `_step` states, as text; None when everything is torch.equal."""
    if len(got["outputs"]) != len(want["outputs"]):
        return f"{step}: {len(got['outputs'])} output tensors, eager {len(want['outputs'])}"
    if not torch.equal(got["loss"], want["loss"]):
        return f"{step}: loss {got['loss'].item():.9g} vs eager {want['loss'].item():.9g}"
    for k, (a, b) in enumerate(zip(got["outputs"], want["outputs"])):
        if not torch.equal(a, b):
            return f"{step}: output {k}: {_diff(a, b)}"
    for n, b in want["grads"].items():
        a = got["grads"].get(n)
        if (a is None) != (b is None):
            got_s, want_s = ("None", "set") if a is None else ("set", "None")
            return f"{step}: gradient of {n} is {got_s}, eager's is {want_s}"
        if a is not None and not torch.equal(a, b):
            return f"{step}: gradient of {n}: {_diff(a, b)}"
    for n, b in want["buffers"].items():
        a = got["buffers"].get(n)
        if a is None or not torch.equal(a, b):
            return f"{step}: buffer {n}: " + ("missing" if a is None else _diff(a, b))
    if not torch.equal(got["rng"], want["rng"]):
        return f"{step}: the global RNG state after the step differs from eager's"
    return None


@dataclass
class Prepared:
    """What every budget of one seed shares: the model (untouched), its input, eager's two steps and peak, the
    model the first plan traced, that plan (1000 GB) and the smallest budget."""

    seed: int
    model: nn.Module
    sample: object
    desc: Description
    eager_states: list[dict] | None = None
    eager_peak: int | None = None
    plan_model: nn.Module | None = None
    first: object = None
    smallest: object = None
    error: CaseResult | None = None  # a failure or documented error that ends every case of this seed
    state_changed: str | None = None  # plan() changed the model it was given (a failure of every case of the seed)
    notes: list[str] = field(default_factory=list)


def _state_changes(model: nn.Module, before: dict) -> str | None:
    """How plan() left the model it was given otherwise than it found it (a parameter or buffer of another value or
    another tensor type, such as a FunctionalTensor of the capture), or None."""
    changed = []
    for k, v in model.state_dict().items():
        if type(v) not in (torch.Tensor, nn.Parameter):
            changed.append(f"{k} is a {type(v).__name__}")
        elif k not in before or not torch.equal(v, before[k]):
            changed.append(f"{k} changed")
    return f"plan() changed the model it was given: {', '.join(changed[:4])}" if changed else None


def _eager_steps(model: nn.Module, sample, loss_fn) -> list[dict]:
    m = __import__("copy").deepcopy(model)
    return [_step(m, m, sample, loss_fn, s) for s in STEP_SEEDS]


def prepare(seed: int, *, time_limit_s: float = TIME_LIMIT_S, cost_model: str = COST_MODEL) -> Prepared:
    import copy
    import warnings

    from graphs.errors import TraceError
    from planner import plan, smallest_budget
    from planner.tools.measure import measure_peak_bytes

    model, sample, desc = random_model(seed)
    pr = Prepared(seed, model, sample, desc)
    base = dict(seed=seed, fraction=float("nan"), description=str(desc), choices=desc.choices)
    try:
        pr.eager_states = _eager_steps(model, sample, desc.loss_fn)
        again = _eager_steps(model, sample, desc.loss_fn)
        for k in range(len(STEP_SEEDS)):
            d = compare_states(again[k], pr.eager_states[k], f"eager step {k + 1} run twice")
            if d is not None:
                pr.error = CaseResult(outcome=GENERATOR, detail=f"eager is not deterministic: {d}", **base)
                return pr
        torch.manual_seed(STEP_SEEDS[0])
        pr.eager_peak = measure_peak_bytes(copy.deepcopy(model), sample, desc.loss_fn)
    except Exception as e:  # the generator made a model eager cannot train
        pr.error = CaseResult(outcome=GENERATOR, detail=_exc_text(e), where=_where(e), **base)
        return pr
    pr.plan_model = copy.deepcopy(model)
    before = {k: v.clone() for k, v in pr.plan_model.state_dict().items()}
    rng_before = torch.get_rng_state()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pr.first = plan(pr.plan_model, sample, 1000.0, cost_model=cost_model, time_limit_s=time_limit_s,
                            loss_fn=desc.plan_loss_fn)
    except TraceError as e:
        pr.error = CaseResult(outcome=DOCUMENTED, detail=_exc_text(e), where=_where(e), **base)
        return pr
    except Exception as e:
        pr.error = CaseResult(outcome=CRASH, detail="plan at 1000 GB: " + _exc_text(e), where=_where(e), **base)
        return pr
    pr.state_changed = _state_changes(pr.plan_model, before)
    if not torch.equal(torch.get_rng_state(), rng_before):
        pr.notes.append("plan() advanced the global RNG")
    try:
        pr.smallest = smallest_budget(pr.first, time_limit_s=time_limit_s)
    except Exception as e:
        pr.error = CaseResult(outcome=CRASH, detail="smallest_budget: " + _exc_text(e), where=_where(e), **base)
    return pr


def check_case(seed: int, budget_fraction: float, *, prepared: Prepared | None = None,
               time_limit_s: float = TIME_LIMIT_S, cost_model: str = COST_MODEL,
               save_failing_plan: str | None = None) -> CaseResult:
    """Plan `random_model(seed)` at `budget_fraction` of the way from planner.smallest_budget to eager's measured
    peak, apply it to a copy and compare two training steps with eager's (loss, outputs, every gradient and buffer,
    the RNG state after: torch.equal) and the measured peak with the budget. See CaseResult for the outcomes.

    save_failing_plan: a folder where the plan of a failing case is written (`Plan.to_json`, as
    seed<seed>_<fraction>.json; `Plan.load(path).apply(model, sample_input)` replays it), since the time-limited
    searches need not find the same schedule again."""
    import copy
    import time
    import warnings

    from graphs.errors import InfeasibleBudgetError, NoSolutionInTimeError, TraceError
    from planner import GB, plan
    from planner.tools.measure import measure_peak_bytes

    t0 = time.perf_counter()
    pr = prepared if prepared is not None else prepare(seed, time_limit_s=time_limit_s, cost_model=cost_model)
    if pr.error is not None:
        res = copy.copy(pr.error)
        res.fraction = budget_fraction
        res.seconds = time.perf_counter() - t0
        return res
    desc = pr.desc
    res = CaseResult(seed, budget_fraction, PASSED, description=str(desc), choices=desc.choices,
                     eager_peak_bytes=pr.eager_peak, notes=list(pr.notes))
    if pr.state_changed is not None:
        res.notes.append(pr.state_changed)
    lo = pr.smallest.budget_bytes
    res.smallest_bytes = lo
    hi = pr.eager_peak
    if lo is None:
        res.notes.append(f"smallest_budget found none ({pr.smallest.proof}); the first plan's peak stands for it")
        lo = pr.first.predicted_peak_bytes
    if lo > hi:
        res.notes.append(f"smallest budget {lo} is above eager's measured peak {hi} (+{100 * (lo / hi - 1):.1f} %)")
    budget = max(lo, int(lo + budget_fraction * (hi - lo)))
    res.budget_bytes = budget

    def plan_at(b: int):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plan(pr.plan_model, pr.sample, b / GB, cost_model=cost_model, time_limit_s=time_limit_s,
                        traced=pr.first.traced, loss_fn=desc.plan_loss_fn)

    p = None

    def finish(outcome: str, detail: str = "", where: str = "") -> CaseResult:
        res.outcome, res.detail, res.where = outcome, detail, where
        res.seconds = time.perf_counter() - t0
        if save_failing_plan and p is not None and outcome not in ALLOWED:
            from pathlib import Path

            path = Path(save_failing_plan) / f"seed{seed}_{budget_fraction:g}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                p.to_json(path)
                res.notes.append(f"plan written to {path}")
            except Exception as e:  # a plan that cannot be written is itself worth a note
                res.notes.append(f"plan.to_json failed: {_exc_text(e)}")
        return res

    try:
        try:
            p = plan_at(budget)
        except InfeasibleBudgetError as e:
            msg = _exc_text(e)
            if e.min_budget_bytes is None:
                return finish(CONTRADICTION if budget >= lo and pr.smallest.budget_bytes is not None else DOCUMENTED,
                              f"InfeasibleBudgetError without min_budget_bytes: {msg}")
            if budget >= lo and pr.smallest.budget_bytes is not None:
                return finish(CONTRADICTION, f"budget {budget} >= smallest_budget {lo}, yet {msg}")
            res.notes.append(f"InfeasibleBudgetError at {budget}; retried at its min_budget_bytes {e.min_budget_bytes}")
            budget = res.budget_bytes = e.min_budget_bytes
            try:
                p = plan_at(budget)
            except InfeasibleBudgetError as e2:
                return finish(CONTRADICTION, f"plan at the min_budget_bytes {budget} an InfeasibleBudgetError named: "
                                             f"{_exc_text(e2)}")
    except NoSolutionInTimeError as e:
        return finish(DOCUMENTED, _exc_text(e))
    except TraceError as e:
        return finish(DOCUMENTED, _exc_text(e), _where(e))
    except Exception as e:
        return finish(CRASH, "plan: " + _exc_text(e), _where(e))
    res.solver, res.predicted_peak_bytes, res.overhead = p.solver, p.predicted_peak_bytes, p.overhead
    if p.budget_bytes != budget:
        res.notes.append(f"plan.budget_bytes {p.budget_bytes} != the budget asked {budget}")
    stage = "apply"
    try:
        m = copy.deepcopy(pr.model)
        planned = p.apply(m)
        for k, s in enumerate(STEP_SEEDS):
            stage = f"planned step {k + 1}"
            got = _step(planned, m, pr.sample, desc.loss_fn, s)
            d = compare_states(got, pr.eager_states[k], f"step {k + 1}")
            if d is not None:
                return finish(MISMATCH, d)
        stage = "measure_peak_bytes"
        m2 = copy.deepcopy(pr.model)
        torch.manual_seed(STEP_SEEDS[0])
        res.measured_peak_bytes = measure_peak_bytes(p.apply(m2), pr.sample, desc.loss_fn)
    except Exception as e:
        return finish(CRASH, f"{stage}: {_exc_text(e)}", _where(e))
    if p.predicted_peak_bytes > budget:
        return finish(OVER_BUDGET, f"predicted peak {p.predicted_peak_bytes} > budget {budget} "
                                   f"(+{p.predicted_peak_bytes - budget} bytes)")
    if res.measured_peak_bytes > budget:
        over = res.measured_peak_bytes - budget
        return finish(OVER_BUDGET, f"measured peak {res.measured_peak_bytes} > budget {budget} (+{over} bytes, "
                                   f"+{100 * over / budget:.2f} %; predicted {p.predicted_peak_bytes})")
    if pr.state_changed is not None:
        return finish(MISMATCH, pr.state_changed)
    return finish(PASSED)
