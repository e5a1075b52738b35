"""The whole radial MLP (SiLU hidden layers and the linear last layer) in one tensor-core kernel
each way (float32, 3xTF32)."""
