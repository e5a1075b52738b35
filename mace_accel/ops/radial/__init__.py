"""The radial MLP family: the network that turns each edge's radial basis into its tensor
product weights (``[E, n_basis] -> [E, weight_numel]``), in every form it runs.

- :mod:`.mlp`: its spec and the plain-torch reference every kernel is tested against;
- :mod:`.table`: Hermite tables of the whole MLP over the edge length (one per pair of
  elements where the weights depend on them), looked up instead of evaluated;
- :mod:`.tc`: the whole MLP in one float32 kernel per pass on the tensor cores (3xTF32:
  mma.sync, wgmma on H100/H200);
- :mod:`.silu_mlp`: its hidden layers in one float64 kernel per pass on Hopper's float64
  tensor cores (DMMA);

Which of them a call takes is decided once per call by
:meth:`mace_accel.patches.radial.mlp.FusedRadialMLP.route`. The 3xTF32 GEMM that runs the
float32 last layer (:mod:`mace_accel.ops.tf32x3_gemm`) is shared with the equivariant linears
and stays beside this family.
"""
