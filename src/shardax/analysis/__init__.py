"""Inspect what a compiled XLA program does: which collectives it runs and how many bytes they move."""
