"""HiGHS as the solvers use it: PuLP's HiGHS interface with a MIP start and a deadline, and raw highspy models,
both made without highspy's start-up banner on stdout (the command line promises one line of output)."""
from __future__ import annotations

import contextlib
import os
import sys
import time

from solvers.pulp_import import pulp


@contextlib.contextmanager
def stdout_silenced():
    """File descriptor 1 points to /dev/null inside (highspy prints its banner from C++, past sys.stdout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def quiet_highs(highspy):
    """A highspy.Highs object, made with stdout silenced: the banner comes with the first one, before
    output_flag can be cleared."""
    with stdout_silenced():
        return highspy.Highs()


class HighsWithStart(pulp.HiGHS):
    """PuLP's HiGHS API plus a MIP start (Highs.setSolution before the run) and a deadline that covers PuLP's
    copy of the model into HiGHS (row by row, before the run) as well as the run."""

    def __init__(self, start: dict[str, float] | None = None, **kw):
        super().__init__(**kw)
        self.start = start
        self.deadline = None if self.timeLimit is None else time.perf_counter() + float(self.timeLimit)

    def createAndConfigureSolver(self, lp):
        with stdout_silenced():
            super().createAndConfigureSolver(lp)

    def callSolver(self, lp):
        if self.start:
            import highspy

            h = lp.solverModel
            vals = [0.0] * h.getNumCol()
            for v in lp.variables():
                vals[v.index] = self.start.get(v.name, 0.0)
            sol = highspy.HighsSolution()
            sol.col_value = vals
            sol.value_valid = True
            h.setSolution(sol)
        if self.deadline is not None:
            lp.solverModel.setOptionValue("time_limit", max(0.1, self.deadline - time.perf_counter()))
        super().callSolver(lp)
