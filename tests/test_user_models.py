"""Models as users write them train under every strategy exactly like plain Flax NNX on one device.

BatchNorm statistics come from the global batch, Dropout draws the bits one device would draw
(a new draw each step and each microbatch), a user's own Variable is carried from step to step,
metrics returned beside the loss are averaged like it, and evaluation runs in eval mode
without touching the training state.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from shardax import DeviceMeshManager, ema_params, parallelize
from shardax.errors import UsageError
from shardax.step.ema import EmaState, averaged
from user_models import (USER_MODELS, LoRAMLP, SeenExamples, classification_loss, on_host, plain_nnx_run,
                         vector_batches)

pytestmark = pytest.mark.xdist_group("test_user_models")

STEPS = 5
STRATEGIES = [("dp", "data=8"), ("zero1", "data=8"), ("zero2", "data=8"), ("fsdp", "data=8"),
              ("tp", "data=4,model=2"), ("fsdp_tp", "data=4,model=2"), ("hsdp", "replica=2,data=4")]

# SGD, not AdamW: AdamW's update is nearly the same for a gradient wrong by a constant factor
# with a moving average of the weights, as diffusion models keep one
TX = optax.chain(optax.sgd(0.05, momentum=0.9), ema_params(0.8))
_REFERENCE = {}


def reference(model_name, grad_accum):
    key = (model_name, grad_accum)
    if key not in _REFERENCE:
        factory, batches = USER_MODELS[model_name]
        _REFERENCE[key] = plain_nnx_run(factory, TX, classification_loss, batches(STEPS), grad_accum=grad_accum,
                                        optimizer_too=True)
    return _REFERENCE[key]


def variables(model, kind):
    return {path: np.asarray(value) for path, value in jax.tree_util.tree_leaves_with_path(
        jax.device_get(nnx.state(model, kind)))}



@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("model_name", list(USER_MODELS))
@pytest.mark.parametrize("strategy, mesh_shape", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_user_model_trains_like_plain_nnx_on_one_device(strategy, mesh_shape, model_name, grad_accum):
    factory, batches = USER_MODELS[model_name]
    expected, ref_model, ref_optimizer = reference(model_name, grad_accum)
    parallel = parallelize(factory, TX, DeviceMeshManager().create_device_mesh(mesh_shape), strategy,
                           loss_fn=classification_loss, example_batch=next(batches(1)))
    state, step = parallel.init(seed=0), parallel.train_step(classification_loss, grad_accum=grad_accum)
    initial = variables(parallel.merge(state), nnx.Param)
    history = []
    for batch in batches(STEPS):
        state, metrics = step(state, parallel.place_batch(batch))
        history.append(jax.device_get(metrics))
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose([h[name] for h in history], [e[name] for e in expected], rtol=1e-5, atol=1e-7)
    assert history[-1]["loss"] != history[-2]["loss"]
    # batch statistics, RNG counters and the user's own counter: as one device has them
    model = parallel.merge(state)
    for kind in (nnx.BatchStat, nnx.RngCount, SeenExamples):
        ours, theirs = variables(model, kind), variables(ref_model, kind)
        assert ours.keys() == theirs.keys()
        for path in ours:
            scale = float(np.abs(theirs[path]).max()) or 1.0  # each statistic within 1e-5 of its own scale
            np.testing.assert_allclose(ours[path], theirs[path], rtol=0, atol=1e-5 * scale, err_msg=str(path))
    # every parameter moved as one device's did (SGD: a gradient off by any factor shows)
    params, ref_params = variables(model, nnx.Param), variables(ref_model, nnx.Param)
    for path in params:
        moved, ref_moved = params[path] - initial[path], ref_params[path] - initial[path]
        scale = float(np.abs(ref_moved).max())
        assert scale > 0, path
        np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-4 * scale, err_msg=str(path))
    # the moving average of the weights: one device's, laid out like the optimizer state
    averages = variables(parallel.ema_model(state), nnx.Param)
    def unwrapped(tree):  # plain NNX's optimizer holds Variables (OptArray); their values
        return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    ref_averages = {jax.tree_util.keystr(path): np.asarray(value) for path, value in jax.tree_util.tree_leaves_with_path(
        averaged(unwrapped(ref_optimizer.opt_state), unwrapped(nnx.state(ref_model, nnx.Param))))}
    def named(tree):
        return {jax.tree_util.keystr(path).removesuffix(".value"): value for path, value in tree.items()}

    averages, initial_by_name, params_by_name = named(averages), named(initial), named(params)
    assert averages.keys() == ref_averages.keys()
    for path in averages:
        moved, ref_moved = averages[path] - initial_by_name[path], ref_averages[path] - initial_by_name[path]
        np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-4 * float(np.abs(ref_moved).max()),
                                   err_msg=path)
        assert np.abs(averages[path] - params_by_name[path]).max() > 0, path  # an average, not the weights
    [ema] = [leaf for leaf in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, EmaState))
             if isinstance(leaf, EmaState)]
    kernel = max(jax.tree.leaves(ema.average), key=lambda leaf: leaf.size)
    if strategy in ("zero1", "zero2", "fsdp", "hsdp"):
        assert kernel.addressable_shards[0].data.size < kernel.size
    # the state stayed where the layout put it
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


@pytest.mark.parametrize("strategy, mesh_shape", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_a_model_with_flax_lora_layers_trains_its_adapters_alone(strategy, mesh_shape):
    """Flax's ``nnx.LoRALinear`` in a user's model: the adapters (``nnx.LoRAParam``) train as
    plain NNX trains them with ``wrt=nnx.LoRAParam``, the base kernels stay as they were and
    hold no optimizer state; ``trainable=`` picks other parameters, and one matching none is
    refused in one line."""
    tx = optax.chain(optax.adamw(1e-2), ema_params(0.5))
    expected, ref_model = plain_nnx_run(LoRAMLP, tx, classification_loss, vector_batches(STEPS), wrt=nnx.LoRAParam)
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    parallel = parallelize(LoRAMLP, tx, mesh, strategy, loss_fn=classification_loss,
                           example_batch=next(vector_batches(1)))
    state, step = parallel.init(seed=0), parallel.train_step(classification_loss)
    start = variables(parallel.merge(state), nnx.Param)
    history = []
    for batch in vector_batches(STEPS):
        state, metrics = step(state, parallel.place_batch(batch))
        history.append(float(metrics["loss"]))
    np.testing.assert_allclose(history, [e["loss"] for e in expected], rtol=1e-5)
    params, ref_params = variables(parallel.merge(state), nnx.Param), variables(ref_model, nnx.Param)
    for path in params:
        np.testing.assert_allclose(params[path], ref_params[path], rtol=1e-4, atol=1e-6, err_msg=str(path))
        assert np.array_equal(params[path], start[path]) == ("kernel" in str(path) or "bias" in str(path))
    # adamw's mu and nu and the adapters' average, a count and the average's weight
    assert sum(leaf.size for leaf in jax.tree.leaves(state.opt_state)) - 2 == 3 * 3 * (12 + 40 + 40 + 5)
    averages = variables(parallel.ema_model(state), nnx.Param)  # the adapters averaged, the base as it is
    for path in averages:
        assert np.array_equal(averages[path], params[path]) == ("kernel" in str(path) or "bias" in str(path))
    heads = parallelize(LoRAMLP, optax.adamw(1e-2), mesh, strategy, loss_fn=classification_loss,
                        example_batch=next(vector_batches(1)), trainable=nnx.PathContains("out"))
    assert sum(leaf.size for leaf in jax.tree.leaves(heads.init(0).opt_state)) - 1 == 2 * (40 * 5 + 5 + 3 * 45)
    with pytest.raises(UsageError, match=r"trainable=.* selects none of the model's parameters, so nothing would train"):
        parallelize(LoRAMLP, optax.adamw(1e-2), mesh, strategy, trainable=nnx.PathContains("missing"))


@pytest.mark.parametrize("model_name", list(USER_MODELS))
@pytest.mark.parametrize("strategy, mesh_shape", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_evaluation_runs_in_eval_mode_and_leaves_the_state_alone(strategy, mesh_shape, model_name):
    factory, batches = USER_MODELS[model_name]
    _, ref_model, _ = reference(model_name, 1)
    parallel = parallelize(factory, TX, DeviceMeshManager().create_device_mesh(mesh_shape), strategy,
                           loss_fn=classification_loss, example_batch=next(batches(1)))
    state, step = parallel.init(seed=0), parallel.train_step(classification_loss, donate=False)
    for batch in batches(STEPS):
        state, _ = step(state, parallel.place_batch(batch))
    held_out = next(batches(1, seed=7))
    before = on_host(state)
    evaluate = parallel.eval_step(classification_loss)
    first = jax.device_get(evaluate(state, parallel.place_batch(held_out)))
    again = jax.device_get(evaluate(state, parallel.place_batch(held_out)))
    assert first == again  # no dropout draw, no statistics moved
    jax.tree.map(np.testing.assert_array_equal, on_host(state), before)
    ref_model.eval()  # running averages, no dropout
    expected_loss, expected = classification_loss(ref_model, held_out)
    np.testing.assert_allclose(first["loss"], expected_loss, rtol=1e-5)
    np.testing.assert_allclose(first["accuracy"], expected["accuracy"], rtol=1e-6)
    # training resumes from the same state as if nothing had been evaluated
    trained, _ = step(state, parallel.place_batch(held_out))
    fresh = parallel.init(seed=0)
    for batch in batches(STEPS):
        fresh, _ = step(fresh, parallel.place_batch(batch))
    untouched, _ = step(fresh, parallel.place_batch(held_out))
    jax.tree.map(np.testing.assert_array_equal, on_host(trained), on_host(untouched))
