"""The radial MLPs of the interaction blocks, fused: :mod:`.mlp` (the module that replaces
mace's radial MLP and routes each call), :mod:`.table` (its radial tables, built per set of
elements and kept while the weights stay) and :mod:`.overlap` (the radial MLPs of later blocks
started on a side stream while earlier blocks run)."""
