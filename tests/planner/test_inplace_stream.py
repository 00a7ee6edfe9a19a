"""planner.enable on a pad-to-longest stream (nearly every batch a length of its own): one measuring call and one
profiled block shape serve every later length within the measured call's bounds (planner.inplace.scaling), every
step within the budget and trained as eager; and the bounds themselves hold."""
from __future__ import annotations

import copy
import random

import pytest
import torch

import planner
from capture.measure_memory import StorageTracker
from planner.inplace import scaling
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _model(name: str) -> torch.nn.Module:
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
    config = {"qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **common),
              "llama": lambda: transformers.LlamaConfig(num_key_value_heads=4, **common)}[name]()
    torch.manual_seed(0)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[name]
    return cls(config).train()  # the library's defaults: use_cache on


def _stream(n: int, seed: int = 0) -> list[dict]:
    """`n` batches of 2 rows of 9-60 tokens, each padded to its longest row (pad 0, mask 0, labels -100)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lengths = [rng.randint(9, 60) for _ in range(2)]
        ids = torch.zeros(2, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, k in enumerate(lengths):
            ids[r, :k] = torch.randint(1, VOCAB, (k,), generator=torch.Generator().manual_seed(rng.randint(0, 999)))
            mask[r, :k] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _step(model, opt, batch, seed):
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _enabled_midway(model, longest: dict):
    """enable(model) at a budget midway between per-block checkpointing's and eager's peaks at `longest`: (the budget,
    the controller, an eager twin, an enabled twin whose calls are measured, AdamW for the eager twin and the model)."""
    eager_peak = measure_peak_bytes(copy.deepcopy(model), longest)
    ckpt_peak = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), longest)
    budget = (ckpt_peak + eager_peak) // 2
    eager = copy.deepcopy(model)
    checked = copy.deepcopy(model)
    state = planner.enable(model, budget / 1e9)
    planner.enable(checked, budget / 1e9)
    opt_e, opt_p = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model))
    return budget, state, eager, checked, opt_e, opt_p


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_a_stream_of_lengths_measures_once_and_stays_within_the_budget(name):
    model = _model(name)
    stream = _stream(8)
    lengths = [b["input_ids"].shape[1] for b in stream]
    assert len(set(lengths)) >= 6 and max(lengths) > lengths[0]
    longest = max(stream, key=lambda b: b["input_ids"].shape[1])
    budget, state, eager, checked, opt_e, opt_p = _enabled_midway(model, longest)
    for k, batch in enumerate(stream):
        peak = measure_peak_bytes(checked, batch)  # the same call sequence on a copy, each step's peak read
        assert peak <= budget, (k, lengths[k], peak, budget)
        _step(eager, opt_e, batch, k)
        _step(model, opt_p, batch, k)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p, q), (k, n)
    modes = [r.mode for r in state.records]
    assert modes.count("measure") == 1, modes  # the first call; every later length within its bounds
    assert state.profiled_shapes == 1 and "within their bounds" in state.summary()  # one block shape profiled
    # a later, longer call ran a choice that keeps some block (the bounds leave room below the budget)
    assert any("kept" in r.options for r, n in zip(state.records, lengths) if n > lengths[0])


def test_size_degree_bounds_the_degree_in_the_length():
    assert scaling.size_degree((4, 123, 64), 123) == 1
    assert scaling.size_degree((4, 1, 123, 123), 123) == 2
    assert scaling.size_degree((4 * 123, 512), 123) == 1
    assert scaling.size_degree((4, 122, 64), 123) == 1  # a shifted sequence counts as the length
    assert scaling.size_degree((64, 64), 123) == 0
    assert scaling.size_degree((4, 16, 256), 16) >= 2  # a constant divisible by the length: counted (a bound)


@pytest.mark.parametrize("longer", [40, 47, 60, 90])
def test_the_tracker_bounds_a_longer_calls_live_and_peak_bytes(longer):
    """What a ScalingTracker reads at length 40 bounds what a plain tracker reads at each longer length up to the
    ratio's: peak and live bytes of a small attention block's forward and backward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 48)

    def step(n: int, tracker) -> tuple[int, ...]:
        x = torch.randn(2, n, 16, requires_grad=True)
        with tracker:
            q, k, v = lin(x).chunk(3, dim=-1)
            scores = (q @ k.transpose(1, 2)).softmax(-1)  # 2 x n x n: degree 2
            out = (scores @ v).sum()
            live = tracker.live_bytes if not isinstance(tracker, scaling.ScalingTracker) else tracker.live_scaled()
            out.backward()
        return live

    short = scaling.ScalingTracker(40)
    live_s = step(40, short)
    j = next(j for j, r in enumerate(scaling.RATIOS) if longer <= 40 * r)
    plain = StorageTracker()
    live = step(longer, plain)
    assert live <= live_s[j] and plain.peak_bytes <= short.peak_scaled[j]
    if longer == 40:
        assert short.peak_bytes == plain.peak_bytes


