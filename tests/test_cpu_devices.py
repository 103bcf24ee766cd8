"""Simulated CPU devices run programs whose collectives run side by side without stalling.

The smallest program that stalled XLA:CPU's default pool (``max(cores, devices)`` threads; 3
aborts in 3 runs on 8 devices, and on 2 and 4, at 300 steps): a loop whose body all-gathers a
sharded weight each trip, beside an all-reduce of a quantity that needs only the batch, the two
fed by chains of equal cost so that devices reach them in either order. It is the shape of LoRA
under fsdp (the forward loop's gathers of frozen weights beside the loss's token count), which
aborted after step 1 of the fine-tuning guide's command.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import pytest

import shardax
from shardax.cpu_devices import POOL_VARIABLE, collective_threads, describe_devices, starved_pool_warning

SIDE_BY_SIDE = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    def stalling_program(devices):
        mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
        weights = jax.device_put(jnp.full((2, 64, 64), 0.01), NamedSharding(mesh, P(None, None, "data")))
        x = jax.device_put(jnp.ones((8 * devices, 64)), NamedSharding(mesh, P("data")))
        y = jax.device_put(jnp.full((8 * devices, 64), 2.0), NamedSharding(mesh, P("data")))

        def loss(weights, x, y):
            def layer(h, w):  # the loop gathers each trip's weight whole
                return jnp.tanh(h @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))), None
            h, _ = jax.lax.scan(layer, jnp.tanh(x @ x.T @ x), weights)
            return h.sum() / jnp.tanh(y @ y.T @ y).sum()  # an all-reduce that needs no loop

        return jax.jit(jax.grad(loss)), (weights, x, y)
""")
STEPS = 300


def stalling_program(devices):
    namespace = {}
    exec(SIDE_BY_SIDE, namespace)  # noqa: S102  (the same source the subprocesses run)
    return namespace["stalling_program"](devices)


def test_the_smallest_stalling_program_holds_a_loop_of_gathers_beside_an_all_reduce():
    """What the tests below run is the pattern that stalled: a while loop with an all-gather
    inside, and an all-reduce outside it that does not wait for the loop."""
    step, args = stalling_program(8)
    text = step.lower(*args).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    assert " while(" in entry and " all-reduce(" in entry
    assert " all-gather(" in text[:text.index("\nENTRY")]  # inside the loop's body


def test_eight_simulated_devices_run_it_without_stalling():
    """The test session simulates its 8 devices with ``shardax.simulate_cpu_devices``: a pool of
    2 threads per device, which the program cannot exhaust."""
    assert int(os.environ[POOL_VARIABLE]) >= collective_threads(8) == max(os.cpu_count(), 16)
    step, args = stalling_program(8)
    for _ in range(STEPS):
        grads = step(*args)
    assert float(abs(grads).sum()) > 0


@pytest.mark.parametrize("devices", [2, 4])
def test_fewer_simulated_devices_run_it_without_stalling(devices):
    """In a fresh process (the device count is fixed when JAX starts), with no pool size set
    beforehand, and XLA's rendezvous timeout cut to 10 s so that a stall fails fast."""
    code = SIDE_BY_SIDE + textwrap.dedent(f"""
        import os, shardax
        shardax.simulate_cpu_devices({devices})
        assert os.environ["PJRT_NPROC"] == str(max(os.cpu_count(), {2 * devices}))
        step, args = stalling_program({devices})
        for _ in range({STEPS}):
            grads = step(*args)
        print("finished", len(jax.devices()), float(abs(grads).sum()) > 0)
    """)
    env = {name: value for name, value in os.environ.items() if name not in (POOL_VARIABLE, "NPROC")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=10")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.split() == ["finished", str(devices), "True"]


def test_a_pool_too_small_for_its_devices_is_said_once_in_a_line(monkeypatch):
    """Nothing silent: a process that simulated its devices itself (``jax_num_cpu_devices``)
    with XLA's default pool hears, when it lays a model out, what to call instead."""
    monkeypatch.setenv(POOL_VARIABLE, "8")
    line = starved_pool_warning(8)
    assert line.startswith("8 simulated CPU devices share 8 threads, and XLA:CPU can stall")
    assert "call shardax.simulate_cpu_devices(8) before JAX starts, or set PJRT_NPROC=16" in line
    assert starved_pool_warning(1) is None and starved_pool_warning(4) is None  # 8 >= 2 x 4
    import optax
    from flax import nnx

    with pytest.warns(RuntimeWarning, match="8 simulated CPU devices share 8 threads"):
        shardax.parallelize(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.sgd(0.1), "data=8", "fsdp")
    monkeypatch.setenv(POOL_VARIABLE, "16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallel = shardax.parallelize(lambda rngs: nnx.Linear(4, 4, rngs=rngs), optax.sgd(0.1), "data=8",
                                       "fsdp")
    assert describe_devices(parallel.layout.mesh) == "8 cpu devices, 8 simulated here on 16 threads"
    with pytest.raises(ValueError, match=r"simulate_cpu_devices\(0\): the count must be at least 1"):
        shardax.simulate_cpu_devices(0)
    shardax.simulate_cpu_devices(8)  # the count JAX started with: nothing to change
    assert jax.device_count() == 8
