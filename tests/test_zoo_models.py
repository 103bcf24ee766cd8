"""Models written the ways open model zoos write them train under every strategy like one device.

Llama/Qwen-style (separate projections, grouped-query attention), Gemma-style (einsum weights,
a tied embedding), a Switch-style mixture of experts (stacked expert weights, one-hot dispatch) and a
model annotated with its own mesh names (``("fsdp", "tp")`` on weights, ``P("fsdp", None, "tp")`` on
activations): none carries shardax's logical names. Under ``tp`` and ``fsdp_tp`` the Megatron split is
read off what they compute, and under ``ep``, ``fsdp_ep`` and ``ep_tp`` the experts' dimension; the
mesh-named one runs under ``axis_names``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import zoo_models
from flax import nnx
from jax.sharding import AxisType
from user_models import generative_batch, plain_nnx_run
from zoo_models import LAYERS, MESH_NAMES, ZOO, lm_batches, lm_loss

import shardax
from shardax import DeviceMeshManager, Trainer, ema_params, parallelize
from shardax.analysis.collectives import find_collectives
from shardax.errors import UsageError
from shardax.sharding.paths import path_to_str
from shardax.step.ema import averaged

pytestmark = pytest.mark.xdist_group("test_zoo_models")

STEPS = 3
STRATEGIES = [("dp", "data=8"), ("fsdp", "data=8"), ("tp", "data=4,model=2"), ("fsdp_tp", "data=2,model=4"),
              ("hsdp", "replica=2,data=4")]
CASES = [(model, strategy, mesh) for model in ("llama", "gemma", "mesh-annotated")
         for strategy, mesh in STRATEGIES]
CASES += [("qwen", "tp", "data=4,model=2"), ("qwen", "fsdp_tp", "data=4,model=2")]
CASES += [("switch", strategy, mesh) for strategy, mesh in (("ep", "data=4,expert=2"),
                                                            ("fsdp_ep", "data=2,expert=4"),
                                                            ("ep_tp", "data=2,expert=2,model=2"),
                                                            ("tp", "data=4,model=2"))]
# SGD, not AdamW: AdamW's update is nearly the same for a gradient wrong by a constant factor
TX = optax.sgd(0.5, momentum=0.9)
_REFERENCE = {}


def reference(name):
    if name not in _REFERENCE:
        one = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2,
                            devices=jax.devices()[:1])
        with jax.set_mesh(one):  # the mesh-named model's constraints need a mesh; one device
            _REFERENCE[name] = plain_nnx_run(ZOO[name], TX, lm_loss, lm_batches(STEPS))
    return _REFERENCE[name]


def build(name, strategy, mesh_shape, tx=None):
    return parallelize(ZOO[name], tx or optax.adamw(1e-2), DeviceMeshManager().create_device_mesh(mesh_shape),
                       strategy, axis_names=MESH_NAMES if name == "mesh-annotated" else None,
                       loss_fn=lm_loss, example_batch=next(lm_batches(1)))


@pytest.mark.parametrize("name, strategy, mesh_shape", CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
@pytest.mark.slow
def test_zoo_model_trains_like_plain_nnx_on_one_device(name, strategy, mesh_shape):
    expected, ref_model = reference(name)
    parallel = build(name, strategy, mesh_shape, TX)
    state, step = parallel.init(seed=0), parallel.train_step(lm_loss)
    start = jax.device_get(state.params)
    losses = []
    for batch in lm_batches(STEPS):
        state, metrics = step(state, parallel.place_batch(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, [e["loss"] for e in expected], rtol=1e-5)
    assert losses[-1] < losses[0]
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                               jax.tree.leaves(jax.device_get(nnx.state(ref_model, nnx.Param))),
                               jax.tree.leaves(start)):
        # each tensor's update (SGD: a sum of its gradients) within 1e-4 of one device's; a key bias
        # has no gradient but rounding (softmax ignores a shift shared by all keys)
        moved, ref_moved = (np.asarray(x, np.float64) - np.asarray(s, np.float64) for x in (a, b))
        assert np.linalg.norm(moved - ref_moved) <= 1e-4 * np.linalg.norm(ref_moved) + 1e-6, (
            jax.tree_util.keystr(path), np.linalg.norm(moved - ref_moved), np.linalg.norm(ref_moved))
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


SPLIT = {  # what tp splits over model, by the weight's own name; everything else is a norm
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
              "lm_head"},
    "qwen": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
             "lm_head"},
    "gemma": {"q_einsum", "kv_einsum", "attn_vec_einsum", "gating_einsum", "linear", "input_embedding"},
    "mesh-annotated": {"wq", "wkv", "wo", "w_in", "w_out", "embed", "head"},
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_tp_on_model_2_holds_half_of_every_splittable_weight(name):
    parallel = build(name, "tp", "data=4,model=2")
    state = parallel.init(seed=0)
    tensor = "tp" if name == "mesh-annotated" else "model"
    for keypath, array in jax.tree_util.tree_leaves_with_path(state.params):
        leaf = parallel.layout.leaves[path_to_str(keypath)]
        owner = next(part for part in reversed(leaf.path.split("/"))
                     if part not in ("kernel", "bias", "embedding"))
        per_device = {shard.data.size for shard in array.addressable_shards}
        if owner in SPLIT[name]:
            assert per_device == {array.size // 2}, f"{leaf.path}: {per_device} of {array.size}"
        else:
            assert per_device == {array.size} and "norm" in leaf.path, leaf.path
            assert leaf.whole and "normalised" in leaf.whole or name == "mesh-annotated", leaf.whole
    assert any(f"whole on {tensor}" in note for note in parallel.layout.notes())


def _activation_reduces(compiled, rows, width):
    """All-reduces over the model pairs (the mesh data=4,model=2 groups [4,2]<=[8]), and the
    activation arrays (rows, length, width) among their operands, each counted per execution."""
    collectives = find_collectives(compiled.as_text())
    over_model = [c for c in collectives
                  if c.kind == "all-reduce" and c.replica_groups.startswith("[4,2]<=[8]")]
    shape = f"f32[{rows},16,{width}]"
    return collectives, sum(c.shapes.count(shape) * c.executions for c in over_model)


@pytest.mark.parametrize("name, readers", [("llama", (3, 2)), ("gemma", (2, 1))])
def test_tp_step_communicates_like_megatron(name, readers, capfd):
    """Forward: one all-reduce of activations after each attention and each MLP, and one for the
    vocabulary-split embedding lookup. Backward: one per weight that reads a block's input
    (Megatron's one per half when they are fused: q/k/v, gate/up), and one for the output head.
    Nothing else moves activations over model; weights never move; XLA reports no involuntary
    full rematerialization."""
    parallel = build(name, "tp", "data=4,model=2", optax.sgd(0.1))
    batch = next(lm_batches(1))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=parallel.layout.batch()), batch)
    compiled = parallel.train_step(lm_loss).lower(parallel.abstract_state, abstract).compile()
    collectives, activations = _activation_reduces(compiled, 4, 32)
    attention, mlp = readers
    assert activations == LAYERS * (2 + attention + mlp) + 2
    assert {c.kind for c in collectives} == {"all-reduce"}  # no all-gather of weights, no all-to-all
    assert "nvoluntary full rematerialization" not in capfd.readouterr().err


def test_gqa_with_fewer_kv_heads_than_model_devices_keeps_keys_and_values_whole():
    parallel = build("llama", "tp", "data=2,model=4")
    leaves = parallel.layout.leaves
    assert leaves["layers/0/self_attn/q_proj/kernel"].spec[1] == "model"
    assert leaves["layers/0/self_attn/o_proj/kernel"].spec[0] == "model"
    for projection in ("k_proj", "v_proj"):
        leaf = leaves[f"layers/0/self_attn/{projection}/kernel"]
        assert all(entry is None for entry in leaf.spec)
        assert "sizes [2] are not multiples of model=4" in leaf.whole  # 2 kv heads


def test_tp_refuses_a_model_it_cannot_split_before_anything_runs():
    from user_models import ConvNet

    mesh = DeviceMeshManager().create_device_mesh("data=4,model=2")
    with pytest.raises(UsageError, match=r"splits no weight of this model over model=2.*example_batch"):
        parallelize(ConvNet, optax.sgd(0.1), mesh, "tp")  # unannotated, and nothing to read the split from
    with pytest.raises(UsageError,
                       match=r"splits no weight of this model over model=2.*annotate the weights$"):
        Trainer(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.sgd(0.1),
                lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean(), mesh=mesh, strategy="tp",
                # widths: the data's
                example_batch={"x": np.ones((8, 4), np.float32), "y": np.ones((8, 4), np.float32)})


@pytest.mark.parametrize("strategy, mesh_shape, shards", [("ep", "data=4,expert=2", 2),
                                                         ("ep_tp", "data=2,expert=2,model=2", 4)])
def test_a_switch_style_model_holds_its_experts_split_over_expert_and_hidden_over_model(strategy, mesh_shape,
                                                                                         shards):
    """The stacked expert weights split on their experts' dimension (each device holds 1 / X of the
    experts) and, under ep_tp, each expert's hidden dimension over model, read off the program;
    the router stays whole on expert."""
    parallel = build("switch", strategy, mesh_shape)
    state = parallel.init(seed=0)
    tensor = "model" if "model" in mesh_shape else None
    for name, spec in (("wi", ("expert", None, tensor)), ("wo", ("expert", tensor, None))):
        assert tuple(parallel.layout.leaves[f"blocks/0/{name}"].spec) == spec
        array = state.params["blocks"][0][name]
        assert {shard.data.shape[0] for shard in array.addressable_shards} == {zoo_models.EXPERTS // 2}
        assert {shard.data.size for shard in array.addressable_shards} == {array.size // shards}
    assert "expert" not in tuple(parallel.layout.leaves["blocks/0/router"].spec)


class SlicedExperts(nnx.Module):
    """Stacked expert weights applied one expert at a time (``w[i]``), as tunix's Qwen3-MoE does on CPU."""

    def __init__(self, rngs):
        self.router = nnx.Linear(8, 4, rngs=rngs)
        self.wi = nnx.Param(jax.random.normal(rngs.params(), (4, 8, 16)) / 8)
        self.wo = nnx.Param(jax.random.normal(rngs.params(), (4, 16, 8)) / 16)

    def __call__(self, x):
        gates = jax.nn.softmax(self.router(x))
        return sum(gates[:, i:i + 1] * (nnx.relu(x @ self.wi[i]) @ self.wo[i]) for i in range(4))


