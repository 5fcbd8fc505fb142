"""A linen transformer whose blocks run under `nn.scan`, in bf16, at ZeRO stage 3.

Shows: the 'layers' logical axis that makes stage 3 gather one layer at a time
(`zerojax.gather` inside the scanned block), bf16 params with optax's own AdamW
wrapped by `zerojax.with_update_rule` (Kahan-compensated updates; Adam's moments kept
in fp32, never silently bf16), clipping and a warmup-cosine schedule.

    python examples/linen_scan_transformer.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

VOCAB, D, HEADS, LAYERS, SEQ = 128, 64, 4, 4, 32


def dense(features, names):
  """A bias-free Dense whose kernel carries its logical axis names."""
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
  return nn.Dense(features, use_bias=False, kernel_init=init, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16)


def norm():
  scale = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
  return nn.RMSNorm(scale_init=scale, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


class Block(nn.Module):
  """Pre-norm causal attention and MLP."""

  @nn.compact
  def __call__(self, x, _):
    h = norm()(x)
    q, k, v = (dense(D, ("embed", "heads"))(h).reshape(*h.shape[:2], HEADS, D // HEADS)
               for _ in range(3))
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + dense(D, ("heads", "embed"))(
        nn.dot_product_attention(q, k, v, mask=mask).reshape(x.shape))
    h = nn.gelu(dense(4 * D, ("embed", "mlp"))(norm()(x)))
    return x + dense(D, ("mlp", "embed"))(h), None


class LM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    embed = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    x = nn.Embed(VOCAB, D, embedding_init=embed, param_dtype=jnp.bfloat16)(tokens)
    # Stage 3 gathers each layer's params inside the scan: one layer whole at a time.
    block = nn.map_variables(Block, "params", trans_in_fn=zerojax.gather, mutable=True)
    layers = nn.scan(nn.remat(block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=LAYERS,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = layers(name="layers")(x, None)
    return dense(VOCAB, ("embed", "vocab"))(norm()(x)).astype(jnp.float32)


def data(step, batch_size=16):
  """Counting sequences mod VOCAB from random starts: the next token is predictable."""
  start = np.random.default_rng(step).integers(0, VOCAB, (batch_size, 1))
  return {"tokens": ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32)}


def main(steps: int = 40) -> dict:
  model = LM()
  tokens = jnp.zeros((1, SEQ), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  init_fn = lambda rng: nn.unbox(model.init(rng, tokens))["params"]

  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, max(steps, 6))
  tx = zerojax.with_update_rule(optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.adamw(schedule, weight_decay=0.1)),
                                "kahan")
  plan = zerojax.make_plan(zerojax.make_mesh(data=1, fsdp=-1), stage=3,
                           params=nn.unbox(boxed), tx=tx,
                           logical_axes=zerojax.flax_logical_axes(boxed))

  def loss_fn(params, batch, rng):
    logits = model.apply({"params": params}, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()

  state = zerojax.init_state(plan, init_fn, tx, jax.random.key(0))
  step = zerojax.make_train_step(plan, loss_fn, tx, learning_rate=schedule)
  for i in range(steps):
    state, metrics = step(state, data(i))
  print(f"step {steps}: loss {float(metrics['loss']):.3f} (ln {VOCAB} = {np.log(VOCAB):.3f})")
  return {"train": metrics, "state": state}


if __name__ == "__main__":
  zerojax.fake_cpu_devices(8)                        # before JAX starts its backend
  main()
