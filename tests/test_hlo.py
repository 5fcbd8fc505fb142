"""zerojax.testing.hlo on small real programs (8 CPU devices) and on the ZeRO step."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax.models.llama import LlamaConfig, LlamaLM
from zerojax.models.mlp_lm import MlpLM
from zerojax.release import make_release_step
from zerojax.testing import hlo


def scan_of_scans(x):
  """psum_scatter inside a scan of 5 inside a scan of 3: 15 runs a step."""
  zero = jnp.zeros((x.shape[0] // 8, x.shape[1]), x.dtype)

  def outer(carry, j):
    def inner(carry, i):  # Depends on j and i: XLA can hoist neither loop.
      return carry + jax.lax.psum_scatter(x * (i + j), "i", tiled=True), None
    return carry + jax.lax.scan(inner, zero, jnp.arange(5.0))[0], None

  return jax.lax.scan(outer, zero, jnp.arange(3.0))[0]


def test_loop_trips_in_every_view():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  step = jax.jit(jax.shard_map(scan_of_scans, mesh=mesh, in_specs=P(), out_specs=P("i"),
                               check_vma=False))
  lowered = step.lower(jax.ShapeDtypeStruct((64, 16), jnp.float32))
  compiled, partitioned = hlo.compile_partitioned(lowered)
  # Before optimization and right after partitioning there is no known_trip_count:
  # the trips come from each loop's `i < n` condition.
  assert "known_trip_count" not in partitioned
  for text in (lowered.as_text(dialect="hlo"), partitioned, compiled.as_text()):
    [c] = hlo.collectives(text)
    assert (c.op, c.group_size, c.loops, c.trips, c.in_loop) == (
        "reduce-scatter", 8, 2, 15, True)
    assert c.operands == (("f32", (64, 16)),) and c.results == (("f32", (8, 16)),)
    assert c.operand_bytes == c.payload_bytes == 64 * 16 * 4 and c.result_bytes == 512
  assert hlo.summarize(hlo.collectives(partitioned)) == {
      "reduce-scatter f32": {"count": 15, "payload_bytes": 15 * 64 * 16 * 4}}


def test_gspmd_all_gather_in_mesh_form():
  """GSPMD prints replica_groups=mesh['axis_0'=8,...] {'axis_0'}: 8 devices a group."""
  mesh = zerojax.make_mesh(1, 8)
  gather = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh, P("fsdp")),
                   out_shardings=NamedSharding(mesh, P()))
  compiled, partitioned = hlo.compile_partitioned(
      gather.lower(jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)))
  assert "replica_groups=mesh[" in partitioned
  [asked] = hlo.collectives(partitioned)
  assert (asked.op, asked.group_size, asked.trips, asked.in_loop) == (
      "all-gather", 8, 1, False)
  assert asked.operands == (("bf16", (8, 32)),) and asked.dtypes == {"bf16"}
  assert (asked.operand_bytes, asked.result_bytes, asked.payload_bytes) == (
      512, 4096, 4096)
  # One device: nothing is partitioned.
  assert hlo.compile_partitioned(jax.jit(lambda a: a * 2).lower(jnp.ones(4)))[1] == ""
  # XLA:CPU runs the same gather in f32 (float-normalization-bf16).
  [run] = hlo.collectives(compiled.as_text())
  assert run.dtypes == {"f32"} and run.group_size == 8 and run.result_bytes == 8192


def test_replica_group_forms_and_async_pairs():
  text = """HloModule m, num_partitions=8

