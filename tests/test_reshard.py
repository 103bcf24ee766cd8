"""Moving a training state between strategies and meshes keeps every value, bit for bit."""

import itertools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from small_models import tiny_transformer_config

from shardax import DeviceMeshManager
from shardax.model_parallel import parallelize, reshard
from shardax.models.transformer import TransformerLM

TARGETS = {
    "dp/8": ("dp", "data=8"), "zero1/8": ("zero1", "data=8"), "zero2/8": ("zero2", "data=8"),
    "fsdp/8": ("fsdp", "data=8"), "tp/2x4": ("tp", "data=2,model=4"),
    "fsdp_tp/2x4": ("fsdp_tp", "data=2,model=4"),
    "fsdp_tp/4x2": ("fsdp_tp", "data=4,model=2"), "hsdp/2x4": ("hsdp", "replica=2,data=4"),
    "fsdp/4": ("fsdp", "data=4"), "dp/1": ("dp", "data=1"),
}


def factory(rngs):
    return TransformerLM(tiny_transformer_config(), rngs=rngs)


_PARALLEL = {}


def parallel_for(name):
    if name not in _PARALLEL:
        strategy, shape = TARGETS[name]
        mesh = DeviceMeshManager().create_device_mesh(shape)
        _PARALLEL[name] = parallelize(factory, optax.adamw(1e-3), mesh, strategy)
    return _PARALLEL[name]


_TRAINED = {}


def trained_state(name):
    """A state whose optimizer moments are not zero: one update with made-up gradients."""
    if name not in _TRAINED:
        parallel = parallel_for(name)

        @jax.jit
        def update(state):
            grads = jax.tree.map(lambda p: jax.numpy.sin(p * 7.0), state.params)
            updates, opt_state = parallel.tx.update(grads, state.opt_state, state.params)
            return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)

        _TRAINED[name] = update(parallel.init(seed=1))
    return _TRAINED[name]


def assert_bit_exact(a, b):
    for x, y in zip(jax.device_get(jax.tree.leaves(a)), jax.device_get(jax.tree.leaves(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# a round trip runs both directions between two strategies: each pair once (its two orders would
# make the same two reshards)
@pytest.mark.parametrize("source, target", list(itertools.combinations(
    ["dp/8", "zero1/8", "zero2/8", "fsdp/8", "tp/2x4", "fsdp_tp/2x4", "hsdp/2x4"], 2)))
def test_round_trip_between_strategies_is_bit_exact(source, target):
    original = trained_state(source)
    there = reshard(original, parallel_for(target))
    assert jax.tree.map(lambda a: a.sharding, there) == parallel_for(target).state_shardings
    back = reshard(there, parallel_for(source))
    assert jax.tree.map(lambda a: a.sharding, back) == parallel_for(source).state_shardings
    assert_bit_exact(back, original)
    assert_bit_exact(there, original)


@pytest.mark.parametrize("source, target", [("dp/8", "fsdp/8"), ("fsdp/8", "fsdp_tp/2x4"),
                                            ("fsdp/8", "fsdp/4"), ("fsdp_tp/4x2", "dp/1"),
                                            ("fsdp/4", "fsdp_tp/2x4")])
def test_between_meshes_each_device_gets_its_own_piece(source, target):
    original = trained_state(source)
    moved = reshard(original, parallel_for(target))
    full = np.asarray(jax.device_get(original.params["blocks"]["layers"]["mlp_in"][...]))
    kernel = moved.params["blocks"]["layers"]["mlp_in"][...]
    devices = {shard.device for shard in kernel.addressable_shards}
    assert devices == set(parallel_for(target).mesh.devices.flat)
    for shard in kernel.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    assert_bit_exact(reshard(moved, parallel_for(source)), original)


def test_reshard_to_explicit_shardings_tree():
    original = trained_state("fsdp/8")
    mesh = parallel_for("tp/2x4").mesh
    target = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, P()), original.params)
    moved = reshard(original.params, target)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(moved))
    assert_bit_exact(moved, original.params)
