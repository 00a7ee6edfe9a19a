"""A schedule as fx code: the step builder, the runtime (PlannedModule), RNG replay, inductor."""
