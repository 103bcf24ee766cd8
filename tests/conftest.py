"""Every test sees 8 simulated CPU devices; JAX is configured before any backend starts."""

import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from cli_helpers import QUICK_COMPILE  # noqa: E402  (XLA's flags for the tests' compiles: see there)

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILE}".strip()
import jax  # noqa: E402

from shardax import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # with a thread pool their collectives cannot starve (shardax.cpu_devices)

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



@pytest.fixture
def exported_for_cuda(monkeypatch):
    """``export(step, *args)``: the StableHLO text of a jitted step exported for CUDA from this
    CPU-only machine, with shardax's attention choosing as on a GPU. JAX's cuDNN lowering checks
    for cuDNN and the GPU's compute capability while tracing; with no GPU here the fixture tells
    its two probes cuDNN 9.10 on a Hopper GPU is present. What it shows: the program JAX would
    hand a GPU. What it cannot show: that the program runs there."""
    from jax import export

    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fused, "check_cudnn_version") or not hasattr(fused, "check_compute_capability"):
        pytest.skip("this JAX's cuDNN lowering has other probes")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    from shardax import blocks
    from shardax.models import transformer

    on_this_machine, kernel_here = transformer.attention_implementation, blocks.attention_kernel
    monkeypatch.setattr(transformer, "attention_implementation",
                        lambda config, platform=None: on_this_machine(config, "gpu"))
    monkeypatch.setattr(blocks, "attention_kernel",
                        lambda implementation, dtype, head_dim, platform=None, **how:
                            kernel_here(implementation, dtype, head_dim, "gpu", **how))
    kernels = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")

    def run(step, *args):
        checks = [export.DisabledSafetyCheck.custom_call(kernel) for kernel in kernels]
        return export.export(step, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()

    return run


def cudnn_calls(text):
    """(kernel, mask type, operand types) of each cuDNN attention call in exported StableHLO."""
    import re

    return [(name, mask, operands.split(", ")) for name, mask, operands in re.findall(
        r"custom_call @(__cudnn\$\w+)\(.*?mask_type\\22: \\22(\w+)\\22.*?: \(([^)]*)\)", text)]


def pytest_collection_modifyitems(config, items):
    """The fast tier (``pytest -m "not slow"``): a parametrized test's first case stands for the
    behaviour, and its other cases (more strategies, models, meshes) are ``slow``, unless the test
    is marked ``every_case`` (the bad-input battery: each case is its own behaviour); so are the
    tests marked ``slow`` by hand. CI runs every test.

    Then the longest work first, so that neither worker is left with a long test at the end:
    each module (or xdist group) keeps its tests together and in order, and the modules go by
    the seconds their tests took in a measured run (``durations.json``; a test it does not know
    counts a second). The order changes no test: each sets up what it needs."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("every_case") is not None:
            continue
        if callspec is not None and any(index != 0 for index in callspec.indices.values()):
            item.add_marker(pytest.mark.slow)
    items[:] = longest_first(items)


DURATIONS = Path(__file__).with_name("durations.json")


def longest_first(items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def unit(item):
        group = item.get_closest_marker("xdist_group")
        return group.args[0] if group is not None and group.args else item.nodeid.split("::")[0]

    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit(item), []).append(item)
    cost = {name: sum(seconds.get(item.nodeid.split("@")[0], 1.0) for item in members)
            for name, members in units.items()}
    return [item for name in sorted(units, key=lambda name: -cost[name]) for item in units[name]]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Each of the Llama family's architectures (``hf_checkpoints.ARCHITECTURES``) as
    ``transformers`` saves it (random weights, norms and biases moved off their initial values),
    with its logits on ``TOKENS[:, :-1]``: for test_hf.py and test_hf_fine_tuning.py."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_checkpoints import ARCHITECTURES, TOKENS, make_checkpoints

    return make_checkpoints(ARCHITECTURES, tmp_path_factory, TOKENS)
