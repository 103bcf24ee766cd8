"""shardax: train Flax NNX models across many devices and many hosts.

The names below are imported on first use (``shardax.Trainer`` imports JAX, Flax and optax
then), so that ``import shardax.cli`` and ``shardax --help`` start without them. artifex's and
datarax's data-parallel API (``DataParallel``, ``spmd_train_step``, ...) is in ``shardax.compat``.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

# each public name and the module it lives in
_EXPORTS = {
    "LoRA": "shardax.adapters",
    "simulate_cpu_devices": "shardax.cpu_devices",
    "ClusterSpec": "shardax.distributed",
    "detect_cluster": "shardax.distributed",
    "init_distributed": "shardax.distributed",
    "generate": "shardax.generation",
    "ColumnParallelLinear": "shardax.layers",
    "RowParallelLinear": "shardax.layers",
    "ShardedEmbed": "shardax.layers",
    "ShardedLinear": "shardax.layers",
    "DeviceMeshManager": "shardax.mesh",
    "describe_mesh": "shardax.mesh",
    "get_mesh_info": "shardax.mesh",
    "parse_mesh_shape": "shardax.mesh",
    "ParallelModel": "shardax.model_parallel",
    "Part": "shardax.parts",
    "parallelize": "shardax.model_parallel",
    "reshard": "shardax.model_parallel",
    "dpo_loss": "shardax.models.preference",
    "dpo_step": "shardax.models.preference",
    "TransformerConfig": "shardax.models.transformer_config",
    "TransformerLM": "shardax.models.transformer",
    "for_compute": "shardax.sharding.compute",
    "grouped_conv": "shardax.sharding.grouped_conv",
    "ShardingReport": "shardax.sharding.report",
    "report": "shardax.sharding.report",
    "LOGICAL_AXES": "shardax.sharding.rules",
    "STRATEGIES": "shardax.sharding.strategies",
    "Strategy": "shardax.sharding.strategies",
    "get_strategy": "shardax.sharding.strategies",
    "ema_params": "shardax.step.ema",
    "StepSettings": "shardax.step.settings",
    "TrainState": "shardax.step.state",
    "FitResult": "shardax.trainer.run",
    "FitSettings": "shardax.trainer.settings",
    "TrainerSettings": "shardax.trainer.settings",
    "Trainer": "shardax.trainer.trainer",
}
__all__ = sorted(_EXPORTS)
# artifex's and datarax's names, in shardax.compat: asked for here, the error says where they are
_COMPAT = frozenset((
    "DataParallel", "create_data_parallel_sharding", "data_parallel_rules", "data_parallel_train_step",
    "model_state_shardings", "place_batch_on_shards", "place_model_state_on_shards",
    "place_nnx_state_on_shards", "reduce_gradient_tree", "reduce_gradients_across_devices", "spmd_train_step",
))
__version__ = "0.2.0"


# subpackages reached as attributes: ``shardax.hf.load(...)`` after ``import shardax``
_SUBPACKAGES = ("compat", "hf")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"shardax.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        if name in _COMPAT:
            raise AttributeError(f"shardax.{name} is artifex's and datarax's data-parallel API, kept in "
                                 f"shardax.compat: from shardax.compat import {name}")
        raise AttributeError(f"module 'shardax' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if _TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from shardax.adapters import LoRA as LoRA
    from shardax.cpu_devices import simulate_cpu_devices as simulate_cpu_devices
    from shardax.distributed import (
        ClusterSpec as ClusterSpec,
        detect_cluster as detect_cluster,
        init_distributed as init_distributed,
    )
    from shardax.generation import generate as generate
    from shardax.layers import (
        ColumnParallelLinear as ColumnParallelLinear,
        RowParallelLinear as RowParallelLinear,
        ShardedEmbed as ShardedEmbed,
        ShardedLinear as ShardedLinear,
    )
    from shardax.mesh import (
        DeviceMeshManager as DeviceMeshManager,
        describe_mesh as describe_mesh,
        get_mesh_info as get_mesh_info,
        parse_mesh_shape as parse_mesh_shape,
    )
    from shardax.model_parallel import (
        ParallelModel as ParallelModel,
        parallelize as parallelize,
        reshard as reshard,
    )
    from shardax.models.preference import dpo_loss as dpo_loss, dpo_step as dpo_step
    from shardax.models.transformer import TransformerLM as TransformerLM
    from shardax.models.transformer_config import TransformerConfig as TransformerConfig
    from shardax.parts import Part as Part
    from shardax.sharding.compute import for_compute as for_compute
    from shardax.sharding.grouped_conv import grouped_conv as grouped_conv
    from shardax.sharding.report import ShardingReport as ShardingReport, report as report
    from shardax.sharding.rules import LOGICAL_AXES as LOGICAL_AXES
    from shardax.sharding.strategies import (
        STRATEGIES as STRATEGIES,
        Strategy as Strategy,
        get_strategy as get_strategy,
    )
    from shardax.step.ema import ema_params as ema_params
    from shardax.step.settings import StepSettings as StepSettings
    from shardax.step.state import TrainState as TrainState
    from shardax.trainer.run import FitResult as FitResult
    from shardax.trainer.settings import FitSettings as FitSettings, TrainerSettings as TrainerSettings
    from shardax.trainer.trainer import Trainer as Trainer
