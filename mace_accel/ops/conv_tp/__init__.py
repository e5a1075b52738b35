"""The fused convolution: gather by sender, per-edge ``uvu`` tensor product, sum to receiver."""
