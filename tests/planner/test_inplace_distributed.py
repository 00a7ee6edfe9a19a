"""planner.enable under DDP and FSDP2 (gloo, 2 CPU processes): training equals eager bitwise on every rank, the
gradients of a block arrive before the backward moves on to the block before it, and the planned step holds no
more than per-block checkpointing under the same engine.

Each test spawns its 2 ranks once and trains its variants one after the other inside them: eager, per-block
checkpointing applied in place (distributed_support.checkpoint_blocks_in_place, the reference the planner must match
or beat, and a check of the harness itself) and planner.enable. The ranks return CPU tensors; the parent compares.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import planner
from capture.measure_memory import StorageTracker, storage_bytes
from planner.tools.measure import measure_peak_bytes
from tests.planner.distributed_support import (
    block_modules,
    checkpoint_blocks_in_place,
    cpu_state,
    rank_batch,
    run_ranks,
    tiny_decoder,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LIMIT_S = 2.0  # planner.enable's time limit per new block shape
STEPS = 3
GENEROUS_GB = 1.0
VARIANTS = ("eager", "checkpointed", "planned")


def _prepare(variant: str, arch: str, dropout: float, budget_gb: float, layers: int = 2):
    """(model, the planner's state or None) for one variant, built under the same seed."""
    model = tiny_decoder(arch, dropout=dropout, layers=layers)
    state = None
    if variant == "checkpointed":
        checkpoint_blocks_in_place(model)
    elif variant == "planned":
        state = planner.enable(model, budget_gb, time_limit_s=LIMIT_S)
    return model, state


def _train(wrapped: torch.nn.Module, rank: int, steps: int = STEPS, peaks: list | None = None) -> list[float]:
    """AdamW steps on the rank's batches; with `peaks` a list, each step's peak bytes (the parameters, gradients
    and batch this process holds, plus the forward+backward's own peak by capture.measure_memory.StorageTracker) are
    appended to it."""
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 * (rank + 1) + step)  # dropout: the same masks in every variant
        batch = rank_batch(rank, step)
        tracker = StorageTracker()
        with tracker if peaks is not None else contextlib.nullcontext():
            loss = wrapped(**batch).loss
            loss.backward()
        if peaks is not None:
            held = [*wrapped.parameters(), *(b for b in batch.values() if isinstance(b, torch.Tensor))]
            peaks.append(storage_bytes(held) + tracker.peak_bytes)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _records(state) -> list:
    return [] if state is None else [(r.mode, r.options) for r in state.records]


def per_block_peak_gb(arch: str, dropout: float, layers: int = 2) -> float:
    """Per-block checkpointing's measured step peak (planner.tools.measure, one process, the model's own loss), the
    largest over the ranks' first batches, in GB."""
    model = checkpoint_blocks_in_place(tiny_decoder(arch, dropout=dropout, layers=layers))
    peak = 0
    for rank in range(2):
        torch.manual_seed(0)
        peak = max(peak, measure_peak_bytes(model, rank_batch(rank, 0)))
    return peak / 1e9


def _assert_all_equal(results: list[dict], label: str) -> None:
    for rank, res in enumerate(results):
        eager = res["eager"]["params"]
        for variant in VARIANTS[1:]:
            got = res[variant]["params"]
            assert list(got) == list(eager), (label, rank, variant)
            bad = [n for n in eager if not torch.equal(got[n], eager[n])]
            assert not bad, (label, rank, variant, bad[:5], res[variant]["records"])
            assert res[variant]["losses"] == res["eager"]["losses"], (label, rank, variant)
    # the ranks agree (DDP and FSDP2 keep one model), and the batches differed between them
    for variant in VARIANTS:
        a, b = results[0][variant], results[1][variant]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]), (label, variant)
        assert a["losses"] != b["losses"], (label, variant)


# ---------------------------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------------------------
def ddp_rank(rank: int, world_size: int, arch: str, dropout: float, budget_gb: float) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for variant in VARIANTS:
        model, state = _prepare(variant, arch, dropout, budget_gb)
        peaks: list = []
        losses = _train(DDP(model), rank, peaks=peaks)
        out[variant] = {"params": cpu_state(model), "losses": losses, "records": _records(state), "peaks": peaks,
                        "summary": state.summary() if state is not None else ""}
    return out


def ddp_bucket_bytes(arch: str, dropout: float) -> int:
    """DDP's gradient buckets: a flat copy of the gradients (gradient_as_bucket_view off, DDP's default)."""
    return sum(p.numel() * p.element_size() for p in tiny_decoder(arch, dropout=dropout).parameters()
               if p.requires_grad)


@pytest.mark.parametrize("arch,dropout", [("gpt2", 0.1), ("llama", 0.0)])
def test_ddp_trains_as_eager_at_a_generous_budget(arch, dropout):
    _assert_all_equal(run_ranks(ddp_rank, arch, dropout, GENEROUS_GB), f"ddp {arch}")


