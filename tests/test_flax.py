"""A Flax model on the plan: nn.scan layers gathered one at a time at stage 3."""

import flax.linen as nn
import jax
import numpy as np
import optax

import zerojax
from zerojax.testing import hlo

D, LAYERS, VOCAB = 64, 3, 64


def dense(features, names):
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
  return nn.Dense(features, use_bias=False, kernel_init=init)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = jax.nn.gelu(dense(4 * D, ("embed", "mlp"))(x))
    return x + dense(D, ("mlp", "embed"))(h), None


class ScannedLM(nn.Module):
  """The Flax recipe: map_variables gathers each layer's params inside nn.scan."""

  @nn.compact
  def __call__(self, tokens):
    embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    x = nn.Embed(VOCAB, D, embedding_init=embed_init)(tokens)
    block = nn.map_variables(Block, "params", trans_in_fn=zerojax.gather, mutable=True)
    layers = nn.scan(nn.remat(block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=LAYERS,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(name="layers")(x, None)
    return dense(VOCAB, ("embed", "vocab"))(x)


def test_flax_scan_model_trains_identically_at_every_stage():
  model = ScannedLM()
  tokens = np.random.RandomState(0).randint(0, VOCAB, size=(16, 17)).astype(np.int32)
  batch = {"tokens": tokens}
  init = lambda rng: nn.unbox(model.init(rng, tokens[:, :-1]))["params"]
  boxed = jax.eval_shape(lambda rng: model.init(rng, tokens[:, :-1]),
                         jax.random.PRNGKey(0))["params"]
  axes = zerojax.flax_logical_axes(boxed)
  assert axes["layers"]["Dense_0"]["kernel"] == ("layers", "embed", "mlp")

  def loss(params, batch, rng):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()

  tx = optax.adamw(1e-3)
  shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
  results = {}
  for stage in (0, 3):
    plan = zerojax.make_plan(zerojax.make_mesh(1, 8), stage, shapes, tx,
                             logical_axes=axes, min_shard_size=0)
    state = zerojax.init_state(plan, init, tx, jax.random.PRNGKey(0))
    step = zerojax.make_train_step(plan, loss, tx)
    for _ in range(5):
      state, metrics = step(state, batch)
    results[stage] = (float(metrics["loss"]), jax.tree.map(np.asarray, state.params))
    if stage == 3:
      compiled = step.lower(state, batch).compile()
      layer = [c for c in hlo.collectives(compiled.as_text())
               if c.op == "all-gather" and {s for _, s in c.results} & {(D, 4 * D), (4 * D, D)}]
      assert layer and all(c.trips == LAYERS for c in layer)
  assert results[3][0] == results[0][0]
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[3][1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
