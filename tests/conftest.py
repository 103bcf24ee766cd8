"""Every test sees 8 simulated CPU devices; JAX is configured before any backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from cli_helpers import COMPILATION_CACHE, small_corpus  # noqa: E402,F401  (a fixture for the CLI tests)

# Tests and the `shardax` processes they start share one compilation cache: a program that
# several tests compile (the same model, strategy and mesh) is compiled once per session.
jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.device_count()}"


def make_mesh(shape, names, axis_types=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_types,) * len(names))


@pytest.fixture
def mesh8():
    return make_mesh((8,), ("data",))


@pytest.fixture(params=[(2, 4), (4, 2)], ids=["2x4", "4x2"])
def mesh2d(request):
    return make_mesh(request.param, ("data", "model"))

