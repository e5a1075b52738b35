"""Float64 GEMMs with one narrow side on Hopper's float64 tensor cores: the radial MLP's last
layer ``[E, hidden] x [hidden, weight_numel]`` (the largest GEMM of a float64 MACE call) and its
input gradient."""
