"""Public API of the activation-checkpoint planner."""