def test_the_trackers_peaks_are_the_most_read_after_any_operator():
    """peak_scaled (folded from the moments kept as they come) equals, at every ratio, the most live_scaled() read
    after any operator since the last reset_peak, through a forward with a reset and a backward."""
    class EveryOp(scaling.ScalingTracker):
        def _after_op(self):
            super()._after_op()
            self.most = [max(a, b) for a, b in zip(self.most, self.live_scaled())]

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 48)
    tracker = EveryOp(40)
    tracker.most = list(scaling.zero())
    x = torch.randn(2, 40, 16, requires_grad=True)
    with tracker:
        q, k, v = lin(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)).softmax(-1)
        assert list(tracker.peak_scaled) == tracker.most
        tracker.reset_peak()
        tracker.most = list(tracker.live_scaled())
        out = (scores @ v).relu().sum()
        del q, k, v, scores
        out.backward()
    assert list(tracker.peak_scaled) == tracker.most and tracker.most[-1] > tracker.most[0] > 0


def _qwen2_width64() -> torch.nn.Module:
    """A 2-layer Qwen2 of width 64 (vocabulary 256), the library's defaults otherwise, seed 0."""
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=256)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).train()


def _rows(length: int, seed: int) -> dict:
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def test_a_longer_length_measured_after_a_short_first_call_trains_at_its_budget():
    """The first call is half as long as the later ones: the longer call measures (the first call's bounds fit no
    choice at this budget), and its blocks are profiled at their own shape, so the calls after it meet the budget
    (they were refused when the measured call's blocks got the short call's bounds as figures)."""
    model = _qwen2_width64()
    longest = _rows(64, 1)
    budget, state, eager, checked, opt_e, opt_p = _enabled_midway(model, longest)
    for k, batch in enumerate([_rows(32, 0), longest, _rows(64, 2), _rows(64, 3)]):
        assert measure_peak_bytes(checked, batch) <= budget, k
        _step(eager, opt_e, batch, k)
        _step(model, opt_p, batch, k)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters())), k
    assert [r.mode for r in state.records][-1] == "planned"


def test_a_call_tries_each_measured_call_that_bounds_it():
    """After calls of 32 and 64 tokens both measured, a call of 60 is bounded by 32's measurement at ratio 1.875
    (the smaller bounding shape, tried first), whose bounds admit no choice at this budget, and by 64's, which
    covers it: it runs planned from 64's figures, nothing measured, within the budget and as eager."""
    model = _qwen2_width64()
    longest = _rows(64, 1)
    budget, state, eager, checked, opt_e, opt_p = _enabled_midway(model, longest)
    for k, batch in enumerate([_rows(32, 0), longest, _rows(60, 2)]):
        assert measure_peak_bytes(checked, batch) <= budget, k
        _step(eager, opt_e, batch, k)
        _step(model, opt_p, batch, k)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters())), k
    assert [r.mode for r in state.records] == ["measure", "measure", "planned"]