@pytest.mark.parametrize("factory, read, found", [
    (ZOO["llama"], True, "no stack of experts' weights was found"),
    (SlicedExperts, True, "no stack of experts' weights was found"),
    (ZOO["switch"], False, "annotate the experts' dimension 'expert', or give loss_fn and example_batch")])
def test_an_expert_axis_that_would_split_no_weight_is_refused_in_one_line(factory, read, found):
    """A dense model, a mixture that slices its stacked weights expert by expert, and one whose
    program shardax was not given to read: the expert axis would be data parallelism under
    another name."""
    mesh = DeviceMeshManager().create_device_mesh("data=4,expert=2")
    batch = next(lm_batches(1)) if factory is not SlicedExperts else {"x": np.ones((8, 8), np.float32)}
    loss = lm_loss if factory is not SlicedExperts else lambda model, batch: (model(batch["x"]) ** 2).mean()
    with pytest.raises(UsageError) as error:
        parallelize(factory, optax.sgd(0.1), mesh, "ep", loss_fn=loss if read else None,
                    example_batch=batch if read else None)
    assert "strategy 'ep' splits no weight of this model over expert=2" in str(error.value)
    assert found in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name, strategy, mesh_shape", [
    ("square", "tp", "data=4,model=2"), ("vae", "tp", "data=4,model=2"), ("unet", "tp", "data=4,model=2"),
    ("dit", "tp", "data=4,model=2"),
    ("convnext", "pp_tp", "stage=2,data=2,model=2")])
