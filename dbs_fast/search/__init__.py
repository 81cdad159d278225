"""The search: the beam loop, its rows, the per-batch tables, guidance, the quality score and the result."""
