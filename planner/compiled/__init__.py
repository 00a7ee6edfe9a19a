"""compile(): torch.compile with the project's partitioner deciding, per compiled region, what is saved and what
recomputed."""
