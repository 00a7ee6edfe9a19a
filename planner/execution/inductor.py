"""The inductor path: a planned step's forward and backward halves compiled by inductor.

`compile_halves(step)` takes the two fx modules that `build_step(..., for_inductor=True)` builds for a
schedule (the recomputations already in the backward module, every random op a `random_ops` custom op) and
compiles each with inductor: first a retrace with inductor's decompositions (on fake tensors, so nothing runs and
nothing is allocated), then `compile_fx_inner`, the compiler torch.compile runs after its own partitioner. The
plan's saved set and recomputations are the schedule's: the partitioner of torch.compile never runs. The result
is a StepHalves with the same calling conventions (the backward takes a list and clears it), so the planned
module runs it unchanged.

Why compile the halves, rather than hand a partition function to torch.compile: the joint graph torch.compile
partitions is traced with inductor's decompositions and has other nodes than the planner's graph, so a plan made
for eager would not name its nodes; compiling the planner's own halves keeps one plan (and one JSON file) for both
paths, and the order of the schedule is the order of the graphs inductor receives. Inductor then fuses and may
reorder within each half; `planner.tools.measure` measures what the compiled step holds.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from graphs.errors import ExecutorError
from planner.execution.fused_recompute import rebuild_pointwise_stash
from planner.execution.random_ops import state_like
from planner.execution.step_builder import StepHalves

# What inductor may change for the planned halves (measured on transformers models at bench size, scripts/
# bench_compile.py and docs/compile.md):
# - reorder_for_peak_memory: the schedule's order is the one whose peak the plan bounds; inductor's own reordering
#   minimises each half's peak alone and moved recomputations ahead of where the backward needs them (GPT-2 "test"
#   at 60 %: 5.2 % above the predicted peak with it, 1.0 % without);
# - layout_optimization: channels-last copies of convolution inputs are memory the plan does not model (ResNet
#   "bench": 2.87 MB with it, 2.77 MB without, against 2.21 MB predicted).
INDUCTOR_CONFIG = {"reorder_for_peak_memory": False, "layout_optimization": False}
# Stashed values that are pointwise functions of other stashed values and parameters (a BatchNorm+ReLU output) are
# rebuilt inside the compiled backward's fused kernels instead of stashed (planner/fused_recompute.py): ResNet
# "bench" with every value kept, 2.61 MB measured without, 2.34 MB with, against 2.33 MB predicted.
REBUILD_POINTWISE = True


def _fake_inputs(mode: FakeTensorMode, nodes: Sequence[torch.fx.Node]) -> list[torch.Tensor]:
    out = []
    with mode:
        for ph in nodes:
            val = ph.meta.get("val")
            if isinstance(val, torch.Tensor):
                out.append(torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                               device=val.device))
            elif "rng_state_device" in ph.meta:  # a generator state a recomputed random op starts from
                out.append(state_like(ph.meta["rng_state_device"]))
            else:
                raise ExecutorError(f"no example value for the input '{ph.name}' of a planned module")
    return out


def _decomposed(fn, example: list[torch.Tensor]) -> torch.fx.GraphModule:
    import torch._inductor.lowering  # noqa: F401  (some of inductor's decompositions ask its lowerings)
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*example)


def _inductor(gm: torch.fx.GraphModule, example: list[torch.Tensor], *, is_backward: bool):
    from torch._inductor.compile_fx import compile_fx_inner

    # every output keeps the strides of the decomposed trace (the backward was compiled for the stash so strided,
    # the gradients are the parameters' own layout); inductor picks the layouts of what stays inside a half
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.meta["user_visible_output_idxs"] = [k for k, a in enumerate(out.args[0]) if isinstance(a, torch.fx.Node)]
    with torch._inductor.config.patch(INDUCTOR_CONFIG):
        return compile_fx_inner(gm, example, is_backward=is_backward)


def _output_values(gm: torch.fx.GraphModule) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0]]


@dataclasses.dataclass
class CompileTimes:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def _prune_unread_stash(f_gm: torch.fx.GraphModule, b_gm: torch.fx.GraphModule, first_stash: int,
                        num_stash: int) -> list[int]:
    """Drop the stashed values the decomposed backward never reads (the eager backward op of a value may read what
    inductor's decomposition of it does not: ResNet's stem kept a 262 KB tensor through the whole backward so):
    the forward returns None in their place and the backward loses those inputs. Returns the positions of the
    backward's inputs that remain."""
    b_phs = [n for n in b_gm.graph.nodes if n.op == "placeholder"]
    unread = [k for k in range(num_stash) if not b_phs[k].users]
    if not unread:
        return list(range(len(b_phs)))
    out = next(n for n in f_gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    for k in unread:
        values[first_stash + k] = None
    out.args = (type(out.args[0])(values),)
    f_gm.graph.eliminate_dead_code()
    f_gm.recompile()
    for k in unread:
        b_gm.graph.erase_node(b_phs[k])
    b_gm.recompile()
    drop = set(unread)
    return [k for k in range(len(b_phs)) if k not in drop]


def _update_buffers_in_graph(f_gm: torch.fx.GraphModule, step: StepHalves) -> None:
    """Write the forward's buffer updates (BatchNorm's running statistics) into the buffers inside the compiled
    forward, as torch.compile does, instead of returning new tensors that the planned step copies in afterwards:
    inductor then fuses the writes into its kernels. The copies go last, after every read of the old values (a
    stashed old value is a clone already: step_builder.build_step); the forward returns None in their place."""
    phs = [n for n in f_gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in f_gm.graph.nodes if n.op == "output")
    values = list(out.args[0])
    with f_gm.graph.inserting_before(out):
        for k, primal in enumerate(step.buffer_update_primals):
            new = values[step.num_outputs + k]
            if isinstance(new, torch.fx.Node) and new is not phs[primal]:
                f_gm.graph.call_function(torch.ops.aten.copy_.default, (phs[primal], new))
                values[step.num_outputs + k] = None
    out.args = (type(out.args[0])(values),)
    f_gm.recompile()


def compile_halves(step: StepHalves) -> tuple[StepHalves, CompileTimes]:
    """`step` (built with for_inductor=True) with both modules compiled by inductor, and the compile times."""
    mode = FakeTensorMode()
    fwd, bwd = step.forward_module, step.backward_module
    f_phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    b_phs = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    first_stash = step.num_outputs + len(step.buffer_updates)
    t0 = time.perf_counter()
    f_example = _fake_inputs(mode, f_phs)
    f_gm = _decomposed(lambda *a: fwd(*a), f_example)
    # the backward receives the stash as the compiled forward returns it (inductor keeps the strides of its
    # graph's outputs, which the decomposed trace decides, and may differ from the eager trace's)
    b_example = _fake_inputs(mode, b_phs)
    outputs = _output_values(f_gm)
    for k, val in enumerate(outputs[first_stash:]):
        if isinstance(val, torch.Tensor):
            b_example[k] = val
    t1 = time.perf_counter()
    b_gm = _decomposed(lambda *a: bwd(list(a)), b_example)
    keep = _prune_unread_stash(f_gm, b_gm, first_stash, step.num_stash)
    if REBUILD_POINTWISE:
        n_stash_in = sum(1 for k in keep if k < step.num_stash)
        rebuilt = rebuild_pointwise_stash(f_gm, b_gm, first_stash, keep[:n_stash_in],
                                          set(step.buffer_update_primals))
        if rebuilt.changed:
            n_extra = len(rebuilt.extra_primals)
            keep = ([keep[j] for j in rebuilt.kept_stash] + [step.num_stash + e for e in range(n_extra)]
                    + [k + n_extra for k in keep[n_stash_in:]])
            b_example = b_example[:step.num_stash] + [f_example[i] for i in rebuilt.extra_primals] \
                + b_example[step.num_stash:]
            moved_gm = b_gm
            b_gm = _decomposed(lambda *a: moved_gm(*a), [b_example[k] for k in keep])
    _update_buffers_in_graph(f_gm, step)
    t2 = time.perf_counter()
    compiled_fwd = _inductor(f_gm, f_example, is_backward=False)
    t3 = time.perf_counter()
    b_kept = [b_example[k] for k in keep]
    compiled_bwd = _inductor(b_gm, b_kept, is_backward=True)
    t4 = time.perf_counter()

    def forward(*primals):
        return compiled_fwd(list(primals))

    def backward(args: list):
        kept = [args[k] for k in keep]
        args.clear()
        return compiled_bwd(kept)

    return (dataclasses.replace(step, forward_module=forward, backward_module=backward),
            CompileTimes((t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3)))