ENTRY %main (a: bf16[8,32]) -> bf16[64,32] {
  %a = bf16[8,32]{1,0} parameter(0)
  %g0 = bf16[64,32]{1,0} all-gather(%a), replica_groups={{0,1,2,3,4,5,6,7}}
  %g1 = bf16[64,32]{1,0} all-gather(%a), replica_groups=[1,8]<=[8]
  %g2 = bf16[64,32]{1,0} all-gather(%a), replica_groups=mesh['x'=2,'y'=8] {'y'}
  %g3 = bf16[32,32]{1,0} all-gather(%a), replica_groups=mesh['x'=2,'y'=8] {'y':(2)4}
  %g4 = bf16[128,32]{1,0} all-gather(%a), replica_groups=mesh['x'=2,'y'=8] {'x','y'}
  %g5 = bf16[64,32]{1,0} all-gather(%a), replica_groups={}
  %p = bf16[8,32]{1,0} collective-permute(%a), source_target_pairs={{0,1},{1,0}}
  %s = (bf16[8,32]{1,0}, bf16[64,32]{1,0}) all-gather-start(%a), replica_groups={}
  ROOT %d = bf16[64,32]{1,0} all-gather-done(%s)
}
"""
  found = hlo.collectives(text)
  assert [c.group_size for c in found] == [8, 8, 8, 4, 16, 8, 0, 8]
  assert [c.op for c in found][-2:] == ["collective-permute", "all-gather"]
  start = found[-1]  # Its result is the -done's, not the (operand, result) tuple.
  assert start.results == (("bf16", (64, 32)),) and start.operand_bytes == 512


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_gather_params_in_bf16_and_reduce_grads_in_f32(stage):
  """As partitioned: whole-param all-gathers in the param dtype, gradients in fp32."""
  model = MlpLM(vocab_size=64, d_model=64, d_ff=128, n_layers=3, context=4,
                param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
  tx = zerojax.with_update_rule(optax.adamw(1e-3), "nearest")
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, shapes, tx,
                           logical_axes=model.logical_axes(), min_shard_size=0)
  step = zerojax.make_train_step(plan, model.loss, tx)
  batch = {"tokens": jax.ShapeDtypeStruct(
      (16, 17), jnp.int32, sharding=NamedSharding(plan.mesh, plan.batch_spec))}
  _, text = hlo.compile_partitioned(step.lower(zerojax.abstract_state(plan), batch))
  found = hlo.collectives(text)
  param_shapes = {x.shape for x in jax.tree.leaves(plan.params)}
  gathers = [c for c in found if c.op == "all-gather"
             and {s for _, s in c.results} <= param_shapes]
  reductions = [c for c in found if c.op in ("all-reduce", "reduce-scatter")]
  grads = [c for c in reductions  # Not losses or norms.
           if any(math.prod(s) > 64 for _, s in c.operands)]
  assert gathers and all(c.dtypes == {"bf16"} for c in gathers), gathers
  assert grads and all({d for d, _ in c.operands} == {"f32"} for c in grads), grads
  # Each param leaf is gathered once, and its gradient (the 64-element final norm's
  # too, also f32) reduced once per step.
  num_params = sum(x.size for x in jax.tree.leaves(plan.params))
  assert sum(c.result_bytes * c.trips for c in gathers) == 2 * num_params
  assert sum(hlo.nbytes(((d, s),)) * c.trips for c in reductions
             for d, s in c.operands if s) == 4 * num_params


def test_weight_gradient_dots_emit_fp32_that_nothing_rounds():
  """The program's weight-gradient dots (a dot whose result has a 2-D param's shape) as
  written, before XLA:CPU rewrites every bf16 dot as fp32: with `upcast_params`
  'gathered' each layer's is f32 and never converted to bf16 at stage 3 and under
  gradient release; 'all' adds the head's, and reaches stage 1's whole params; 'none'
  (the negative control) rounds each to bf16 (a bf16 dot, or the head's f32 dot
  converted)."""
  # A vocabulary no layer's kernel shape has: the head's [32, 96] is its own.
  model = LlamaLM(LlamaConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                              d_ff=64, attention_block=8, loss_chunk=8))
  tx = zerojax.optim.lion(1e-3)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  layer = {x.shape[1:] for x in jax.tree.leaves(shapes["layers"]) if x.ndim == 3}
  head = shapes["lm_head"]["kernel"].shape

  def weight_dots(stage, upcast, release=False):
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, shapes, tx,
                             logical_axes=model.logical_axes(), min_shard_size=0)
    step = (make_release_step(plan, model.layered(), tx, upcast_params=upcast) if release
            else zerojax.make_train_step(plan, model.loss, tx, upcast_params=upcast))
    batch = {"tokens": jax.ShapeDtypeStruct(
        (8, 17), jnp.int32, sharding=NamedSharding(plan.mesh, plan.batch_spec))}
    text = step.lower(zerojax.abstract_state(plan), batch).as_text(dialect="hlo")
    found = {}
    for d in hlo.dots(text):  # JAX's own transpose emits the head's as [V, D].
      if d.result[1] in layer | {head, head[::-1]}:
        found.setdefault("layers" if d.result[1] in layer else "head", set()).add(
            (d.result[0], "bf16" in d.converted_to))
    return found

  fp32, rounded, head_rounded = {("f32", False)}, {("bf16", False)}, {("f32", True)}
  for release in (False, True):
    assert weight_dots(3, "gathered", release) == {"layers": fp32, "head": head_rounded}
  for stage in (3, 1):
    assert weight_dots(stage, "all") == {"layers": fp32, "head": fp32}
  assert weight_dots(3, "none") == {"layers": rounded, "head": head_rounded}
  # Stage 1 gathers nothing a layer at a time: 'gathered' is 'none' there.
  assert weight_dots(1, "gathered") == {"layers": rounded, "head": head_rounded}
