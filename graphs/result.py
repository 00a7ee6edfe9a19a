"""What every solver returns: a schedule the simulator replayed, its status, and what is known about it."""
from __future__ import annotations

from dataclasses import dataclass, field

from graphs.schedule import Schedule, Status
from graphs.simulate import SimResult


@dataclass
class SolveResult:
    """What every solver returns: a schedule checked by the simulator, and what is known about it.

    lower_bound_cost: a proven lower bound on the cost of any schedule in budget (None if unknown).
    """

    schedule: Schedule
    status: Status
    solver: str
    budget_bytes: int
    solve_seconds: float
    sim: SimResult
    lower_bound_cost: float | None = None
    info: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.sim.peak_bytes

    @property
    def total_cost(self) -> float:
        return self.sim.total_cost

    @property
    def overhead(self) -> float:
        return self.sim.overhead

    def summary(self) -> str:
        lb = "" if self.lower_bound_cost is None else f" lower_bound_cost={self.lower_bound_cost:.6g}"
        if lb and self.info.get("bound_scope"):
            lb += f" (bound for: {self.info['bound_scope']})"
        via = f" via={self.info['chosen']}" if self.info.get("chosen") else ""
        return (
            f"solver={self.solver}{via} status={self.status.value.replace(' ', '_')} "
            f"peak/budget={self.peak_bytes}/{self.budget_bytes} ({self.peak_bytes / max(self.budget_bytes, 1):.4f}) "
            f"overhead={100 * self.overhead:.3f}% seconds={self.solve_seconds:.3f}{lb}"
        )
