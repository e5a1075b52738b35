"""The hidden layers of a radial MLP (SiLU after every layer) in one kernel per pass."""
