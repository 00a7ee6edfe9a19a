"""capture.op_record: which operators a save policy may keep, and their identities."""
from __future__ import annotations

import torch

from capture.op_record import record_forward, record_kept_forward

aten = torch.ops.aten


def _forward(lin, x):
    h = lin(x)  # addmm: relu's backward reads relu's output, not this one
    a = torch.relu(h)
    b = torch.nn.functional.dropout(a, 0.5, training=True)  # random: never kept
    c = b.t()  # a view
    d = lin(c.t().contiguous())
    e = d * 2
    e.add_(1)  # writes e in place: e's maker (mul) cannot be kept
    return torch.tanh(e).sum()


def test_savable_operators_and_occurrences():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    _, records = record_forward(_forward, lin, x)
    by = {(r.func, r.occurrence): r for r in records}
    assert by[(aten.addmm.default, 0)].occurrence == 0 and (aten.addmm.default, 1) in by  # the second linear
    assert not by[(aten.t.default, 0)].savable  # a view
    random = [r for r in records if torch.Tag.nondeterministic_seeded in r.func.tags]
    assert random and not any(r.savable for r in random)
    # dropout's mask is made, then drawn into in place: not savable; e's maker (the second mul) is written by add_
    assert all(not r.savable for r in records if r.func in (aten.empty_like.default, aten.bernoulli_.float))
    assert not by[(aten.mul.Tensor, 1)].savable and "written in place" in by[(aten.mul.Tensor, 1)].why_not
    assert by[(aten.addmm.default, 0)].savable and not by[(aten.addmm.default, 0)].needed  # relu keeps its own
    assert by[(aten.relu.default, 0)].savable and by[(aten.relu.default, 0)].needed  # relu's backward reads it
    assert by[(aten.tanh.default, 0)].savable  # as tanh's does
    assert not by[(aten.sum.default, 0)].needed  # nothing keeps the loss
    assert by[(aten.addmm.default, 0)].flops == 2 * 4 * 8 * 8
    assert by[(aten.relu.default, 0)].out_bytes == 4 * 8 * 4


def test_a_kept_recording_records_the_same_and_differentiates_as_eager():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    _, plain = record_forward(_forward, lin, x)
    torch.manual_seed(1)
    out, kept = record_kept_forward(_forward, lin, x)
    got = torch.autograd.grad(out, [x, *lin.parameters()])
    torch.manual_seed(1)
    want = torch.autograd.grad(_forward(lin, x), [x, *lin.parameters()])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert [(r.func, r.occurrence, r.savable, r.needed, r.out_bytes) for r in plain] == \
        [(r.func, r.occurrence, r.savable, r.needed, r.out_bytes) for r in kept]


def test_attention_without_dropout_may_be_kept_and_is_priced():
    # CPU's flash attention is tagged random (it can drop out); at dropout_p=0 it draws nothing, so a policy may
    # keep it, and its FLOPs (missing from torch's registry) come from capture.costs' formulas
    torch.manual_seed(0)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _, records = record_forward(lambda q: sdpa(q, q, q, is_causal=True), q)
    attention = [r for r in records if "attention" in str(r.func)]
    assert attention and all(r.savable and r.flops > 0 for r in attention)
    _, records = record_forward(lambda q: sdpa(q, q, q, dropout_p=0.5), q)
    assert not any(r.savable for r in records if torch.Tag.nondeterministic_seeded in r.func.tags)

