"""Shape rules the capture uses where torch's own meta kernel disagrees with what the real CPU kernel does.

- torch 2.13's meta kernel for `aten._grouped_mm` (the grouped matmul of mixture-of-experts layers, which
  transformers' default experts code calls) insists on bfloat16 inputs, as the CUDA kernel does; the CPU kernel
  multiplies float32 too, so an eager float32 step runs and its capture on fake tensors fails. The override applies
  the same shape rule without the dtype check on CPU tensors (the real kernel still checks what it accepts).
- Batch norm's meta kernels (torch's decompositions) give the output the input's strides, and the backward's input
  gradient the incoming gradient's; the CPU kernels return both in the input's suggested memory format (contiguous
  unless the input is a channels-last 4-d or 5-d tensor). A BatchNorm1d over a transposed (B, T, C) activation is
  then strided in the trace and contiguous in the step, and a `view` the trace chose (a Linear's flattening) fails
  on the real tensor, or a kernel differs from eager's (mm + add for addmm). The override gives the kernel's layout.
  The backward's meta kernel also makes an input gradient its `output_mask` did not ask for (an input that needs no
  gradient), where the kernels return none: the capture on real values then failed comparing that tensor with the
  kernel's None (`_has_storage(): incompatible function arguments`). The override returns None there too.

While the capture runs, `overrides()` puts these in place of torch's Python meta kernels (under the Python dispatcher,
AOTAutograd's capture) and of the dispatcher's Meta kernels (a plain fake-tensor run); leaving restores torch's.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch._prims_common import suggest_memory_format


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


def _batch_norm_meta(torch_meta, input_at: int = 0):
    """torch's batch norm meta kernel (or its backward's, whose input is argument `input_at`), its first output in the
    layout the CPU kernel gives it: the input's suggested memory format (channels-last for a channels-last 4-d or 5-d
    input, else contiguous), where torch's follows the strides of the input or of the incoming gradient."""
    def meta(*args, **kwargs):
        out = torch_meta(*args, **kwargs)
        x = args[input_at]
        if input_at == 1 and not _output_mask(args, kwargs)[0]:
            return (None, *out[1:])  # the kernels make no input gradient unless asked; torch's meta always does
        if _device(x).type == "cpu" and isinstance(out[0], torch.Tensor):
            fmt = suggest_memory_format(x)
            if not out[0].is_contiguous(memory_format=fmt):
                out = (out[0].contiguous(memory_format=fmt), *out[1:])
        return out
    return meta


def _output_mask(args: tuple, kwargs: dict) -> list[bool]:
    """native_batch_norm_backward's `output_mask` (its tenth argument)."""
    return kwargs["output_mask"] if "output_mask" in kwargs else args[9]


# (op, overload, the position of its input): the forwards, and the backward (whose first argument is the gradient)
_BATCH_NORMS = (("native_batch_norm", "default", 0), ("_native_batch_norm_legit_functional", "default", 0),
                ("_native_batch_norm_legit", "default", 0), ("_native_batch_norm_legit", "no_stats", 0),
                ("_native_batch_norm_legit_no_training", "default", 0), ("native_batch_norm_backward", "default", 1))


def _replacements() -> list[tuple]:
    """(op overload, its registration name, the meta kernel the capture uses) for each override this torch has."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    found = []
    if hasattr(aten, "_grouped_mm"):
        found.append((aten._grouped_mm.default, "_grouped_mm", _grouped_mm_meta))
    key = torch._C.DispatchKey.Meta
    for name, overload, input_at in _BATCH_NORMS:
        op = getattr(getattr(aten, name, None), overload, None)
        torch_meta = None if op is None else (decomposition_table.get(op) or op.py_kernels.get(key))
        if torch_meta is not None:
            found.append((op, name if overload == "default" else f"{name}.{overload}",
                          _batch_norm_meta(torch_meta, input_at)))
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
