"""The radial MLP family: the network that turns each edge's radial basis into its tensor
product weights (``[E, n_basis] -> [E, weight_numel]``), in every form it runs.

- :mod:`.mlp`: the MLP layer by layer (a GEMM per layer, a SiLU per hidden layer, the
  constants folded into the weights) and the plain-torch reference every kernel is tested
  against;
- :mod:`.table`: Hermite tables of the whole MLP over the edge length (one per pair of
  elements where the weights depend on them), looked up instead of evaluated.

Which of them a call takes is decided once per call by
:meth:`mace_accel.patches.radial.mlp.FusedRadialMLP.route`. The layers are cuBLAS GEMMs, in
float32 and float64 alike; the folded convolution (:mod:`mace_accel.ops.conv_tp.folded`) runs
the last one itself.
"""