def test_ddp_trains_as_eager_at_per_block_checkpointings_peak_and_its_buckets():
    """The budget: per-block checkpointing's peak without DDP and DDP's gradient buckets, which the planner counts
    among what the step holds. Every step within it, as the step reads it (the parameters and the batch, and what the
    step makes: DDP makes its buckets again at its second step)."""
    buckets = ddp_bucket_bytes("gpt2", 0.1)
    budget = per_block_peak_gb("gpt2", 0.1) + buckets / 1e9
    results = run_ranks(ddp_rank, "gpt2", 0.1, budget)
    _assert_all_equal(results, "ddp at per-block peak")
    for res in results:
        modes = [m for m, _ in res["planned"]["records"]]
        assert len(modes) == STEPS and "planned" in modes, res["planned"]["records"]
        assert max(res["planned"]["peaks"]) <= budget * 1e9 + 1, (res["planned"]["peaks"], budget)
        assert f"{buckets / 1e9:.6f} GB" in res["planned"]["summary"]


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------
def fsdp2_rank(rank: int, world_size: int, arch: str, dropout: float, budget_gb: float | None) -> dict:
    """Eager, per-block checkpointed and planned, each sharded with fully_shard per block and root. With
    `budget_gb` None the planner's budget is per-block checkpointing's measured peak under FSDP2 here: the highest
    of its steps (the first, when FSDP2 initialises lazily, holds the most) over both ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for variant in VARIANTS:
        if variant == "planned" and budget_gb is None:
            peak = torch.tensor([max(out["checkpointed"]["peaks"])], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            budget_gb = peak.item() / 1e9
            out["budget_gb"] = budget_gb
        model, state = _prepare(variant, arch, dropout, budget_gb)
        for block in block_modules(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        peaks: list = []
        losses = _train(model, rank, peaks=peaks)
        out[variant] = {"params": cpu_state(model), "losses": losses, "records": _records(state), "peaks": peaks}
    return out


@pytest.mark.parametrize("budget", ["generous", "per-block peak"])
def test_fsdp2_trains_as_eager(budget):
    """Under FSDP2 the planner's budget is per-block checkpointing's peak under FSDP2 (sharded parameters, one
    block gathered at a time): the planned run trains equal, every step within the budget, and its highest step
    holds no more than per-block checkpointing's."""
    results = run_ranks(fsdp2_rank, "gpt2", 0.1, GENEROUS_GB if budget == "generous" else None)
    _assert_all_equal(results, f"fsdp2 {budget}")
    if budget == "per-block peak":
        for rank, res in enumerate(results):
            planned = res["planned"]
            assert "planned" in [m for m, _ in planned["records"]], planned["records"]
            assert max(planned["peaks"]) <= res["budget_gb"] * 1e9 + 1, (rank, planned["peaks"], res["budget_gb"])
            assert max(planned["peaks"]) <= max(res["checkpointed"]["peaks"]), (rank, res["checkpointed"]["peaks"])


# ---------------------------------------------------------------------------------------------
# gradients arrive block by block
# ---------------------------------------------------------------------------------------------
def _record_backward_events(model: torch.nn.Module, events: list) -> list:
    handles = []
    for k, block in enumerate(block_modules(model)):
        handles.append(block.register_full_backward_pre_hook(lambda m, g, k=k: events.append(("pre", k, None))))
        for name, p in block.named_parameters():
            handles.append(p.register_post_accumulate_grad_hook(lambda p, k=k, n=name: events.append(("grad", k, n))))
    return handles


def _assert_block_by_block(events: list, model: torch.nn.Module, label) -> None:
    blocks = block_modules(model)
    for k, block in enumerate(blocks):
        names = sorted(n for n, _ in block.named_parameters())
        got = sorted(n for kind, b, n in events if kind == "grad" and b == k)
        assert got == names, (label, k, "each parameter's gradient accumulated once")
    pre = {b: i for i, (kind, b, _) in enumerate(events) if kind == "pre"}
    assert sorted(pre) == list(range(len(blocks))), (label, events)
    for k in range(1, len(blocks)):
        last_grad = max(i for i, (kind, b, _) in enumerate(events) if kind == "grad" and b == k)
        assert pre[k] < last_grad < pre[k - 1], (label, k, events)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_arrive_block_by_block(variant):
    """One process: block k's parameter gradients are all accumulated before block k-1's backward pre-hook fires
    (what DDP's bucketing and FSDP2's per-block reduce-scatter rely on to overlap communication), in the measuring
    call and in the planned ones."""
    budget = per_block_peak_gb("gpt2", 0.1, layers=3) if variant == "planned" else GENEROUS_GB
    model, state = _prepare(variant, "gpt2", 0.1, budget, layers=3)
    events: list = []
    handles = _record_backward_events(model, events)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        events.clear()
        torch.manual_seed(step)
        model(**rank_batch(0, step)).loss.backward()
        _assert_block_by_block(events, model, (variant, step, _records(state)[-1:]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    if state is not None:
        assert "planned" in [m for m, _ in _records(state)]


# ---------------------------------------------------------------------------------------------
# memory under DDP
# ---------------------------------------------------------------------------------------------
def ddp_memory_rank(rank: int, world_size: int, arch: str, dropout: float, budget_gb: float) -> dict:
    """tools.measure's step peak of the DDP-wrapped model (measured inside the rank: the storage tracker sees the
    step's tensors, gloo's own buffers are outside it), per-block checkpointed and planned."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch = rank_batch(rank, 0)
    peaks = {}
    for variant in ("checkpointed", "planned"):
        model, state = _prepare(variant, arch, dropout, budget_gb)
        ddp = DDP(model)
        for _ in range(2 if state is not None else 0):  # the measuring call, then a planned one
            torch.manual_seed(5)
            measure_peak_bytes(ddp, batch)
        torch.manual_seed(5)
        peaks[variant] = measure_peak_bytes(ddp, batch)
        peaks[variant + " records"] = _records(state)
    return peaks


def test_ddp_planned_peak_is_at_most_per_block_checkpointings():
    buckets = ddp_bucket_bytes("gpt2", 0.1)
    budget = per_block_peak_gb("gpt2", 0.1) + buckets / 1e9
    for rank, peaks in enumerate(run_ranks(ddp_memory_rank, "gpt2", 0.1, budget)):
        assert peaks["planned records"][-1][0] == "planned", peaks
        assert peaks["planned"] <= peaks["checkpointed"], (rank, peaks)
        # (the third step: its buckets made before it, outside the step's reading)
        assert peaks["planned"] + buckets <= budget * 1e9 + 1, (rank, peaks)
