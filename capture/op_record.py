"""The operators a forward runs, as selective activation checkpointing sees them.

`OpRecorder` is a TorchDispatchMode that records, for every operator run under it, what a per-op save policy
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) needs to decide and to be costed:

- `func` and `occurrence` (the how-many-th call of that operator in the forward): the identity a policy keys on, the
  same at every input shape of code that takes the same path. What a key/value cache's `update` runs is not seen
  (capture.kv_cache.in_cache_update: a recomputation answers it otherwise);
- `out_bytes`: the bytes of the new storages its outputs hold (a view or an alias of an input holds none), and
  `new_sizes`, each one's bytes and the dimensions of the output holding it;
- `flops` (torch.utils.flop_counter's formulas) and `written_bytes` (its outputs' bytes; none for a view): what
  running it again costs;
- `needed`: autograd saves one of its outputs' storages for the backward (`record_forward` watches its saved-tensor
  hooks). A recomputation stops once it has made the last needed output (torch.utils.checkpoint's early stop), so
  what runs after that operator is never computed again;
- `savable`, or why not: a policy may keep an operator's outputs only where that is safe. Not a view or an
  in-place/out= operator (its output is an input's storage), not a random operator (a recomputation that skipped its
  draw would shift the draws of the random operators after it), no output aliasing an input, and no output whose
  storage a later operator of the forward writes in place (the kept copy would be the written one). An output
  autograd does not keep may be kept all the same: it is held for nothing but saves running its operator again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from capture.costs import flop_formula
from capture.kv_cache import in_cache_update
from capture.random_draws import draws_random


@dataclass
class OpRecord:
    func: object  # an OpOverload
    occurrence: int
    out_bytes: int
    written_bytes: int
    flops: int
    savable: bool
    why_not: str = ""
    needed: bool = False
    # (bytes, dimensions) of each new storage its outputs hold (the dimensions of the tensor that holds it): what a
    # bound at another input size scales (planner.inplace.scaling)
    new_sizes: tuple = ()

    @property
    def name(self) -> str:
        return f"{self.func}#{self.occurrence}"


def _storages(tree) -> list[tuple[StorageWeakRef, torch.Tensor]]:
    out = []
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            out.append((StorageWeakRef(t.untyped_storage()), t))
    return out


def _writes_inputs(func) -> bool:
    schema = func._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def record_forward(fn, *args, **kwargs) -> tuple[object, list[OpRecord]]:
    """(fn's output, the records of its operators), autograd's saved tensors watched (`OpRecord.needed`). Autograd
    keeps nothing: the output cannot be differentiated, and
    the forward holds what a checkpointed one holds."""
    return _recorded(fn, args, kwargs, keep=False)


def record_kept_forward(fn, *args, **kwargs) -> tuple[object, list[OpRecord]]:
    """`record_forward` with autograd keeping what it saves, as it does without hooks: the output can be
    differentiated once (its backward frees what the hooks hold)."""
    return _recorded(fn, args, kwargs, keep=True)


def _recorded(fn, args, kwargs, keep: bool):
    recorder = OpRecorder()
    saved: set[StorageWeakRef] = set()

    def pack(t):  # kept or not; without `keep` nothing is (keeping `t` ties an output to its own node until backward)
        saved.add(StorageWeakRef(t.untyped_storage()))
        return t if keep else None

    def unpack(t):
        if t is None:
            raise RuntimeError("a recorded forward has no backward")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), recorder:
        out = fn(*args, **kwargs)
    for k in saved:
        if k in recorder._made_by:
            recorder.records[recorder._made_by[k]].needed = True
    return out, recorder.records


class OpRecorder(TorchDispatchMode):
    """Records the operators run under it (see the module docstring) into `records`, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self._counts: dict = {}
        self._made_by: dict[StorageWeakRef, int] = {}  # storage -> index of the record that created it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if in_cache_update():  # what a cache's update runs differs between a forward and a recomputation: unseen
            return out
        k = self._counts.get(func, 0)
        self._counts[func] = k + 1
        ins = _storages((args, kwargs))
        in_keys = {key for key, _ in ins}
        if _writes_inputs(func):  # whatever made the storages it writes can no longer be kept as made
            for key, _ in ins:
                made = self._made_by.get(key)
                if made is not None and self.records[made].savable:
                    self.records[made].savable = False
                    self.records[made].why_not = f"written in place later by {func}"
        outs = _storages(out)
        new = {key: t for key, t in outs if key not in in_keys}
        out_bytes = sum(int(t.untyped_storage().nbytes()) for t in new.values())
        written = 0 if func.is_view else sum(t.numel() * t.element_size() for _, t in outs)
        counter = flop_formula(func)
        flops = int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
        why = ""
        if not outs or len(tree_leaves(out)) != len(outs):
            why = "an output that is not a tensor"
        elif func.is_view or _writes_inputs(func):
            why = "a view or in-place operator"
        elif draws_random(func, args, kwargs):
            why = "a random operator"
        elif len(new) != len(outs):
            why = "an output aliases an input"
        index = len(self.records)
        sizes = tuple((int(t.untyped_storage().nbytes()), tuple(t.shape)) for t in new.values())
        self.records.append(OpRecord(func, k, out_bytes, written, flops, not why, why, new_sizes=sizes))
        for key in new:
            self._made_by.setdefault(key, index)
        return out
