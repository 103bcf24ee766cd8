"""The collectives audit reads what real programs compiled on 8 CPU devices actually communicate."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.analysis.collectives import (
    REDUCE_SCATTER_PATTERN,
    Collective,
    find_collectives,
    summarize,
)

F32 = 4


def compiled_text(function, *args) -> str:
    return jax.jit(function).lower(*args).compile().as_text()


def per_device(mesh, function, out_specs, **kwargs):
    """``function`` run under shard_map with every input split over "data"."""
    return jax.shard_map(function, mesh=mesh, in_specs=P("data"), out_specs=out_specs, **kwargs)


def only(collectives: list[Collective]) -> Collective:
    assert len(collectives) == 1, collectives
    return collectives[0]


def test_psum_is_one_all_reduce_of_the_per_device_value(mesh8):
    psum = per_device(mesh8, lambda a: lax.psum(a, "data"), out_specs=P())
    op = only(find_collectives(compiled_text(psum, jnp.ones((8 * 16, 4), jnp.float32))))
    assert op.kind == "all-reduce"
    assert op.shapes == ("f32[16,4]",)
    assert op.bytes == op.shard_bytes == 16 * 4 * F32 == 256
    assert "0,1,2,3,4,5,6,7" in op.replica_groups


def test_psum_scatter_compiles_to_a_true_reduce_scatter(mesh8):
    def scatter(a):
        return lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True)

    op = only(find_collectives(compiled_text(per_device(mesh8, scatter, P("data")), jnp.ones((8 * 64, 4)))))
    assert op.kind == "reduce-scatter"
    assert op.shapes == ("f32[8,4]",)  # the f32[64,4] per-device value, one eighth kept
    assert op.bytes == op.shard_bytes == 8 * 4 * F32


def test_tiled_all_gather_result_is_the_whole_array(mesh8):
    gather = per_device(mesh8, lambda a: lax.all_gather(a, "data", tiled=True), P(), check_vma=False)
    op = only(find_collectives(compiled_text(gather, jnp.ones((8 * 16, 4)))))
    assert op.kind == "all-gather"
    assert op.shapes == ("f32[128,4]",)
    assert op.bytes == op.shard_bytes == 128 * 4 * F32


def test_ppermute_and_tuple_all_to_all(mesh8):
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def shuffle(a):
        return lax.all_to_all(lax.ppermute(a, "data", ring), "data", 0, 0, tiled=True)

    text = compiled_text(per_device(mesh8, shuffle, P("data")), jnp.ones((128, 4)))
    permute, all_to_all = find_collectives(text)
    assert permute.kind == "collective-permute" and permute.bytes == 16 * 4 * F32
    assert permute.replica_groups.startswith("{{0,1},{1,2}")  # its source_target_pairs
    assert all_to_all.kind == "all-to-all"
    assert all_to_all.shapes == ("f32[2,4]",) * 8  # on CPU: a tuple of eight pieces, /*index=5*/ and all
    assert all_to_all.bytes == 16 * 4 * F32


def test_psum_over_one_axis_of_a_2d_mesh(mesh2d):
    psum = jax.shard_map(
        lambda a: lax.psum(a, "model"), mesh=mesh2d, in_specs=P("data", "model"), out_specs=P("data")
    )
    rows, cols = 8 * mesh2d.shape["data"], 8 * mesh2d.shape["model"]
    op = only(find_collectives(compiled_text(psum, jnp.ones((rows, cols)))))
    assert op.kind == "all-reduce" and op.bytes == 8 * 8 * F32
    assert op.replica_groups


def tanh_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def gradient_text(mesh, out_spec) -> str:
    """Gradient of a replicated f32[64,32] weight over a batch f32[32,64] split over "data"."""
    grad = jax.jit(
        jax.grad(tanh_loss),
        in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
        out_shardings=NamedSharding(mesh, out_spec),
    )
    return grad.lower(jnp.ones((64, 32)), jnp.ones((32, 64))).compile().as_text()


def test_sharded_gradient_on_cpu_is_all_reduce_then_dynamic_slice(mesh8):
    text = gradient_text(mesh8, P("data", None))
    assert " all-reduce(" in text and " dynamic-slice(" in text and " reduce-scatter(" not in text
    op = only(find_collectives(text))
    assert op.kind == REDUCE_SCATTER_PATTERN
    assert op.bytes == 64 * 32 * F32
    assert op.shard_bytes == 64 * 32 * F32 // 8


def test_replicated_gradient_is_a_plain_all_reduce(mesh8):
    op = only(find_collectives(gradient_text(mesh8, P())))
    assert op.kind == "all-reduce"
    assert op.bytes == op.shard_bytes == 64 * 32 * F32 == 8192


def two_layer_loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w1"] + params["b"]) @ params["w2"])


@pytest.mark.parametrize("bias_sharded", [True, False], ids=["all-sliced", "bias-replicated"])
def test_combined_tuple_all_reduce(mesh8, bias_sharded):
    """XLA combines the three gradients into one tuple all-reduce; sizes add up. Elements the
    program only slices are a reduce-scatter; one it keeps whole is listed as an all-reduce."""
    data, replicated = NamedSharding(mesh8, P("data")), NamedSharding(mesh8, P())
    outputs = {"w1": data, "b": data if bias_sharded else replicated, "w2": data}
    grad = jax.jit(jax.grad(two_layer_loss), in_shardings=(replicated, data), out_shardings=outputs)
    params = {"w1": jnp.ones((64, 32)), "b": jnp.ones((32,)), "w2": jnp.ones((32, 16))}
    found = find_collectives(grad.lower(params, jnp.ones((32, 64))).compile().as_text())
    if bias_sharded:
        op = only(found)
        assert len(op.shapes) == 3
        assert op.bytes == (64 * 32 + 32 + 32 * 16) * F32
        assert op.kind == REDUCE_SCATTER_PATTERN and op.shard_bytes == op.bytes // 8
    else:  # the bias gradient leaves unsliced: that element alone is a full all-reduce
        scattered, whole = sorted(found, key=lambda op: op.kind != REDUCE_SCATTER_PATTERN)
        assert scattered.name == whole.name  # one instruction, two roles
        assert scattered.kind == REDUCE_SCATTER_PATTERN and len(scattered.shapes) == 2  # the two weights
        assert scattered.bytes == (64 * 32 + 32 * 16) * F32 and scattered.shard_bytes == scattered.bytes // 8
        assert (whole.kind == "all-reduce" and whole.shapes == ("f32[32]",)
                and whole.bytes == whole.shard_bytes == 32 * F32)


def test_summarize_totals_per_kind(mesh8):
    def communicate(a, b):
        summed = lax.psum(a, "data")  # f32[16,4]: 256 bytes
        gathered = lax.all_gather(b, "data", tiled=True)  # s8[64,4]: 256 bytes
        scattered = lax.psum_scatter(a * 2, "data", scatter_dimension=0, tiled=True)  # f32[2,4]: 32 bytes
        return summed, gathered, scattered

    program = per_device(mesh8, communicate, (P(), P(), P("data")), check_vma=False)
    found = find_collectives(compiled_text(program, jnp.ones((128, 4)), jnp.ones((64, 4), jnp.int8)))
    assert summarize(found) == {
        "all-reduce": {"count": 1, "bytes": 256},
        "all-gather": {"count": 1, "bytes": 256},
        "reduce-scatter": {"count": 1, "bytes": 32},
    }
    assert summarize([]) == {}


# GPU programs run collectives asynchronously; this machine has no GPU, so the text is written out.
GPU_ASYNC_SAMPLE = """\
HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %stray = f32[8]{0} all-reduce(f32[8]{0} %param_0), replica_groups={}, to_apply=%add
}