@pytest.mark.slow
def test_tp_splits_the_shapes_of_generative_models_in_megatron_pairs(name, strategy, mesh_shape):
    """A square hidden weight, a VAE's equal widths, a U-Net's skips (added and concatenated),
    GroupNorm and timestep embedding, a DiT's attention and adaLN modulation, ConvNeXt's depthwise
    blocks in a pipeline: tp splits them in
    column-row pairs (at most 0.75 of the parameters on each device) and moves every weight as
    one device's two SGD steps do (the depthwise kernels' gradient too, see grouped_conv), their
    moving average (a diffusion model's EMA) too."""
    factory, batch, loss = generative_batch(name, rows=16 if name == "convnext" else 8)
    mesh = DeviceMeshManager().create_device_mesh(mesh_shape)
    tx = optax.chain(optax.sgd(0.1), ema_params(0.5))
    parallel = parallelize(factory, tx, mesh, strategy, loss_fn=loss, example_batch=batch)
    state, step = parallel.init(seed=0), parallel.train_step(loss)
    held = sum(shard.data.nbytes for leaf in jax.tree.leaves(state.params)
               for shard in leaf.addressable_shards if shard.device == jax.devices()[0])
    assert held <= 0.75 * sum(leaf.nbytes for leaf in jax.tree.leaves(state.params)), parallel.layout.notes()
    if name == "square":
        specs = {path: tuple(leaf.spec) for path, leaf in parallel.layout.leaves.items()}
        assert specs["a/kernel"] == (None, "model") and specs["b/kernel"] == ("model", None), specs
    for _ in range(2):
        state, _ = step(state, parallel.place_batch(batch))
    _, reference, optimizer = plain_nnx_run(factory, tx, lambda m, b: (loss(m, b), {}), [batch] * 2,
                                            optimizer_too=True)

    def params(tree):
        tree = tree if isinstance(tree, nnx.State) or isinstance(tree, dict) else nnx.state(tree, nnx.Param)
        return {jax.tree_util.keystr(path).removesuffix(".value"): np.asarray(value)
                for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}

    def unwrapped(tree):  # plain NNX's optimizer holds Variables; their values
        return jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, tree,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    start, ours, theirs = params(factory(nnx.Rngs(0))), params(parallel.merge(state)), params(reference)
    average = params(parallel.ema_model(state))
    ref_average = params(averaged(unwrapped(optimizer.opt_state), unwrapped(nnx.state(reference, nnx.Param))))
    for path in start:  # every weight, and its moving average, moved as one device's
        for got, want in ((ours[path], theirs[path]), (average[path], ref_average[path])):
            want = want - start[path]
            if np.abs(want).max() < 1e-7:  # a gradient that is zero but for rounding (attention's key bias)
                assert np.abs(got - start[path]).max() < 1e-7, path
                continue
            # each side is a difference of float32 weights: it carries their rounding (half a
            # spacing of the largest weight, twice), whatever the order the compiler adds in
            rounding = float(np.spacing(np.abs(start[path]).max().astype(np.float32)))
            np.testing.assert_allclose(got - start[path], want, rtol=0,
                                       atol=2e-5 * np.abs(want).max() + rounding, err_msg=path)


