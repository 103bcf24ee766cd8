import logging

import jax
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P
from small_models import MLP

from shardax.compat import (
    DataParallel,
    model_state_shardings,
    place_model_state_on_shards,
    place_nnx_state_on_shards,
)


def model():
    return MLP(nnx.Rngs(0))


def expect_shards(array, source, spec):
    """Every device holds exactly the slice of `source` that `spec` assigns it."""
    assert array.sharding.spec == spec, (array.sharding.spec, spec)
    np.testing.assert_array_equal(np.asarray(array), source)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(source)[shard.index])


def test_replicate_puts_everything_on_every_device(mesh8):
    state = nnx.state(model())
    placed = DataParallel().shard_model_state(state, mesh8, param_sharding="replicate")
    for original, leaf in zip(jax.tree.leaves(state), jax.tree.leaves(placed)):
        assert leaf.sharding.is_fully_replicated and len(leaf.addressable_shards) == 8
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(original))


def test_shard_uses_largest_divisible_dim_and_replicates_the_rest(mesh8, caplog):
    state = nnx.state(model())
    with caplog.at_level(logging.INFO, logger="shardax"):
        placed = DataParallel.shard_model_state_static(state, mesh8, param_sharding="shard")
    expect_shards(placed["hidden"]["kernel"][...], state["hidden"]["kernel"][...],
                  P(None, "data"))  # (16, 32)
    expect_shards(placed["hidden"]["bias"][...], state["hidden"]["bias"][...], P("data"))  # (32,)
    expect_shards(placed["odd"]["kernel"][...], state["odd"]["kernel"][...], P("data", None))  # (32, 3)
    expect_shards(placed["odd"]["bias"][...], state["odd"]["bias"][...], P())  # (3,) cannot divide
    expect_shards(placed["out"]["kernel"][...], state["out"]["kernel"][...], P())  # (3, 4)
    shard = placed["hidden"]["kernel"][...].addressable_shards[0]
    assert shard.data.shape == (16, 4)
    assert "odd/bias" in caplog.text and "out/kernel" in caplog.text and "data=8" in caplog.text


@pytest.mark.parametrize("factory", ["mlp", "convnet"])
def test_shard_mode_is_the_fsdp_strategys_placement(mesh8, factory):
    """One placement engine: the seed API's "shard" puts every parameter where parallelize's fsdp does."""
    from user_models import ConvNet

    from shardax import parallelize

    make = {"mlp": MLP, "convnet": ConvNet}[factory]
    params = nnx.state(make(nnx.Rngs(0)), nnx.Param)
    placed = place_model_state_on_shards(params, mesh8, "shard")
    fsdp = parallelize(make, optax.adamw(1e-3), mesh8, "fsdp").state_shardings.params
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(placed)]
    assert specs == [sharding.spec for sharding in jax.tree.leaves(fsdp)]
    assert any(specs) and not all(specs)  # some split, some (sizes that never divide) replicated


def test_shard_handles_optax_state_with_scalar_count(mesh8):
    params = nnx.state(model(), nnx.Param)
    opt_state = optax.adamw(1e-3).init(params)
    placed = place_model_state_on_shards(opt_state, mesh8, "shard")
    count = placed[0].count
    assert count.shape == () and count.sharding.is_fully_replicated
    mu = placed[0].mu["hidden"]["kernel"][...]
    assert mu.sharding.spec == P(None, "data")
    assert {s.data.shape for s in mu.addressable_shards} == {(16, 4)}


def test_whole_module_is_placed_in_place(mesh8):
    net = model()
    before = np.asarray(net.hidden.kernel[...])
    returned = place_model_state_on_shards(net, mesh8, "shard")
    assert returned is net
    expect_shards(net.hidden.kernel[...], before, P(None, "data"))


def test_flax_train_state(mesh8):
    params = nnx.to_pure_dict(nnx.state(model(), nnx.Param))
    state = TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.sgd(0.1, momentum=0.9))
    placed = place_model_state_on_shards(state, mesh8, "shard")
    assert isinstance(placed, TrainState) and placed.tx is state.tx
    assert placed.params["hidden"]["kernel"].sharding.spec == P(None, "data")
    assert placed.step.sharding.is_fully_replicated and int(placed.step) == 0
    assert placed.opt_state[0].trace["hidden"]["kernel"].sharding.spec == P(None, "data")


