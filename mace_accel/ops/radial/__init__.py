"""The radial MLP family: the network that turns each edge's radial basis into its tensor
product weights (``[E, n_basis] -> [E, weight_numel]``), in every form it runs.

- :mod:`.mlp`: its spec and the plain-torch reference every kernel is tested against;
- :mod:`.table`: Hermite tables of the whole MLP over the edge length (one per pair of
  elements where the weights depend on them), looked up instead of evaluated;
- :mod:`.silu_mlp`: the whole MLP in one kernel (FMA; DMMA in float64);
- :mod:`.tc`: its hidden layers on tensor cores (mma.sync, wgmma);

Which of them a call takes is decided once per call by
:meth:`mace_accel.patches.radial.mlp.FusedRadialMLP.route`. The 3xTF32 GEMM that runs the
float32 last layer (:mod:`mace_accel.ops.tf32x3_gemm`) is shared with the equivariant linears
and stays beside this family.
"""