class RawDepthwise(nnx.Module):
    """A depthwise convolution written with jax.lax directly, then an MLP."""

    def __init__(self, rngs):
        self.up = nnx.Linear(3, 8, rngs=rngs)
        self.kernel = nnx.Param(jnp.ones((3, 3, 1, 8)) / 9)
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, images, conv=jax.lax.conv_general_dilated):
        x = conv(self.up(images), self.kernel[...], (1, 1), "SAME",
                 dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=8)
        return self.out(nnx.relu(self.hidden(x.mean(axis=(1, 2)))))


def test_a_grouped_convolution_outside_nnx_conv_is_refused_under_tp_and_routed_one_trains():
    mesh = DeviceMeshManager().create_device_mesh("data=4,model=2")
    batch = {"images": np.ones((8, 5, 5, 3), np.float32), "labels": np.zeros((8,), np.int32)}

    def loss(conv):
        return lambda model, batch: optax.softmax_cross_entropy_with_integer_labels(
            model(batch["images"], conv), batch["labels"]).mean()

    with pytest.raises(UsageError,
                       match=r"grouped convolution outside nnx.Conv \(feature_group_count=8, kernel "
                             r"\(3, 3, 1, 8\)\); .*call shardax.grouped_conv in place of"):
        parallelize(RawDepthwise, optax.sgd(0.1), mesh, "tp", loss_fn=loss(jax.lax.conv_general_dilated),
                    example_batch=batch)
    parallel = parallelize(RawDepthwise, optax.sgd(0.1), mesh, "tp", loss_fn=loss(shardax.grouped_conv),
                           example_batch=batch)
    assert tuple(parallel.layout.leaves["hidden/kernel"].spec) == (None, "model")


