"""Shape rules the capture uses where torch's own meta kernel refuses what the real kernel runs.

torch 2.13's meta kernel for `aten._grouped_mm` (the grouped matmul of mixture-of-experts layers, which transformers'
default experts code calls) insists on bfloat16 inputs, as the CUDA kernel does; the CPU kernel multiplies float32
too, so an eager float32 step runs and its capture on fake tensors fails. While the capture runs, `overrides()` puts
its Python meta kernel that applies the same shape rule without the dtype check on CPU tensors (the real kernel
still checks what it accepts when the step runs); leaving the context restores torch's.
"""
from __future__ import annotations

import contextlib

import torch


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    from torch._meta_registrations import _create_grouped_mm_output_tensor, meta_grouped_mm

    device = getattr(mat_a, "fake_device", mat_a.device)  # inside the kernel a fake tensor reports "meta"
    if device.type != "cpu" or mat_a.dtype != mat_b.dtype:  # CUDA's rule is torch's; mixed dtypes too
        return meta_grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "multiplicands must be 2D or 3D")
    torch._check(mat_a.size(-1) == mat_b.size(-2) or (mat_a.dim() == 2 and mat_b.dim() == 2),
                 lambda: "contraction dimensions differ")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


@contextlib.contextmanager
def overrides():
    """Within: the capture's shape rules above in place of torch's Python meta kernels (restored on leaving)."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None:
        yield
        return
    import warnings

    overload = op.default
    key = torch._C.DispatchKey.Meta
    before = overload.py_kernels.get(key)
    overload.py_kernels[key] = _grouped_mm_meta  # under the Python dispatcher (AOTAutograd's capture)
    overload._dispatch_cache.clear()
    lib = torch.library.Library("aten", "IMPL")  # and the dispatcher's Meta kernel (a plain fake-tensor run)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": until lib is destroyed
            lib.impl("_grouped_mm", _grouped_mm_meta, "Meta")
        yield
    finally:
        lib._destroy()
        if before is None:
            overload.py_kernels.pop(key, None)
        else:
            overload.py_kernels[key] = before
        overload._dispatch_cache.clear()
