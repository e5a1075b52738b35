"""Edge vectors and lengths from positions as one op, with its backward to positions as
per-node sums over the edge CSRs (no sort, no atomics), instead of mace's indexing and norm."""
