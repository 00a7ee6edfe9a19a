"""planner.enable / disable: in-place per-block planning trains as eager does, within its budget, on a stream of
mixed batches, and leaves the user's model what it was (transformers models built from tiny configs)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import planner
from graphs.errors import InfeasibleBudgetError
from planner.inplace.block_region import OptionKind
from planner.tools.baselines import per_block_checkpointed
from planner.tools.measure import measure_peak_bytes

pytest.importorskip("transformers")
from examples.hf_zoo import build  # noqa: E402
from tests.planner.helpers import tiny_mixtral  # noqa: E402

LIMIT_S = 2.0  # per new block shape: the options found may differ with the machine's speed, the checks do not


def _stream(batch: dict) -> list[dict]:
    """Two sequence lengths, rows padded and not, labels -100 on the padding."""
    full = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    full["attention_mask"][:] = 1
    full["labels"] = full["input_ids"].clone()
    padded = {k: v.clone() if torch.is_tensor(v) else v for k, v in full.items()}
    padded["attention_mask"][1, -9:] = 0
    padded["labels"][1, -9:] = -100
    short = {k: v[:, :24].clone() if torch.is_tensor(v) else v for k, v in padded.items()}
    short_full = {k: v[:, :24].clone() if torch.is_tensor(v) else v for k, v in full.items()}
    return [full, padded, short, padded, short_full, full]


def _step(model, opt, batch, seed):
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_mixed_stream_equals_eager_within_per_block_checkpointings_peak(name):
    model, batch = build(name, "test")  # GPT-2's config has dropout 0.1: the RNG stays eager's
    stream = _stream(batch)
    longest = [b for b in stream if b["input_ids"].shape[1] == stream[0]["input_ids"].shape[1]]
    budget = 0
    for b in longest:
        torch.manual_seed(0)
        budget = max(budget, measure_peak_bytes(per_block_checkpointed(model), b))
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    cls = type(model)
    state = planner.enable(model, budget / 1e9, time_limit_s=LIMIT_S)
    assert planner.inplace_plan(model) is state and type(model) is cls and list(model.state_dict()) == keys
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k, b in enumerate(stream):
        torch.manual_seed(100 + k)
        peak = measure_peak_bytes(model, b)  # a step of its own (gradients reset after): the memory of this key
        assert peak <= budget, (k, state.records[-1])
        le, lp = _step(eager, opt_e, b, k), _step(model, opt_p, b, k)
        assert torch.equal(le, lp), k
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(p, q), (k, n)
    assert any(r.mode == "planned" for r in state.records)
    assert "block shape" in state.summary() and state.to_dict()["chains"]
    # the model is still the user's: deepcopy trains equal, generate runs in eval, disable restores the forwards
    twin, twin_eager = copy.deepcopy(model), copy.deepcopy(eager)
    assert planner.inplace_plan(twin) is not state
    ot, ote = torch.optim.AdamW(twin.parameters(), lr=1e-3), torch.optim.AdamW(twin_eager.parameters(), lr=1e-3)
    for k, b in enumerate(stream[:2]):
        assert torch.equal(_step(twin, ot, b, k), _step(twin_eager, ote, b, k))
    assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), twin_eager.parameters()))
    model.eval()
    out = model.generate(stream[0]["input_ids"][:1, :8], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 11)
    planner.disable(model)
    assert planner.inplace_plan(model) is None
    assert all("forward" not in model.get_submodule(n).__dict__ for n in state.block_names)


def test_eval_and_no_grad_run_the_model_as_it_is():
    model, batch = build("gpt2", "test")
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    with torch.no_grad():
        model(**batch)
    model.eval()
    model(**batch)
    assert not state.profiles and not state.records


def test_a_budget_no_choice_meets_names_the_least():
    model, batch = build("llama", "test")
    planner.enable(model, 1e-5, time_limit_s=LIMIT_S)
    modes = list(_get_current_dispatch_mode_stack())  # (models enabled by earlier tests may hold a probe there)
    with pytest.raises(InfeasibleBudgetError) as info:
        model(**batch)
    least = info.value.min_budget_bytes
    assert least is not None and least > 10_000 and f"{least / 1e9:.6f} GB" in str(info.value)
    assert _get_current_dispatch_mode_stack() == modes  # nothing of the planner's left on the thread after the error
    planner.disable(model)
    planner.enable(model, least / 1e9, time_limit_s=LIMIT_S)
    for _ in range(2):  # the named budget works (for calls like that one: no gradients held before it)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)


def test_blocks_by_name_or_class_and_refusals():
    model, _ = build("gpt2", "test")
    block_cls = type(model.transformer.h[0])
    state = planner.enable(model, 1.0, blocks=block_cls)
    assert state.block_names == ["transformer.h.0", "transformer.h.1"]
    with pytest.raises(ValueError, match="already enabled"):
        planner.enable(model, 1.0)
    planner.disable(model)
    assert planner.enable(model, 1.0, blocks=["transformer.h.1"]).block_names == ["transformer.h.1"]
    planner.disable(model)
    with pytest.raises(ValueError, match="not enabled"):
        planner.disable(model)
    with pytest.raises(ValueError, match="no repeated blocks"):
        planner.enable(torch.nn.Linear(3, 3), 1.0)


def test_a_mixture_of_experts_decoder_trains_as_eager():
    """Mixtral with the library's default experts code (torch's grouped matmul, traced through the capture's own
    shape rule): trains as eager does at per-block checkpointing's peak."""
    model, (batch,) = tiny_mixtral()
    eager = copy.deepcopy(model)
    torch.manual_seed(0)
    budget = measure_peak_bytes(per_block_checkpointed(model), batch)
    state = planner.enable(model, budget / 1e9, time_limit_s=LIMIT_S)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_p = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(3):
        assert torch.equal(_step(eager, opt_e, batch, k), _step(model, opt_p, batch, k))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    assert state.records[-1].mode == "planned"


