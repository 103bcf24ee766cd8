"""The training loop for any model: data sources, evaluation, metrics, progress, checkpoints."""
