"""artifex's and datarax's data-parallel API, kept for code written against it.

artifex's ``DataParallel`` (each method also a ``*_static`` staticmethod) and datarax's
functions, with the names and signatures of those documents and the behaviour a careful user
expects (numpy batches placed, sizes checked up front, ``"shard"`` safe on biases and scalars,
gradients averaged rather than collapsed). They place state and batches with the same code as
``shardax.parallelize``; new code should use ``parallelize`` and ``shardax.Trainer``, which
cover every strategy.
"""

from shardax.compat.data_parallel import (
                                          DataParallel,
                                          create_data_parallel_sharding,
                                          model_state_shardings,
                                          place_batch_on_shards,
                                          place_model_state_on_shards,
                                          place_nnx_state_on_shards,
)
from shardax.compat.gradients import reduce_gradient_tree, reduce_gradients_across_devices
from shardax.compat.steps import data_parallel_train_step, spmd_train_step
from shardax.sharding.rules import data_parallel_rules

__all__ = [
    "DataParallel",
    "create_data_parallel_sharding",
    "data_parallel_rules",
    "data_parallel_train_step",
    "model_state_shardings",
    "place_batch_on_shards",
    "place_model_state_on_shards",
    "place_nnx_state_on_shards",
    "reduce_gradient_tree",
    "reduce_gradients_across_devices",
    "spmd_train_step",
]
