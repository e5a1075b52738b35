"""YAML-driven runs (single points, geometry optimisation, MD): config, tasks, outputs, progress.
Importing this package does no work."""