%async_computation (param_0.1: f32[64,4]) -> f32[8,4] {
  %param_0.1 = f32[64,4]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8,4]{1,0} reduce-scatter(f32[64,4]{1,0} %param_0.1), channel_id=4, \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[16,128], p1: bf16[1024], p2: f32[8], p3: f32[64,4]) -> f32[8] {
  %p0 = f32[16,128]{1,0} parameter(0)
  %p1 = bf16[1024]{0} parameter(1)
  %p2 = f32[8]{0} parameter(2)
  %p3 = f32[64,4]{1,0} parameter(3)
  %all-gather-start = (f32[16,128]{1,0}, f32[128,128]{1,0}) all-gather-start(f32[16,128]{1,0} %p0), \
channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[128,128]{1,0} all-gather-done((f32[16,128]{1,0}, f32[128,128]{1,0}) \
%all-gather-start)
  %all-reduce-start = (bf16[1024]{0}, f32[8]{0}) all-reduce-start(bf16[1024]{0} %p1, f32[8]{0} %p2), \
channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add, backend_config={"is_sync":false}
  %all-reduce-done = (bf16[1024]{0}, f32[8]{0}) all-reduce-done((bf16[1024]{0}, f32[8]{0}) %all-reduce-start)
  %collective-permute-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %p2), \
