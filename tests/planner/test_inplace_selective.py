"""The selective options of the in-place planner: torch's selective activation checkpointing around a block with a
per-operator save policy a knapsack chose (planner.inplace.block_region). Each option trains as the block's own
forward does, dropout included; the chain picks one where it recomputes least within the budget; the policy, keyed
by the operators' order, serves other lengths of the block's structure."""
from __future__ import annotations

import copy

import pytest
import torch

import planner
import planner.inplace.option_costs as option_costs
from capture.measure_memory import StorageTracker, storage_bytes
from planner.inplace.block_region import BlockCall, OptionKind, profile_block
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402


def _first_block_call(model, batch):
    """(the first block, its args, its kwargs) as the model calls it."""
    from capture.module_tags import repeated_blocks

    block = model.get_submodule(repeated_blocks(model)[0])
    seen = {}

    def grab(_m, args, kwargs):
        seen["call"] = (tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                        {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    handle.remove()
    return block, *seen["call"]


def _step(block, run, tensors, seed):
    """Output and gradients (of the parameters and the differentiable inputs) of one forward and backward."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    torch.manual_seed(seed)
    out = run(leaves)
    hidden = out[0] if isinstance(out, tuple) else out
    wrt = [p for p in block.parameters()] + [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(hidden.square().sum(), wrt, allow_unused=True)
    return hidden.detach(), grads


def test_every_selective_option_is_the_blocks_own_forward_dropout_included(monkeypatch):
    # the policy's overhead taken as free: at this tiny width every selective option costs more than checkpointing
    # and would be left out as never chosen
    monkeypatch.setattr(option_costs, "SELECTIVE_OP_SECONDS", 0.0)
    model, batch = build("gpt2", "test")  # GPT-2's default dropout in every block
    block, args, kwargs = _first_block_call(model, batch)
    call, tensors = BlockCall.of(block, args, kwargs)
    prof = profile_block(block, call, tensors, time_limit_s=2.0)
    selective = [o for o in prof.options if o.kind is OptionKind.SELECTIVE]
    stashes = [o.figures.stash_bytes for o in selective]  # larger fractions first
    assert selective and stashes == sorted(stashes, reverse=True) and stashes[-1] < prof.options[0].figures.stash_bytes
    kept = prof.options[0]
    assert kept.kind is OptionKind.KEPT
    want_out, want_grads = _step(block, lambda ts: kept.run(block, ts), tensors, seed=5)
    for opt in selective:
        out, grads = _step(block, lambda ts, o=opt: o.run(block, ts), tensors, seed=5)
        assert torch.equal(out, want_out), opt.figures.name
        assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(grads, want_grads)), opt.figures.name


def _train_both(pairs, batch: dict, seed: int) -> None:
    """One AdamW step of each (model, optimizer) pair on `batch`, each from torch's seed `seed`."""
    for m, o in pairs:
        torch.manual_seed(seed)
        m(**batch).loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)


def _peak_of_step(model, batch) -> int:
    tracker = StorageTracker()
    with tracker:
        model(**batch).loss.backward()
    return tracker.peak_bytes


def test_the_chain_runs_selective_blocks_within_the_budget_and_trains_as_eager(monkeypatch):
    """With the policy's overhead taken as free (at this tiny width it outweighs every recompute saved), a budget
    between per-block checkpointing's peak and eager's is met with selective blocks; AdamW steps equal eager's, and
    a shorter batch (covered by the first) runs the same policies."""
    monkeypatch.setattr(option_costs, "SELECTIVE_OP_SECONDS", 0.0)
    model, batch = build("llama", "test")
    batch["labels"] = batch["input_ids"].clone()
    twin = copy.deepcopy(model)
    resident = storage_bytes(list(model.parameters()))
    low = measure_peak_bytes(per_block_checkpointed(model), batch)
    high = _peak_of_step(copy.deepcopy(model), batch) + resident
    budget = (low + high) // 2
    state = planner.enable(model, budget / 1e9, time_limit_s=2.0)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    try:
        for seed, length in enumerate((64, 64, 64, 56)):
            part = {k: v[:, :length] if torch.is_tensor(v) else v for k, v in batch.items()}
            _train_both(((model, opt), (twin, opt_twin)), part, seed)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())), length
            if seed == 2:
                chosen = state.records[-1].options
                assert any(n.startswith("selective@") for n in chosen), state.explain()
                assert state.records[-1].predicted_peak_bytes <= budget
                assert _peak_of_step(model, batch) + resident <= budget
                model.zero_grad(set_to_none=True)
        assert state.records[-1].mode == "planned"  # the shorter batch: covered, nothing measured
        assert any(n.startswith("selective@") for n in state.records[-1].options)
    finally:
        planner.disable(model)


def test_bart_with_its_decoder_layers_as_blocks_trains_as_eager(monkeypatch):
    """An encoder-decoder with the library's defaults (cache on), its decoder layers (self- and cross-attention)
    as the blocks, at a budget between per-block checkpointing's peak and eager's, the policy's overhead taken as free
    so that selective blocks are chosen: 3 AdamW steps torch.equal to eager's, dropout on."""
    import transformers as T

    monkeypatch.setattr(option_costs, "SELECTIVE_OP_SECONDS", 0.0)
    config = T.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=64, dropout=0.1)
    torch.manual_seed(0)
    model = T.BartForConditionalGeneration(config).train()
    layer = type(model.model.decoder.layers[0])
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 128, (2, 24), generator=gen),
             "labels": torch.randint(3, 128, (2, 16), generator=gen)}
    twin = copy.deepcopy(model)
    resident = storage_bytes(list(model.parameters()))
    torch.manual_seed(0)
    eager_peak = _peak_of_step(copy.deepcopy(model), batch) + resident
    state = planner.enable(model, eager_peak * 0.97 / 1e9, blocks=layer, time_limit_s=2.0)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    try:
        for seed in range(3):
            _train_both(((model, opt), (twin, opt_twin)), batch, seed)
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters())), seed
        assert state.block_names == ["model.decoder.layers.0", "model.decoder.layers.1", "model.decoder.layers.2"]
        assert state.records[-1].mode == "planned" and set(state.records[-1].options) != {"kept"}, state.explain()
    finally:
        planner.disable(model)


def test_selective_options_no_cheaper_than_checkpointing_are_left_out(monkeypatch):
    """At a tiny width the policy's overhead (option_costs) outweighs every recompute a selective option saves: no
    selective option is offered, as the chain would never choose one; free of that overhead they are."""
    model, batch = build("llama", "test")
    block, args, kwargs = _first_block_call(model, batch)
    call, tensors = BlockCall.of(block, args, kwargs)
    prof = profile_block(block, call, tensors, time_limit_s=2.0)
    assert any(o.kind is OptionKind.CHECKPOINTED for o in prof.options)
    assert not any(o.kind is OptionKind.SELECTIVE for o in prof.options), prof.figures
    monkeypatch.setattr(option_costs, "SELECTIVE_OP_SECONDS", 0.0)
    prof = profile_block(block, call, tensors, time_limit_s=2.0)
    assert any(o.kind is OptionKind.SELECTIVE for o in prof.options)