def test_a_model_with_its_own_axis_names_needs_them_mapped():
    mesh = DeviceMeshManager().create_device_mesh("data=8")
    with pytest.raises(UsageError,
                       match=r"annotated with axis names \['fsdp', 'tp'\].*axis_names=\{'fsdp': 'data', "
                             r"'tp': 'model'\}"):
        parallelize(ZOO["mesh-annotated"], optax.sgd(0.1), mesh, "dp")
    with pytest.raises(UsageError, match="map the model's names onto one of data, model, replica"):
        parallelize(ZOO["mesh-annotated"], optax.sgd(0.1), mesh, "dp",
                    axis_names={"fsdp": "data", "tp": "tensor"})
    parallel = parallelize(ZOO["mesh-annotated"], optax.sgd(0.1), mesh, "fsdp",
                           axis_names="fsdp=data,tp=model")
    assert dict(parallel.mesh.shape) == {"fsdp": 8, "tp": 1}
    assert parallel.layout.leaves["blocks/0/w_in"].spec[0] == "fsdp"


def test_pipelines_refuse_a_model_without_a_stack_of_layers_when_laid_out():
    with pytest.raises(UsageError, match=r"strategy 'pp' cuts a stack of layers into stages over 'stage'"):
        parallelize(ZOO["llama"], optax.sgd(0.1), DeviceMeshManager().create_device_mesh("stage=2,data=4"),
                    "pp")


def test_a_context_axis_the_model_cannot_use_is_refused_by_the_trainer_before_fit():
    with pytest.raises(UsageError,
                       match=r"'context' mesh axis splits sequences for models that attend through "
                             r"shardax.blocks.Attention, and this model has none"):
        Trainer(ZOO["gemma"], optax.sgd(0.1), lm_loss, mesh="data=2,context=4", strategy="dp",
                example_batch=next(lm_batches(1)))


@pytest.mark.parametrize("rows, length, error", [
    (16, 15, r"a sequence of 14 tokens does not cut into 8 equal chunks \(context=4"),
    (5, 17, r"a global batch of 5 rows \(`batch_size=5`\) does not split over the batch axes \('data',\) of "
            r"mesh data=2,context=4 times `grad_accum=1` \(= 2\); use a multiple of 2, e.g. 4")])
