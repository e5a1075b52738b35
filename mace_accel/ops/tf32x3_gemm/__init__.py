"""Float32 GEMMs on the tensor cores with float32 accuracy (3xTF32): the radial MLP's last
layer, ``[E, hidden] x [hidden, weight_numel]``, the largest GEMM of a MACE call, and its
backward."""
