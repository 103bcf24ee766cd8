"""Logical axis rules: resolution, fallbacks for uneven sizes, collisions, custom strategies."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from small_models import (
    AnnotatedMLP,
    assert_trees_close,
    mse_loss,
    regression_batches,
    tiny_transformer_config,
)

from shardax import DeviceMeshManager
from shardax.layers import ShardedLinear, annotated_param
from shardax.model_parallel import parallelize
from shardax.models.transformer import TransformerLM
from shardax.sharding.report import report
from shardax.sharding.rules import resolve_spec
from shardax.sharding.strategies import STRATEGIES, Strategy, get_strategy

MESH_2x4 = DeviceMeshManager().create_device_mesh("data=2,model=4")
RULES = (("embed", "data"), ("mlp", "model"), ("heads", "model"), ("heads", "data"), ("vocab", None))


def test_resolve_maps_each_logical_name():
    spec, notes = resolve_spec(("embed", "mlp"), (16, 64), MESH_2x4, RULES, "w")
    assert spec == P("data", "model") and notes == []


def test_uneven_dimension_falls_back_to_the_next_rule_then_replicates():
    spec, notes = resolve_spec(("heads", "vocab"), (6, 10), MESH_2x4, RULES, "w")  # 6 % 4 != 0, 6 % 2 == 0
    assert spec == P("data", None)
    assert notes == ["heads=6 does not divide model=4"]
    spec, notes = resolve_spec(("heads",), (3,), MESH_2x4, RULES, "w")
    assert spec == P(None) and len(notes) == 2


def test_two_logical_axes_on_one_mesh_axis_is_an_error_naming_both():
    rules = (("embed", "model"), ("mlp", "model"))
    with pytest.raises(ValueError,
                       match=r"parameter 'w': logical axes 'embed' and 'mlp' both map to mesh axis "
                             r"'model' \(mesh data=2,model=4\)"):
        resolve_spec(("embed", "mlp"), (16, 64), MESH_2x4, rules, "parameter 'w'")


def test_unknown_logical_name_lists_the_rules():
    with pytest.raises(ValueError, match=r"logical axis 'embd' has no rule \(rules cover \['embed', 'heads'"):
        resolve_spec(("embd", None), (16, 64), MESH_2x4, RULES, "w")


def test_wrong_number_of_names():
    with pytest.raises(ValueError, match=r"2 logical axes \('embed', 'mlp'\) for an array of shape \(16,\)"):
        resolve_spec(("embed", "mlp"), (16,), MESH_2x4, RULES, "w")


def test_strategies_are_values_and_unknown_names_fail():
    assert set(STRATEGIES) == {"dp", "zero1", "zero2", "fsdp", "tp", "fsdp_tp", "hsdp", "pp", "pp_fsdp",
                               "pp_tp", "ep", "fsdp_ep", "ep_tp"}
    assert all(isinstance(s, Strategy) for s in STRATEGIES.values())
    with pytest.raises(ValueError, match="unknown strategy 'fsdq'; choose one of dp, zero1, zero2, fsdp, tp"):
        get_strategy("fsdq")


def test_strategy_that_needs_a_missing_mesh_axis():
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    with pytest.raises(ValueError,
                       match=r"strategy 'fsdp_tp' needs mesh axes \('data', 'model'\) but the mesh is "
                             r"data=8; use e.g. `mesh='data=-1,model=2'`"):
        parallelize(lambda rngs: AnnotatedMLP(rngs), optax.sgd(0.1), mesh, "fsdp_tp")


def test_a_user_defined_strategy_from_a_rules_table():
    # Sequence-free "MLP-only" tensor parallelism over a mesh axis named `tensor`.
    mesh = DeviceMeshManager().create_device_mesh("data=2,tensor=4")
    mine = Strategy("mlp_tp", param_rules=(("embed", None), ("mlp", "tensor")),
                    required_axes=("data", "tensor"))
    parallel = parallelize(lambda rngs: AnnotatedMLP(rngs), optax.sgd(0.1), mesh, mine)
    state = parallel.init()
    assert state.params["up"]["kernel"][...].sharding.spec == P(None, "tensor")
    assert {s.data.shape for s in state.params["up"]["kernel"][...].addressable_shards} == {(16, 16)}
    step = parallel.train_step(mse_loss)
    one = parallelize(lambda rngs: AnnotatedMLP(rngs), optax.sgd(0.1),
                      DeviceMeshManager(devices=jax.devices()[:1]).create_device_mesh("data=1"), "dp")
    ref_state, ref_step = one.init(), one.train_step(mse_loss)
    for batch in regression_batches(5):
        state, metrics = step(state, parallel.place_batch(batch))
        ref_state, ref_metrics = ref_step(ref_state, one.place_batch(batch))
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(jax.device_get(state.params), jax.device_get(ref_state.params))


class Uneven(nnx.Module):
    def __init__(self, rngs):
        self.odd = annotated_param(nnx.initializers.normal(), rngs.params(), (6, 12), ("heads", "embed"))
        self.scalar = nnx.Param(jax.numpy.ones(()))


def test_indivisible_leaves_are_replicated_and_reported():
    parallel = parallelize(lambda rngs: Uneven(rngs), optax.sgd(0.1),
                           DeviceMeshManager().create_device_mesh("data=8"), "fsdp")
    assert parallel.layout.leaves["odd"].spec == P(None, None)
    assert parallel.layout.notes() == [
        "odd: embed=12 does not divide data=8; replicated over data=8, no dimension of (6, 12) can take it: "
        "heads=6 is not a multiple of 8, embed=12 is not a multiple of 8"]
    text = report(parallel).table()
    first_rows = text.splitlines()[1:3]
    # largest replicated first
    assert "params/odd" in first_rows[0] and first_rows[0].rstrip().endswith("yes")
    assert "heads,embed" in first_rows[0]


def test_sharded_linear_seed_example_done_right():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layer = ShardedLinear(16, 8, rngs=nnx.Rngs(0), mesh=mesh)
    assert isinstance(layer.kernel, nnx.Param) and isinstance(layer.bias, nnx.Param)  # still parameters
    kernel = layer.kernel[...]
    assert kernel.sharding.spec == P(None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 2)}
    assert layer.bias[...].sharding.spec == P("model")
    x = np.ones((4, 16), np.float32)
    expected = x @ np.asarray(jax.device_get(kernel))
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(np.asarray(layer(x)), expected, rtol=1e-5)
    grads = nnx.grad(lambda m: m(x).sum())(layer)
    assert grads["kernel"][...].shape == (16, 8)
    with pytest.raises(ValueError,
                       match=r"dimension 1 has size 6, which does not divide over mesh axis 'model' "
                             r"of size 4"):
        ShardedLinear(16, 6, rngs=nnx.Rngs(0), mesh=mesh)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_init_goes_straight_into_shards(axis_types):
    """The compiled initialiser never holds the whole model on a device: output and scratch per
    device stay near one eighth of the full state, on a mesh of Auto or Explicit axes alike."""
    from small_models import tiny_transformer_config

    from shardax.models.transformer import TransformerLM

    config = tiny_transformer_config(d_model=64, d_ff=256, vocab_size=256)
    parallel = parallelize(lambda rngs: TransformerLM(config, rngs=rngs), optax.adamw(1e-3),
                           DeviceMeshManager(axis_types=axis_types).create_device_mesh("data=8"), "fsdp")
    full = report(parallel).replicated_bytes
    import functools

    from shardax.model_state import build_state

    init = jax.jit(functools.partial(build_state, parallel.factory, parallel.tx, 0, parallel.mesh),
                   out_shardings=parallel.state_shardings)
    memory = init.lower().compile().memory_analysis()
    assert memory.output_size_in_bytes == pytest.approx(full / 8, rel=0.02)
    assert memory.output_size_in_bytes + memory.temp_size_in_bytes < full / 2


def test_sharded_embed_splits_the_vocabulary_under_tp():
    from shardax import ShardedEmbed

    class Tagger(nnx.Module):
        def __init__(self, rngs):
            self.embed = ShardedEmbed(64, 16, rngs=rngs)

        def __call__(self, ids):
            return self.embed.attend(self.embed(ids))  # (B, T, 64) logits from a tied table

    def loss_fn(model, batch):
        logits = model(batch["ids"])
        return -jax.numpy.mean(jax.nn.log_softmax(logits)[..., 0])

    parallel = parallelize(lambda rngs: Tagger(rngs), optax.sgd(0.1), MESH_2x4, "tp")
    state = parallel.init()
    table = state.params["embed"]["embedding"][...]
    assert table.sharding.spec == P("model", None)
    assert {s.data.shape for s in table.addressable_shards} == {(16, 16)}
    batch = {"ids": np.arange(32, dtype=np.int32).reshape(4, 8)}
    state, metrics = parallel.train_step(loss_fn)(state, parallel.place_batch(batch))
    assert (np.isfinite(float(metrics["loss"]))
            and state.params["embed"]["embedding"][...].sharding.spec == P("model", None))


def test_a_stacked_bias_already_split_over_model_says_why_data_cannot_split_it():
    parallel = parallelize(lambda rngs: TransformerLM(tiny_transformer_config(), rngs=rngs), optax.sgd(0.1),
                           DeviceMeshManager().create_device_mesh("data=4,model=2"), "fsdp_tp")
    assert list(parallel.layout.leaves["blocks/layers/mlp_in_bias"].notes) == [
        "replicated over data=4, no dimension of (2, 64) can take it: layers=2 is the stacked layers, never "
        "split, mlp=64 is split over model already"]