def test_what_the_first_step_would_refuse_is_refused_by_fit_before_anything_is_written(tmp_path, rows, length,
                                                                                       error):
    """No example_batch: fit traces the step on the data's first batch before it opens the metrics
    file or makes the checkpoint directory."""
    tokens = np.zeros((rows, length), np.int32)
    trainer = Trainer(readme_blocks_model(), optax.sgd(0.1), lm_loss, mesh="data=2,context=4", strategy="dp")
    with pytest.raises(UsageError, match=error):
        trainer.fit(lambda step: {"tokens": tokens}, steps=2, metrics=str(tmp_path / "run/metrics.jsonl"),
                    checkpoint_dir=str(tmp_path / "run/ckpt"))
    assert not (tmp_path / "run").exists()


# The documentation's own Llama-style model, built from shardax.blocks (LayerStack, Attention), run as
# the docs show it: under the pipelines and a context axis it must train like plain NNX.
def readme_blocks_model():
    from test_readme import snippet

    code = snippet("Pipelines and long sequences: `LayerStack` and `Attention`").split("def loss_fn", 1)[0]
    namespace = {}
    exec(code.replace("shardax.simulate_cpu_devices(8)", ""), namespace)  # noqa: S102  (this process has its 8)
    return namespace["Llama"]


BLOCK_CASES = [("pp", "stage=2,data=4", "all-gather"), ("pp_tp", "stage=2,data=2,model=2", "all-gather"),
               ("pp_fsdp", "stage=2,data=4", "all-gather"), ("dp", "data=2,context=4", "all-gather"),
               ("fsdp_tp", "data=2,context=2,model=2", "ring")]


@pytest.mark.parametrize("strategy, mesh_shape, variant", BLOCK_CASES,
                         ids=[f"{s}-{m}-{v}" for s, m, v in BLOCK_CASES])
@pytest.mark.slow
def test_a_model_built_from_the_blocks_trains_like_plain_nnx_under_pipelines_and_context(strategy, mesh_shape,
                                                                                         variant):
    llama = readme_blocks_model()
    if "blocks" not in _REFERENCE:
        _REFERENCE["blocks"] = plain_nnx_run(llama, optax.adamw(1e-2), lm_loss, lm_batches(STEPS))
    expected, ref_model = _REFERENCE["blocks"]
    parallel = parallelize(llama, optax.adamw(1e-2), DeviceMeshManager().create_device_mesh(mesh_shape),
                           strategy, loss_fn=lm_loss, example_batch=next(lm_batches(1)))
    if "model" in mesh_shape:  # the projections split over model, read off the program; the norms stay whole
        split = {path for path, leaf in parallel.layout.leaves.items() if "model" in str(leaf.spec)}
        assert split == {f"layers/layers/{name}/kernel" for name in
                         ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")} | {
                             "embed/embedding", "lm_head/kernel"}, split
    if "stage" in mesh_shape:
        assert parallel.layout.leaves["layers/layers/q_proj/kernel"].spec[0] == "stage"
    state, step = parallel.init(seed=0), parallel.with_settings(context_attention=variant).train_step(lm_loss)
    losses = []
    for batch in lm_batches(STEPS):
        state, metrics = step(state, parallel.place_batch(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, [e["loss"] for e in expected], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                            jax.tree.leaves(jax.device_get(nnx.state(ref_model, nnx.Param)))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-4, jax.tree_util.keystr(path)
    assert jax.tree.map(lambda a: a.sharding, state) == parallel.state_shardings


def test_a_loop_of_layers_is_refused_under_a_pipeline_and_named():
    from shardax.blocks import LayerStack

    class Looped(nnx.Module):
        def __init__(self, rngs):
            self.layers = LayerStack(lambda rngs: nnx.Linear(8, 8, rngs=rngs), 4, rngs=rngs, scan=False)

        def __call__(self, x):
            return self.layers(x)

    with pytest.raises(UsageError,
                       match=r"LayerStack 'layers' runs its layers in a Python loop \(scan=False"):
        parallelize(Looped, optax.sgd(0.1), DeviceMeshManager().create_device_mesh("stage=2,data=4"), "pp")