def test_path_patterns_first_match_wins_unmatched_replicated(mesh2d):
    state = nnx.state(model())
    patterns = {"hidden/kernel": P(None, "model"), "h*/bias": P("data"), "od?/kernel": P("data", None)}
    placed = place_model_state_on_shards(state, mesh2d, patterns)
    expect_shards(placed["hidden"]["kernel"][...], state["hidden"]["kernel"][...], P(None, "model"))
    expect_shards(placed["odd"]["kernel"][...], state["odd"]["kernel"][...], P("data", None))
    expect_shards(placed["hidden"]["bias"][...], state["hidden"]["bias"][...], P("data"))


def test_path_pattern_that_matches_nothing_is_an_error(mesh8):
    with pytest.raises(ValueError, match=r"sharding pattern 'hiden/kernel' matches no leaf .*'hidden/bias'"):
        place_model_state_on_shards(nnx.state(model()), mesh8, {"hiden/kernel": P("data")})


def test_path_pattern_with_indivisible_spec_names_the_leaf(mesh8):
    with pytest.raises(ValueError) as info:
        place_model_state_on_shards(nnx.state(model()), mesh8, {"odd/bias": P("data")})
    message = str(info.value)
    assert "'odd/bias'" in message and "size 3" in message and "size 8" in message and "data=8" in message


def test_pattern_with_unknown_mesh_axis(mesh8):
    with pytest.raises(ValueError,
                       match=r"names mesh axis 'model', but the mesh data=8 has axes \('data',\)"):
        place_model_state_on_shards(nnx.state(model()), mesh8, {"hidden/kernel": P(None, "model")})


@pytest.mark.parametrize("mode", ["shrad", "fsdp", 3])
def test_unknown_mode_lists_valid_modes(mesh8, mode):
    with pytest.raises(ValueError, match=r"is not a placement mode; use one of 'replicate', 'shard'"):
        DataParallel().shard_model_state(nnx.state(model()), mesh8, param_sharding=mode)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_nnx_filters_on_auto_and_explicit_meshes(axis_type):
    mesh = make_mesh((4, 2), ("data", "model"), jax.sharding.AxisType.Auto if axis_type == "auto"
                     else jax.sharding.AxisType.Explicit)
    state = nnx.state(model())
    kernels = nnx.All(nnx.Param, nnx.PathContains("odd"), nnx.PathContains("kernel"))
    hidden_kernel = nnx.All(nnx.PathContains("hidden"), nnx.PathContains("kernel"))
    placed = place_nnx_state_on_shards(state, mesh, {hidden_kernel: P(None, "model"),
                                                     kernels: P("data", None)})
    expect_shards(placed["hidden"]["kernel"][...], state["hidden"]["kernel"][...], P(None, "model"))
    expect_shards(placed["hidden"]["bias"][...], state["hidden"]["bias"][...], P())
    expect_shards(placed["odd"]["kernel"][...], state["odd"]["kernel"][...], P("data", None))
    expect_shards(placed["odd"]["bias"][...], state["odd"]["bias"][...], P())


def test_nnx_state_sharding_object_and_unused_filter(mesh8):
    state = nnx.state(model())
    placed = place_nnx_state_on_shards(state, mesh8, nnx.StateSharding({nnx.Param: P()}))
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(placed))
    with pytest.raises(ValueError, match="NNX filter .*BatchStat.* matches no Variable"):
        place_nnx_state_on_shards(state, mesh8, {nnx.BatchStat: P("data")})


def test_replicate_params_and_shardings_without_moving(mesh8):
    params = {"w": np.ones((8, 8), np.float32)}
    placed = DataParallel.replicate_params_static(params, mesh8)
    assert placed["w"].sharding.is_fully_replicated
    shardings = model_state_shardings(params, mesh8, "shard")
    assert shardings["w"].spec == P("data", None)