channel_id=3, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) \
%collective-permute-start)
  %reduce-scatter-start = ((f32[64,4]{1,0}), f32[8,4]{1,0}) async-start(f32[64,4]{1,0} %p3), \
calls=%async_computation
  %reduce-scatter-done = f32[8,4]{1,0} async-done(((f32[64,4]{1,0}), f32[8,4]{1,0}) %reduce-scatter-start)
  ROOT %negate_fusion = f32[8]{0} fusion(f32[8]{0} %collective-permute-done), kind=kLoop, \
calls=%fused_computation
}
"""


def test_gpu_async_pairs_count_once():
    found = find_collectives(GPU_ASYNC_SAMPLE)
    assert len(found) == 4  # each pair once; the all-reduce inside a fused computation is not counted
    by_kind = {op.kind: op for op in found}
    assert set(by_kind) == {"all-gather", "all-reduce", "collective-permute", "reduce-scatter"}
    assert by_kind["all-gather"].shapes == ("f32[128,128]",)  # the -done result, not (operand, result)
    assert by_kind["all-gather"].bytes == 128 * 128 * F32
    assert by_kind["all-gather"].replica_groups == "[1,8]<=[8]"
    assert by_kind["all-reduce"].name == "all-reduce-start"
    assert by_kind["all-reduce"].bytes == 1024 * 2 + 8 * F32
    assert by_kind["collective-permute"].bytes == 8 * F32
    assert by_kind["reduce-scatter"].bytes == 8 * 4 * F32
    assert summarize(by_kind.values())["all-reduce"] == {"count": 1, "bytes": 2080}


# XLA:TPU's windowed einsum (a matmul whose result is reduce-scattered, as a loop of partial
# matmuls and collective-permutes) is unrolled twice: its counter starts at 0 and steps by 2
# below 4, so the body runs twice (reading `counter < 4` alone says 4). No known_trip_count on TPU.
# In a step whose blocks run in a Python loop XLA:TPU steps a copy of the counter (``copied``).
def windowed_loop(start: int, step: int, bound: int, copied: bool = False) -> str:
    counter = "%counter.copy" if copied else "%counter"
    return f"""\
HloModule jit_step, is_scheduled=true, num_partitions=8

%body (param: (f32[8], u32[])) -> (f32[8], u32[]) {{
  %param = (f32[8]{{0}}, u32[]) parameter(0)
  %acc = f32[8]{{0}} get-tuple-element(%param), index=0
  %counter = u32[] get-tuple-element(%param), index=1
  %collective-permute-start = (f32[8]{{0}}, f32[8]{{0}}, u32[], u32[]) collective-permute-start(%acc), \
channel_id=1, source_target_pairs={{{{0,1}},{{1,0}}}}
  %collective-permute-done = f32[8]{{0}} collective-permute-done(%collective-permute-start)
  %counter.copy = u32[] copy(%counter)
  %step = u32[] constant({step})
  %next = u32[] add({counter}, %step)
  ROOT %tuple = (f32[8]{{0}}, u32[]) tuple(%collective-permute-done, %next)
}}

%condition (param.1: (f32[8], u32[])) -> pred[] {{
  %param.1 = (f32[8]{{0}}, u32[]) parameter(0)
  %bound = u32[] constant({bound})
  %counter.1 = u32[] get-tuple-element(%param.1), index=1
  ROOT %compare = pred[] compare(%counter.1, %bound), direction=LT
}}

ENTRY %main (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  %start = u32[] constant({start})
  %first = u32[] copy(%start)
  %init = (f32[8]{{0}}, u32[]) tuple(%p0, %first)
  %loop = (f32[8]{{0}}, u32[]) while(%init), condition=%condition, body=%body
  ROOT %out = f32[8]{{0}} get-tuple-element(%loop), index=0
}}
"""


@pytest.mark.parametrize("start, step, bound, trips, copied", [
    (0, 1, 4, 4, False), (0, 2, 4, 2, False), (1, 2, 8, 4, False), (0, 3, 8, 3, False), (0, 2, 4, 2, True)])
def test_a_loop_runs_its_body_as_its_counter_steps(start, step, bound, trips, copied):
    [permute] = find_collectives(windowed_loop(start, step, bound, copied))
    assert permute.kind == "collective-permute" and permute.bytes == 8 * F32
    assert permute.executions == trips