class _HostRound(torch.autograd.Function):
    """Rounds on the host through numpy: eager runs it, a fake-tensor trace cannot."""

    @staticmethod
    def forward(ctx, x):
        return torch.from_numpy(x.detach().numpy().round(3)).clone()  # a storage torch allocates and counts

    @staticmethod
    def backward(ctx, g):
        return g


class _HostBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(_HostRound.apply(torch.relu(self.up(x))))


class _HostModel(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_HostBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def test_a_block_that_cannot_be_traced_falls_back_to_whole_block_options():
    """A block that leaves torch for numpy cannot be traced: its blocks are kept or checkpointed whole, chosen by the
    same chain, with the reason in the summary, and train as eager does."""
    torch.manual_seed(0)
    model = _HostModel()
    eager = copy.deepcopy(model)
    x = torch.randn(64, 32)
    budget = measure_peak_bytes(per_block_checkpointed(model), (x,))
    state = planner.enable(model, budget / 1e9, time_limit_s=LIMIT_S, planned=True)
    for _ in range(3):  # gradients reset before each step, as an optimizer loop does: the budget is such a step's
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        model(x).backward()
        eager(x).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
    prof = next(iter(state.profiles.values()))
    assert prof.nodes == 0 and "could not be traced" in state.summary()
    assert {"kept", "checkpointed"} <= {o.figures.name for o in prof.options}
    assert not prof.plans and all(o.kind is not OptionKind.PLANNED for o in prof.options)
    assert state.records[-1].mode == "planned"


def test_torch_compile_works_after_a_measuring_call_and_disable_leaves_no_mode_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model, batch = build("llama", "test")
    before = len(_get_current_dispatch_mode_stack())
    planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    from capture.measure_memory import StorageTracker

    with StorageTracker() as outer:  # a mode of the caller's around the first call of a key, read through its
        model(**batch).loss.backward()  # backward (a tracker on CPU, left on until the next call)
    assert not any(m is outer for m in _get_current_dispatch_mode_stack())  # the caller's mode left with its exit
    compiled = []

    def backend(gm, _example_inputs):
        compiled.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda t: t * 2 + 1, backend=backend)(torch.ones(3))
    assert compiled and torch.equal(out, torch.full((3,), 3.0))  # dynamo compiled it, not skipped it
    planner.disable(model)
    assert len(_get_current_dispatch_mode_stack()) == before


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_accumulating_steps_hold_no_more_than_predicted_and_a_callers_mode_is_left_alone(name):
    """Gradient accumulation: calls with gradients present hold what the choice predicted at most (the computed
    gradient added to an existing one included). A dispatch mode the caller enters above the planner's stays."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from capture.measure_memory import StorageTracker, storage_bytes

    model, batch = build(name, "test")
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    model(**batch).loss.backward()  # the measuring call
    for _ in range(2):
        held = [*model.parameters(), *(p.grad for p in model.parameters()), *batch.values()]
        resident = storage_bytes([t for t in held if torch.is_tensor(t)])
        with StorageTracker() as tracker:
            model(**batch).loss.backward()
            assert _get_current_dispatch_mode_stack()[-1] is tracker
        assert state.records[-1].mode == "planned"
        assert resident + tracker.peak_bytes <= state.records[-1].predicted_peak_bytes
    planner.disable(model)


def test_nothing_of_a_call_outlives_it():
    """Profiling a block (traced, planned, measured) keeps nothing of the call that profiled it: after the measuring
    call and a planned one, each with its backward, the storage of the first block's input is freed."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model, batch = build("gpt2", "test")
    inputs: list[StorageWeakRef] = []

    def keep_ref(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs.append(StorageWeakRef(hidden.untyped_storage()))

    model.transformer.h[0].register_forward_pre_hook(keep_ref, with_kwargs=True)
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    for _ in range(2):
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    gc.collect()
    assert state.profiles and len(inputs) == 2
    assert [ref.expired() for ref in inputs] == [True, True]


def test_the_measuring_call_holds_what_per_block_checkpointing_holds():
    """The first call (profiling its block, every block checkpointed) peaks where per-block checkpointing does:
    what profiling made of the call's tensors is gone before the call's backward. A GPT-2 whose peak is the end of
    the backward (the embedding's gradient outweighs the logits: a large vocabulary, a short sequence), where a view
    of the first block's input kept by profiling would add its bytes."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=4000, n_positions=32,
                                     use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 4000, (1, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    reference = measure_peak_bytes(per_block_checkpointed(copy.deepcopy(model)), batch)
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    assert measure_peak_bytes(model, batch) == reference
    assert state.records[-1].mode == "measure" and set(state.records[-1].options) == {"checkpointed"}


class _Fails(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        raise RuntimeError("the user's forward fails")


def test_an_error_in_the_forward_leaves_no_mode_behind():
    model, batch = build("llama", "test")
    planner.enable(model, 1.0, time_limit_s=LIMIT_S)
    model.model.norm = _Fails(model.model.norm)  # after the blocks, in the measuring call
    modes = list(_get_current_dispatch_mode_stack())
    with pytest.raises(RuntimeError, match="the user's forward fails"):
        model(**batch)
    assert _get_current_dispatch_mode_stack() == modes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_where_everything_fits_every_block_is_kept(name):
    """At ten times eager's peak no option that computes anything again is chosen (a planned option recomputing
    only elementwise ops costs its bytes, not nothing)."""
    model, batch = build(name, "test")
    batch = {**batch, "labels": batch["input_ids"].clone()}
    peak = measure_peak_bytes(copy.deepcopy(model), batch)
    state = planner.enable(model, 10 * peak / 1e9, time_limit_s=LIMIT_S)
    for _ in range(2):
        model(**batch).loss.backward()
    assert state.records[-1].mode == "planned" and set(state.records[-1].options) == {"kept"}


def test_an_option_cut_by_the_time_limit_is_named(monkeypatch):
    import planner.inplace.block_region as region_module
    from graphs.errors import NoSolutionInTimeError

    def out_of_time(*args, **kwargs):
        raise NoSolutionInTimeError("no schedule in time", budget_bytes=1, seconds=0.0)

    monkeypatch.setattr(region_module, "solve_problem", out_of_time)
    model, batch = build("llama", "test")
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S, planned=True)
    model(**batch).loss.backward()
    assert all("planned@0.8: no schedule found in its share of the time limit" in p.note
               for p in state.profiles.values())
    assert "planned@0.8: no schedule found" in state.summary()


def test_a_traced_schedule_that_does_not_run_leaves_the_blocks_own_options(monkeypatch):
    # a traced schedule built on fake layouts the kernels do not give fails on the real tensors: the block trains on
    # the options that run its own code, and the profile says why the schedule is not among them
    import planner.inplace.block_region as region_module

    def failing_runner(p, region, compile):
        def run(block, tensors, caches=()):
            raise RuntimeError("view size is not compatible with input tensor's size and stride")
        return run

    monkeypatch.setattr(region_module, "_planned_runner", failing_runner)
    model, batch = build("llama", "test")
    eager = copy.deepcopy(model)
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S, planned=True)
    model(**batch).loss.backward()
    eager(**batch).loss.backward()
    for prof in state.profiles.values():
        assert not any(o.kind is region_module.OptionKind.PLANNED for o in prof.options)
        assert "did not run (RuntimeError: view size is not compatible" in prof.note
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))


def test_a_block_structure_is_traced_once_whatever_the_lengths(monkeypatch):
    """Each longer sequence length is a new block shape: with planned=True only the first shape of a block structure
    is traced and planned, the others get the options that run at any shape, untraced; a shorter batch than one
    measured is run from that measurement's choice among those options, with nothing measured or profiled. All as
    eager trains."""
    import planner.inplace.block_region as region_module

    traces = []
    real = region_module.trace_model
    monkeypatch.setattr(region_module, "trace_model", lambda *a, **k: traces.append(1) or real(*a, **k))
    model, batch = build("llama", "test")
    twin = copy.deepcopy(model)
    state = planner.enable(model, 1.0, time_limit_s=LIMIT_S, planned=True)
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    for seed, length in enumerate((24, 40, 56, 64, 32, 60)):
        part = {k: v[:, :length] if torch.is_tensor(v) else v for k, v in batch.items()}
        part["labels"] = part["input_ids"].clone()
        assert torch.equal(_step(model, opt, part, seed), _step(twin, opt_twin, part, seed))
    # (up to 48 every row is unpadded and the blocks get no mask: another structure; 40 runs within the bounds the
    # measurement at 24 gives, 56 finds the blocks called otherwise than at 24 and runs checkpointed, 64 measures)
    structures = {region_module.structure_key(k) for k in state.profiles}
    assert [r.mode for r in state.records[:4]] == ["measure", "planned", "fallback", "measure"]
    assert len(state.profiles) == 3 and len(traces) == len(structures) < 3
    assert sum(p.nodes > 0 for p in state.profiles.values()) == len(structures)
    assert [r.mode for r in state.records[-2:]] == ["planned", "planned"]  # 32 and 60: covered
    assert not any(name.startswith("planned") for name in state.records[-1].options)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_a_caller_that_starts_keeping_the_outputs_is_warned_once_and_counted():
    """The measuring call's caller let the outputs go before its backward (`model(**batch).loss.backward()`); a later
    one keeps them (`out = model(**batch); out.loss.backward()`): that step is warned of, and from the next one on the
    chain counts them, every step's measured peak within the budget."""
    import warnings

    from capture.measure_memory import StorageTracker, storage_bytes

    model, batch = build("llama", "test")
    batch["labels"] = batch["input_ids"].clone()
    resident = storage_bytes([*model.parameters(), *model.buffers()])
    budget = measure_peak_bytes(per_block_checkpointed(model), batch)  # (run_step keeps the outputs)
    state = planner.enable(model, budget * 1.15 / 1e9, time_limit_s=LIMIT_S)
    try:
        for _ in range(2):  # measuring, then planned: the outputs let go
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        assert not state.caller_keeps_outputs
        with pytest.warns(RuntimeWarning, match="holds .* more bytes of the model's outputs"):
            out = model(**batch)
            out.loss.backward()
        del out
        model.zero_grad(set_to_none=True)
        assert state.caller_keeps_outputs
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            tracker = StorageTracker()
            with tracker:
                out = model(**batch)
                out.loss.backward()
            del out
        assert tracker.peak_bytes + resident <= state.budget_bytes
        assert state.records[-1].predicted_peak_bytes <= state.budget_bytes
    finally:
        planner.disable(model)
