"""Every test sees 8 simulated CPU devices; JAX is configured before any backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

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


from cli_helpers import small_corpus  # noqa: E402,F401  (a fixture for the CLI tests)
