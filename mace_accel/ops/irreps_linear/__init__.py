"""Equivariant linear maps of node features (e3nn ``o3.Linear``, MACE's element-indexed skip):
one generated kernel per pass for all irrep blocks."""
