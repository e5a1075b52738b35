"""Model files and structures: checkpoints, foundation models, architectures, atoms -> batch,
input validation. Importing this package does no work."""
