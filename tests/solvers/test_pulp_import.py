"""PuLP is imported without the tracebacks it keeps (see solvers/pulp_import.py)."""
from __future__ import annotations

import sys
import types

from solvers.pulp_import import drop_kept_tracebacks, pulp


def _kept_exceptions(prefix: str) -> list[BaseException]:
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for holder in [module] + [v for v in vars(module).values() if isinstance(v, type)]:
            found += [v for v in vars(holder).values() if isinstance(v, BaseException)]
    return found


def test_no_exception_pulp_keeps_holds_a_traceback():
    assert pulp.LpProblem is not None
    assert all(e.__traceback__ is None for e in _kept_exceptions("pulp"))


def test_a_kept_exception_loses_its_traceback_and_its_causes_theirs():
    def failing():
        local_value = [0] * 1000  # what a traceback would keep alive  # noqa: F841
        raise ValueError("missing library")

    try:
        try:
            failing()
        except ValueError as inner:
            raise RuntimeError("backend unavailable") from inner
    except RuntimeError as e:
        kept = e
    module = types.ModuleType("kept_tracebacks_case")
    holder = type("Holder", (), {"err": kept})
    module.Holder = holder
    sys.modules["kept_tracebacks_case"] = module
    try:
        assert kept.__traceback__ is not None and kept.__cause__.__traceback__ is not None
        assert drop_kept_tracebacks("kept_tracebacks_case") == 2
        assert kept.__traceback__ is None and kept.__cause__.__traceback__ is None
        assert str(holder.err) == "backend unavailable"
    finally:
        del sys.modules["kept_tracebacks_case"]
