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
from user_models import (
    USER_MODELS,
    ConvNet,
    LoRAMLP,
    SeenExamples,
    classification_loss,
    image_batches,
    on_host,
    plain_nnx_run,
    vector_batches,
)

from shardax import DeviceMeshManager, LoRA, Trainer, ema_params, parallelize
from shardax.errors import UsageError
from shardax.models.adapters import add_lora, save_adapters
from shardax.step.ema import EmaState, averaged

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
        _REFERENCE[key] = plain_nnx_run(factory, TX, classification_loss, batches(STEPS),
                                        grad_accum=grad_accum, optimizer_too=True)
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
                           loss_fn=classification_loss, example_batch=next(batches(1)), grad_accum=grad_accum)
    state, step = parallel.init(seed=0), parallel.train_step(classification_loss)
    initial = variables(parallel.merge(state), nnx.Param)
    history = []
    for batch in batches(STEPS):
        state, metrics = step(state, parallel.place_batch(batch))
        history.append(jax.device_get(metrics))
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose([h[name] for h in history], [e[name] for e in expected], rtol=1e-5,
                                   atol=1e-7)
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

    ref_averages = {jax.tree_util.keystr(path): np.asarray(value)
                    for path, value in jax.tree_util.tree_leaves_with_path(
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
@pytest.mark.slow
def test_a_model_with_flax_lora_layers_trains_its_adapters_alone(strategy, mesh_shape):
    """Flax's ``nnx.LoRALinear`` in a user's model: the adapters (``nnx.LoRAParam``) train as
    plain NNX trains them with ``wrt=nnx.LoRAParam``, the base kernels stay as they were and
    hold no optimizer state; ``trainable=`` picks other parameters, and one matching none is
    refused in one line."""
    tx = optax.chain(optax.adamw(1e-2), ema_params(0.5))
    expected, ref_model = plain_nnx_run(LoRAMLP, tx, classification_loss, vector_batches(STEPS),
                                        wrt=nnx.LoRAParam)
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
    assert (sum(leaf.size for leaf in jax.tree.leaves(heads.init(0).opt_state)) - 1
            == 2 * (40 * 5 + 5 + 3 * 45))
    with pytest.raises(UsageError,
                       match=r"trainable=.* selects none of the model's parameters, so nothing would train"):
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


LORA_TARGETS = r"conv\d|head"  # the plain convolutions and the head: not the depthwise one


def lora_convnet(rngs):
    return add_lora(ConvNet(rngs), 4, 8.0, LORA_TARGETS, rngs=rngs)


@pytest.mark.parametrize("strategy, mesh_shape", STRATEGIES, ids=[s for s, _ in STRATEGIES])
@pytest.mark.slow
def test_lora_by_layer_path_on_a_users_convnet_trains_its_adapters_as_one_device(strategy, mesh_shape,
                                                                                 tmp_path):
    """``Trainer(lora=LoRA(rank, alpha, r"conv\\d|head"))`` on a model shardax knows nothing of:
    adapters on the two plain convolutions and the head, each moved under SGD as plain NNX moves
    them (``wrt=nnx.LoRAParam``); the base weights, the depthwise convolution and BatchNorm's
    parameters stay as they were and hold no optimizer state."""
    tx, batches = optax.sgd(0.1, momentum=0.9), list(image_batches(3))
    expected, ref_model = plain_nnx_run(lora_convnet, tx, classification_loss, batches, wrt=nnx.LoRAParam)
    trainer = Trainer(ConvNet, tx, classification_loss, strategy=strategy, mesh=mesh_shape,
                      lora=LoRA(4, 8.0, LORA_TARGETS), example_batch=batches[0])
    start = variables(trainer.model(trainer.init()), nnx.Param)
    result = trainer.fit(batches, steps=3, log_every=1, summary=False)
    np.testing.assert_allclose([r["loss"] for r in result.history], [e["loss"] for e in expected], rtol=1e-5)
    params, ref_params = variables(trainer.model(), nnx.Param), variables(ref_model, nnx.Param)
    adapters = {path for path in params if "lora_" in str(path)}
    assert {str(path[0].key) for path in adapters} == {"conv1", "conv2", "head"} and len(adapters) == 6
    for path in params:
        moved, ref_moved = params[path] - start[path], ref_params[path] - start[path]
        if path not in adapters:
            assert not moved.any(), path
            continue
        scale = float(np.abs(ref_moved).max())
        assert scale > 0, path
        np.testing.assert_allclose(moved, ref_moved, rtol=0, atol=1e-5 * scale + 2 * float(np.spacing(
            np.abs(ref_params[path]).max())), err_msg=str(path))
    assert (sum(leaf.size for leaf in jax.tree.leaves(result.state.opt_state))
            == sum(params[p].size for p in adapters))


class ConvThenLinear(nnx.Module):
    """A convolution (3x3, same padding), ReLU, a mean over the image, a linear head."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 6, (3, 3), rngs=rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, images):
        return self.head(nnx.relu(self.conv(images)).mean(axis=(1, 2)))


@pytest.mark.slow
def test_adapters_of_any_model_are_saved_in_peft_layout_that_peft_reads(tmp_path):
    """``save_adapters`` writes a convolution's and a linear layer's adapters as PEFT names and
    lays them out; PyTorch's twin of the model with them loaded by peft computes what ours does."""
    torch, peft = pytest.importorskip("torch"), pytest.importorskip("peft")
    model = add_lora(ConvThenLinear(nnx.Rngs(0)), 2, 5.0, ".*", rngs=nnx.Rngs(1))
    for layer in (model.conv, model.head):  # B starts at zero: make the adapters count
        layer.lora_b[...] = jax.random.normal(jax.random.key(2), layer.lora_b.shape) * 0.3
    save_adapters(model, tmp_path)

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(2, 6, 3, padding=1), torch.nn.Linear(6, 3)

        def forward(self, images):
            return self.head(torch.relu(self.conv(images)).mean(dim=(2, 3)))

    twin = Twin()
    with torch.no_grad():
        twin.conv.weight.copy_(torch.tensor(np.asarray(model.conv.kernel[...]).transpose(3, 2, 0, 1)))
        twin.conv.bias.copy_(torch.tensor(np.asarray(model.conv.bias[...])))
        twin.head.weight.copy_(torch.tensor(np.asarray(model.head.kernel[...]).T))
        twin.head.bias.copy_(torch.tensor(np.asarray(model.head.bias[...])))
    images = np.random.default_rng(0).normal(size=(4, 5, 5, 2)).astype(np.float32)
    adapted = peft.PeftModel.from_pretrained(twin, str(tmp_path)).eval()
    with torch.no_grad():
        theirs = adapted(torch.tensor(images.transpose(0, 3, 1, 2))).numpy()
    ours = np.asarray(model(images))
    base = np.asarray(nnx.merge(*nnx.split(ConvThenLinear(nnx.Rngs(0))))(images))
    assert np.abs(ours - base).max() > 1e-2  # the adapters change the outputs
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora, message", [
    (LoRA(4, targets="nothing"),
     "LoRA targets ['nothing'] match none of the model's 4 linear, einsum and conv layers"),
    (LoRA(4, targets="depthwise"),
     "LoRA on the grouped convolution 'depthwise' (feature_group_count=6) is not "),
    (LoRA(0, targets="head"), "LoRA rank 0 must be a whole number of at least 1"),
    (LoRA(2, targets="(head"),
     "LoRA targets ['(head']: missing ), unterminated subpattern at position 0; give"),
])
def test_lora_targets_that_cannot_be_adapted_are_one_line(lora, message):
    with pytest.raises(UsageError) as error:
        Trainer(ConvNet, optax.sgd(0.1), classification_loss, lora=lora)
    assert message in str(error.value) and "\n" not in str(error.value)
