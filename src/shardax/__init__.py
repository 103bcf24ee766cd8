"""shardax: train Flax NNX models across many devices and many hosts."""

from shardax.data_parallel import DataParallel as DataParallel
from shardax.data_parallel import create_data_parallel_sharding as create_data_parallel_sharding
from shardax.data_parallel import data_parallel_rules as data_parallel_rules
from shardax.data_parallel import data_parallel_train_step as data_parallel_train_step
from shardax.data_parallel import model_state_shardings as model_state_shardings
from shardax.data_parallel import place_batch_on_shards as place_batch_on_shards
from shardax.data_parallel import place_model_state_on_shards as place_model_state_on_shards
from shardax.data_parallel import place_nnx_state_on_shards as place_nnx_state_on_shards
from shardax.data_parallel import reduce_gradient_tree as reduce_gradient_tree
from shardax.data_parallel import reduce_gradients_across_devices as reduce_gradients_across_devices
from shardax.data_parallel import spmd_train_step as spmd_train_step
from shardax.mesh import DeviceMeshManager as DeviceMeshManager
from shardax.mesh import describe_mesh as describe_mesh
from shardax.mesh import get_mesh_info as get_mesh_info
from shardax.mesh import parse_mesh_shape as parse_mesh_shape

__version__ = "0.1.0"
