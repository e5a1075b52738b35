"""The radial MLP family: the network that turns each edge's radial basis into its tensor
product weights (``[E, n_basis] -> [E, weight_numel]``), in every form it runs.

- :mod:`.mlp`: the MLP layer by layer (a GEMM per layer, a SiLU per hidden layer, the
  constants folded into the weights) and the plain-torch reference every kernel is tested
  against;
- :mod:`.table`: Hermite tables of the whole MLP over the edge length (one per pair of
  elements where the weights depend on them), looked up instead of evaluated.

Which of them a call takes is decided once per call by
:meth:`mace_accel.patches.radial.mlp.FusedRadialMLP.route`. The 3xTF32 GEMMs that run the
float32 layers (:mod:`mace_accel.ops.tf32x3_gemm`) are shared with the folded convolution
(:mod:`mace_accel.ops.conv_tp.folded`, which runs the last layer itself) and stay beside this
family.
"""
