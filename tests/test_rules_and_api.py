import jax
import numpy as np
import pytest
from flax import nnx

import shardax
from shardax.compat import data_parallel_rules


def test_data_parallel_rules_replicate_annotated_parameters(mesh8):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with jax.set_mesh(mesh8), nnx.logical_axis_rules(data_parallel_rules()):
        layer = nnx.Linear(16, 32, rngs=nnx.Rngs(0), kernel_init=init)
        specs = nnx.get_partition_spec(nnx.state(layer))
    kernel = layer.kernel[...]
    assert kernel.sharding.is_fully_replicated and len(kernel.addressable_shards) == 8
    assert tuple(specs["kernel"].get_value()) == (None, None)
    reference = nnx.initializers.lecun_normal()(nnx.Rngs(0).params(), (16, 32))
    for shard in kernel.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(reference), rtol=1e-6)


def test_data_parallel_rules_split_the_batch(mesh8):
    rules = dict(data_parallel_rules("data"))
    assert rules["batch"] == "data"
    assert {name: axis for name, axis in rules.items() if name != "batch"} == {
        name: None for name in ("length", "embed", "mlp", "heads", "kv", "vocab", "layers", "expert")
    }
    assert dict(data_parallel_rules("replica"))["batch"] == "replica"


EXPECTED_API = {
    "DeviceMeshManager", "describe_mesh", "get_mesh_info", "parse_mesh_shape",
    "ColumnParallelLinear", "RowParallelLinear", "ShardedEmbed", "ShardedLinear", "ParallelModel", "Part",
    "parallelize", "reshard", "for_compute", "grouped_conv", "ShardingReport", "report", "LOGICAL_AXES",
    "STRATEGIES", "Strategy", "get_strategy", "TrainState", "ema_params", "simulate_cpu_devices",
    "ClusterSpec", "detect_cluster", "init_distributed", "Trainer", "FitResult", "LoRA", "generate",
    "FitSettings", "TrainerSettings", "StepSettings", "TransformerConfig", "TransformerLM", "dpo_loss",
    "dpo_step",
}
COMPAT_API = {
    "DataParallel", "create_data_parallel_sharding", "data_parallel_rules", "data_parallel_train_step",
    "model_state_shardings", "place_batch_on_shards", "place_model_state_on_shards",
    "place_nnx_state_on_shards", "reduce_gradient_tree", "reduce_gradients_across_devices", "spmd_train_step",
}


def test_public_api_is_explicit():
    import types

    import shardax.compat

    public = {name for name in dir(shardax) if not name.startswith("_")
              and not isinstance(getattr(shardax, name), types.ModuleType)}  # submodules appear once imported
    assert public == EXPECTED_API, sorted(public ^ EXPECTED_API)
    assert set(shardax.compat.__all__) == COMPAT_API
    assert shardax.hf.load is not None and shardax.compat.DataParallel is not None
    methods = {"create_data_parallel_sharding", "shard_batch", "shard_model_state", "all_reduce_gradients",
               "replicate_params"}
    for name in methods:
        assert callable(getattr(shardax.compat.DataParallel, name))
        assert isinstance(shardax.compat.DataParallel.__dict__[name + "_static"], staticmethod)


def test_the_compat_names_asked_of_the_top_level_say_where_they_are():
    with pytest.raises(AttributeError, match=r"from shardax.compat import spmd_train_step"):
        shardax.spmd_train_step


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["generate", "--help"],
                                  ["train", "--strategy", "nope"]])
def test_the_command_line_answers_help_and_bad_flags_without_importing_jax(argv):
    """``shardax --help``, a subcommand's help and a bad flag are answered before JAX, Flax,
    optax or orbax are imported (they cost seconds; a subcommand imports them when it runs)."""
    import subprocess
    import sys

    probe = ("import runpy, sys\n"
             f"sys.argv = ['shardax', *{argv!r}]\n"
             "try:\n    runpy.run_module('shardax.cli', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('heavy:', sorted({m.split('.')[0] for m in sys.modules} & "
             "{'jax', 'flax', 'optax', 'orbax'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "heavy: []", out.stdout[-500:] + out.stderr[-500:]
    if argv == ["train", "--help"]:  # its flags in groups, in this order
        titles = [line[:-1] for line in out.stdout.splitlines()
                  if line.endswith(":") and not line.startswith(" ")]
        assert titles[-6:] == ["model", "data", "parallelism", "run", "checkpoints", "logging"], titles


def test_one_vocabulary_of_option_names():
    """The names the command line, the configurations and the library accept come from
    ``shardax.vocabulary`` (JAX-free), and they are the names the library implements."""
    import subprocess
    import sys

    from shardax import vocabulary
    from shardax.analysis.fit import POLICIES
    from shardax.blocks import IMPLEMENTATIONS, REMAT_POLICIES
    from shardax.lm.config import CHOICES
    from shardax.runtime.context import VARIANTS
    from shardax.sharding.strategies import STRATEGIES
    from shardax.step.settings import NONFINITE

    assert sorted(vocabulary.STRATEGY_NAMES) == sorted(STRATEGIES)
    assert vocabulary.REMAT_POLICIES == tuple(REMAT_POLICIES) and sorted(POLICIES) == sorted(REMAT_POLICIES)
    assert IMPLEMENTATIONS is vocabulary.ATTENTION_KERNELS and VARIANTS is vocabulary.CONTEXT_ATTENTIONS
    assert NONFINITE is vocabulary.NONFINITE_MODES and CHOICES["remat"] is vocabulary.REMAT_POLICIES
    probe = "import sys, shardax.vocabulary; print(sorted({'jax', 'numpy'} & set(sys.modules)))"
    assert (subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
            == "[]")


def test_a_parallel_model_carries_its_step_settings_resolved_once(mesh8):
    import optax
    from flax import nnx

    from shardax.errors import UsageError

    parallel = shardax.parallelize(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.sgd(0.1), mesh8, "fsdp",
                                   grad_accum=2)
    assert (parallel.settings.grad_accum, parallel.settings.strategy.name) == (2, "fsdp")
    wider = parallel.with_settings(grad_accum=4)
    assert wider.settings.grad_accum == 4 and parallel.settings.grad_accum == 2
    assert wider.layout is parallel.layout and wider.state_shardings is parallel.state_shardings
    with pytest.raises(UsageError, match=r"^`grad_accum=0` must be a whole number of at least 1"):
        parallel.with_settings(grad_accum=0)
    with pytest.raises(UsageError, match=r"^mesh cannot be changed on a laid-out model.*parallelize again"):
        parallel.with_settings(mesh=mesh8)
    with pytest.raises(UsageError, match=r"^StepSettings.resolve takes a strategy's name or a Strategy, "
                                         r"and was given StepSettings"):
        shardax.StepSettings.resolve(parallel.settings)
