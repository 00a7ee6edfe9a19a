"""PuLP, imported without the tracebacks it keeps.

At import, PuLP's interfaces to optional commercial solvers (COPT, CPLEX) catch the failure to load their library
and keep the exception on the class (`COPT_DLL.err`), traceback included. That traceback's frames reach back, through
the import machinery, to whatever code imported PuLP first: when that is a solver called from `plan()` or
`enable()`, the caller's frames, with the model's inputs and activations in their locals, stay alive for the life of
the process (a block's input, 1 MiB on the decoder512 benchmark, was held that way). The exceptions are kept (their
message says why the backend is missing); only their tracebacks are dropped.

Every module of `solvers` imports PuLP from here: `from solvers.pulp_import import pulp`.
"""
from __future__ import annotations

import sys

import pulp


def drop_kept_tracebacks(prefix: str = "pulp") -> int:
    """Clear the traceback (and those of its causes) of every exception stored as a class or module attribute in
    the modules named `prefix` or `prefix.*`; returns how many were cleared."""
    cleared = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        holders = [module] + [v for v in vars(module).values() if isinstance(v, type)]
        for holder in holders:
            for value in list(vars(holder).values()):
                seen: set[int] = set()
                while isinstance(value, BaseException) and id(value) not in seen:
                    seen.add(id(value))
                    if value.__traceback__ is not None:
                        value.__traceback__ = None
                        cleared += 1
                    value = value.__cause__ or value.__context__
    return cleared


drop_kept_tracebacks()

__all__ = ["pulp", "drop_kept_tracebacks"]
