"""The compiled train and eval steps of any Flax NNX model under any layout (the library layer)."""
