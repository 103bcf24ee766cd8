"""Training: gradient reductions and train steps."""
