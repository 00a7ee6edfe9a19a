"""Shape rules the capture uses where torch's own meta kernel disagrees with what the real CPU kernel does.

- torch 2.13's meta kernel for `aten._grouped_mm` (the grouped matmul of mixture-of-experts layers, which
  transformers' default experts code calls) insists on bfloat16 inputs, as the CUDA kernel does; the CPU kernel
  multiplies float32 too, so an eager float32 step runs and its capture on fake tensors fails. The override applies
  the same shape rule without the dtype check on CPU tensors (the real kernel still checks what it accepts).
- Batch norm's meta kernels (torch's decompositions) give the output the input's strides; the CPU kernel returns it
  in the input's suggested memory format, contiguous for an input of 3 or fewer dimensions. A BatchNorm1d over a
  transposed (B, T, C) activation is then contiguous in the trace and not in the step, and a `view` the trace chose
  (a Linear's flattening) fails on the real tensor. The override makes such outputs contiguous, as the kernel does.

While the capture runs, `overrides()` puts these in place of torch's Python meta kernels (under the Python dispatcher,
AOTAutograd's capture) and of the dispatcher's Meta kernels (a plain fake-tensor run); leaving restores torch's.
"""
from __future__ import annotations

import contextlib
import warnings

import torch


def _device(t: torch.Tensor) -> torch.device:
    return getattr(t, "fake_device", t.device)  # inside the kernel a fake tensor reports "meta"


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    if _device(mat_a).type != "cpu" or mat_a.dtype != mat_b.dtype:  # CUDA's rule is torch's; mixed dtypes too
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "multiplicands must be 2D or 3D")
    torch._check(mat_a.size(-1) == mat_b.size(-2) or (mat_a.dim() == 2 and mat_b.dim() == 2),
                 lambda: "contraction dimensions differ")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


def _batch_norm_meta(torch_meta):
    """torch's batch norm meta kernel, its output made contiguous where the CPU kernel's is (3 or fewer dims)."""
    def meta(x, *args, **kwargs):
        out = torch_meta(x, *args, **kwargs)
        if _device(x).type == "cpu" and x.dim() <= 3 and not out[0].is_contiguous():
            out = (out[0].contiguous(), *out[1:])
        return out
    return meta


_BATCH_NORMS = (("native_batch_norm", "default"), ("_native_batch_norm_legit_functional", "default"),
                ("_native_batch_norm_legit", "default"), ("_native_batch_norm_legit", "no_stats"),
                ("_native_batch_norm_legit_no_training", "default"))


def _replacements() -> list[tuple]:
    """(op overload, its registration name, the meta kernel the capture uses) for each override this torch has."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    found = []
    if hasattr(aten, "_grouped_mm"):
        found.append((aten._grouped_mm.default, "_grouped_mm", _grouped_mm_meta))
    key = torch._C.DispatchKey.Meta
    for name, overload in _BATCH_NORMS:
        op = getattr(getattr(aten, name, None), overload, None)
        torch_meta = None if op is None else (decomposition_table.get(op) or op.py_kernels.get(key))
        if torch_meta is not None:
            found.append((op, name if overload == "default" else f"{name}.{overload}", _batch_norm_meta(torch_meta)))
    return found


@contextlib.contextmanager
def overrides():
    """Within: the capture's meta kernels above in place of torch's (restored on leaving)."""
    from torch._decomp import decomposition_table

    key = torch._C.DispatchKey.Meta
    replaced = _replacements()
    before = [(op.py_kernels.get(key), decomposition_table.get(op)) for op, _, _ in replaced]
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op, name, meta in replaced:
            op.py_kernels[key] = meta  # under the Python dispatcher (AOTAutograd's capture)
            op._dispatch_cache.clear()
            if op in decomposition_table:  # a fake tensor runs torch's decomposition of the op where it has one
                decomposition_table[op] = meta
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel": until lib is destroyed
                lib.impl(name, meta, "Meta")  # and the dispatcher's Meta kernel (a plain fake-tensor run)
        yield
    finally:
        lib._destroy()
        for (op, _, _), (kernel, decomposition) in zip(replaced, before):
            if kernel is None:
                op.py_kernels.pop(key, None)
            else:
                op.py_kernels[key] = kernel
            if decomposition is not None:
                decomposition_table[op] = decomposition
            op._dispatch_cache.clear()
