"""A radial MLP tabulated in the edge length: ``w(r) = MLP(embedding(r))`` as a Hermite spline
over ``[0, r_max]``, evaluated per edge instead of the MLP (CUDA, inference): cubic in float32,
quintic in float64.

In MACE the TP weights of an edge depend on its length alone (the radial embedding of ``r``
fed to a SiLU MLP), so for a given model they are one smooth curve ``[0, r_max] -> R^n``. The
table holds, per cell of the grid, the polynomial's coefficient rows ``[cells, degree + 1, n]``,
built in float64 from the model's own embedding and MLP (values and derivatives at the nodes)
and checked against them between the nodes (:mod:`.table`). A lookup reads a cell's rows and
writes the weights: with the edges walked in order of length (:mod:`.cuda`), consecutive edges
share a cell, whose coefficients a thread keeps in registers, so the pass costs about the
bytes of ``w`` alone, where the MLP is bound by its GEMMs. The backward is
``d r = <d w, w'(r)>``, the spline's own derivative, so forces are the exact gradient of the
tabulated energy.
"""
