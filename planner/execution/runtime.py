"""Running a planned step: the autograd function and the drop-in module.

`PlannedModule` wraps the original model: parameters, buffers and state_dict are the model's own, the
forward runs the planned step through `_PlannedStep` (a torch.autograd.Function) whose forward and backward are
the two fx halves `planner.execution.step_builder.build_step` made (or inductor's compilation of them,
`execution.inductor`), updated buffers are copied into the model's buffers in place (as eager BatchNorm does), and
gradients land on the model's parameters. In eval mode or under torch.no_grad it simply runs the original model.
The halves are built once: by `Plan.apply` where it has the trace, else at the first call.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from capture import state as _state
from graphs.errors import PlanMismatchError, RematError
from planner.execution.inductor import compile_halves
from planner.execution.step_builder import StepHalves, build_step


class _PlannedStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: "StepRunner", *primals):
        step = runner.step
        # the traced graph holds the casts autocast made when it was traced: it runs with autocast off (as
        # AOTAutograd runs its own graphs), and PlannedModule refuses a call in another autocast state
        with torch._C._DisableAutocast():
            res = step.forward_module(*primals)
        n_out, n_buf = step.num_outputs, len(step.buffer_updates)
        outputs = res[:n_out]
        updates = res[n_out:n_out + n_buf]
        ctx.stash = list(res[n_out + n_buf:])
        del res
        with torch.no_grad():
            for name, new in zip(step.buffer_updates, updates):
                if new is not None:  # None: the compiled forward updated the buffer itself (planner.execution.inductor)
                    runner.buffers[name].copy_(new)
        del updates
        ctx.runner = runner
        nondiff = [o for o in outputs if isinstance(o, torch.Tensor) and not o.is_floating_point()
                   and not o.is_complex()]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        # an output the loss does not reach gets None, not a zero tensor (the executor makes the zero
        # tangents the traced graph needs itself, and refuses a gradient the trace did not plan for)
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        runner: StepRunner = ctx.runner
        step = runner.step
        if ctx.stash is None:
            raise RuntimeError("the planned step's backward ran twice: its saved values are gone "
                               "(backward through a planned step once per forward)")
        for k, g in enumerate(grad_outputs):
            if g is not None and step.own_loss_leaf is not None and k != step.own_loss_leaf:
                raise PlanMismatchError(
                    f"a gradient reached output leaf {k}, which the plan does not differentiate: the model "
                    "computed its own loss, so the plan differentiates that loss alone; to backpropagate through "
                    "the other outputs too, plan without labels and pass loss_fn=")
        args = ctx.stash
        ctx.stash = None
        # Autograd holds the incoming gradients until this function returns; a gradient made here to
        # the traced strides is held as long too, so the tangent lives the whole backward either way
        # (the solver graph models it so).
        held = []
        for j in step.tangent_order:
            shape, stride, dtype = step.tangent_specs[j]
            g = grad_outputs[step.tangent_outputs[j]]
            if g is None:
                g = torch.zeros(shape, dtype=dtype, device=runner.device)
            if tuple(g.stride()) != stride or g.dtype != dtype:
                # the graph was traced for these strides (as AOTAutograd does, make them so)
                t = torch.empty_strided(shape, stride, dtype=dtype, device=g.device)
                t.copy_(g)
                g = t
            held.append(g)
            args.append(g)
        with torch._C._DisableAutocast():
            grads = step.backward_module(args)
        del held
        return (None, *grads)


class StepRunner:
    """Binds the step's halves to one model's buffers and device."""

    def __init__(self, step: StepHalves, buffers: dict[str, torch.Tensor], device: torch.device):
        self.step = step
        self.buffers = buffers
        self.device = device


class _NamedTensors:
    """The parameters or buffers (`kind` "_parameters" / "_buffers") of a module under the traced dotted names, read
    from their owning modules' own dictionaries at each call, so that a reassigned parameter or a replaced
    submodule is seen, without walking the whole module tree as named_parameters() does (half a millisecond per
    step on a 92-module ResNet, a tenth of its compiled step). The owners are looked up once and checked at each
    call: every link from the root to an owner must still hold the same module, or they are looked up again."""

    def __init__(self, names: Sequence[str], kind: str):
        self.names = list(names)
        self.kind = kind
        self.root: torch.nn.Module | None = None
        self.links: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (parent, key, child)
        self.slots: list[tuple[dict, str]] = []  # (owner's dict of this kind, leaf name) per name

    def _resolve(self, root: torch.nn.Module) -> None:
        owners: dict[str, torch.nn.Module] = {"": root}
        links = []

        def owner(prefix: str) -> torch.nn.Module:
            m = owners.get(prefix)
            if m is None:
                parent_name, _, key = prefix.rpartition(".")
                parent = owner(parent_name)
                m = parent._modules.get(key)
                if m is None:
                    raise PlanMismatchError(f"the model has no submodule '{prefix}' any more, which the plan was "
                                            "traced with: re-plan")
                owners[prefix] = m
                links.append((parent, key, m))
            return m

        slots = []
        for name in self.names:
            prefix, _, leaf = name.rpartition(".")
            slots.append((getattr(owner(prefix), self.kind), leaf))
        self.root, self.links, self.slots = root, links, slots

    def __call__(self, root: torch.nn.Module) -> list[torch.Tensor]:
        if root is not self.root or not all([parent._modules.get(key) is child for parent, key, child in self.links]):
            self._resolve(root)
        out = [d.get(leaf) for d, leaf in self.slots]
        missing = [name for name, t in zip(self.names, out) if t is None]
        if missing:
            self.root = None  # look again next time
            what = "parameter" if self.kind == "_parameters" else "buffer"
            raise PlanMismatchError(f"the model has no {what} '{missing[0]}' any more, which the plan was traced "
                                    "with: re-plan")
        return out


class PlannedModule(torch.nn.Module):
    """A drop-in replacement of `model` for training that runs a planned schedule.

    `out = m(*inputs)` (or `m(**batch)`, as the plan was traced); `loss(out).backward(); optimizer.step()` work
    as with the original model; the
    parameters, buffers, gradients and state_dict are the original model's (under the `module.` prefix
    for state_dict). Inputs must match the traced specialisation (shapes, dtypes, values read in Python), and the
    module-level globals the forward code reads must hold their traced values (capture.global_reads), or
    PlanMismatchError is raised. In eval mode, or when gradients are disabled, the original model runs.
    """

    def __init__(self, model: torch.nn.Module, plan, traced=None, compile: bool = False,
                 halves: StepHalves | None = None):
        super().__init__()
        self.module = model
        self._plan = plan
        self._traced = traced
        self._halves = halves  # built by Plan.apply where it had the trace (for inductor when `compile`)
        self._runner: StepRunner | None = None
        self.compiled = compile
        self._params: _NamedTensors | None = None  # the traced parameters and buffers (set with the runner)
        self._buffers_of: _NamedTensors | None = None
        self.compile_seconds: float | None = None  # inductor's time for both halves (compile=True; first step)
        self._param_state: list | None = None  # (requires_grad, dtype, device, tie) per traced parameter

    @property
    def plan(self):
        return self._plan

    def _check_parameters(self, params: list) -> None:
        """What the step assumes of the parameters, checked at every call: which require grad, their dtypes and
        devices, which names share one tensor (the trace lists a tied parameter once). A change raises
        PlanMismatchError: a step built for the old state would give a wrong or missing gradient."""
        ids: dict[int, int] = {}
        state = [(p.requires_grad, p.dtype, p.device, ids.setdefault(id(p), k)) for k, p in enumerate(params)]
        if self._param_state is None:
            self._param_state = state
            return
        if state == self._param_state:
            return
        k = next(i for i, (a, b) in enumerate(zip(state, self._param_state)) if a != b)
        name = self._traced.param_names[k]
        (rg, dt, dev, _tie), (rg0, dt0, dev0, _tie0) = state[k], self._param_state[k]
        if rg != rg0:
            what = f"requires_grad is {rg}, it was {rg0} when planned"
        elif dt != dt0:
            what = f"its dtype is {dt}, it was {dt0} when planned"
        elif dev != dev0:
            what = f"it is on {dev}, it was on {dev0} when planned"
        else:
            what = "it is tied to another parameter otherwise than when planned"
        raise PlanMismatchError(f"parameter '{name}' changed after the plan was applied: {what}; plan again "
                                "(planner.enable plans again by itself)")

    # ---- copying and pickling: the step is rebuilt from the plan at the first call ----------------------------
    def __deepcopy__(self, memo):
        import copy

        model = copy.deepcopy(self.module, memo)
        new = PlannedModule(model, self._plan, None, compile=self.compiled)
        memo[id(self)] = new
        new.train(self.training)
        if self._traced is not None:
            new._traced = dataclasses.replace(self._traced, model=model)
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_traced"] = None  # traced again on the first call's input (its graph checked against the plan's)
        state["_halves"] = None
        state["_runner"] = None
        state["_params"] = None
        state["_buffers_of"] = None
        state["_param_state"] = None
        state["_plan"] = dataclasses.replace(self._plan, traced=None, problem=None, halves=None)
        return state

    def _prepare(self, inputs: tuple) -> None:
        if self._runner is None:
            step = self._halves or build_step(self._traced, self._plan.compute_sequence, self._plan.split_position,
                                              for_inductor=self.compiled)
            self._halves = None
            if self.compiled:
                step, times = compile_halves(step)
                self.compile_seconds = times.total_s
            device = inputs[0].device if inputs else next(self.module.parameters()).device
            self._runner = StepRunner(step, dict(self.module.named_buffers()), device)
            self._params = _NamedTensors(self._traced.param_names, "_parameters")
            self._buffers_of = _NamedTensors(self._traced.buffer_names, "_buffers")

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() or self.module.training != self._plan.fingerprint.get("training", True):
            return self.module(*args, **kwargs)
        want = self._plan.fingerprint.get("autocast")  # JSON: [device, dtype] lists
        now = _state.autocast_state()
        if want is not None and now != tuple(tuple(s) for s in want):
            raise PlanMismatchError(f"this plan was made under {_state.describe_autocast(want)} and is called under "
                                    f"{_state.describe_autocast(now)}: the traced graph holds the first one's "
                                    "casts; plan again in this precision (or call it as it was planned)")
        if self._traced is None:  # a loaded plan: trace on the first call's input (the plan checks the graph)
            self._traced = self._plan.trace_for(self.module, (args, kwargs) if kwargs else args)
        tr = self._traced
        changed = tr.global_reads.changed() if tr.global_reads is not None else None
        if changed is not None:
            raise PlanMismatchError(f"{changed}: plan again after changing it (or keep the value in a tensor, "
                                    "a buffer or an input, which the plan reads at every step)")
        try:
            inputs = tr.call_spec.flatten(args, kwargs) if tr.call_spec is not None else args
            tr.check_input(*inputs)
        except RematError as e:
            raise PlanMismatchError(f"this plan does not fit the input: {e}") from e
        self._prepare(inputs)
        params = self._params(self.module)
        buffer_list = self._buffers_of(self.module)
        for k, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.requires_grad and not self._runner.step.grad_of_primal[
                    len(tr.param_names) + len(tr.buffer_names) + k]:
                raise PlanMismatchError(f"input {k} requires grad, but the plan was traced with an input "
                                        "that did not: re-plan with such an input")
        self._check_parameters(params)
        self._runner.buffers = dict(zip(tr.buffer_names, buffer_list))
        primals = params + buffer_list + list(inputs)
        leaves = _PlannedStep.apply(self._runner, *primals)
        return tr.output_spec.unflatten(list(leaves))
