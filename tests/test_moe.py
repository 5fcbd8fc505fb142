"""The mixture-of-experts block's parts (`zerojax.models.moe`), under jax.jit in fp32.

Dropless dispatch (sorted by expert, grouped matmuls) and the capacity mode equal a
dense reference that gathers each token's experts (values 1e-6 relative, gradients
1e-5); the router, the block's output and the load-balancing loss equal transformers'
own Qwen3-MoE and Mixtral code on the same weights (the `hf-check` extra).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.models import moe

N, D, E, F, K = 48, 16, 8, 12, 2


def _relative(a, b) -> float:
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def block():
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (N, D), jnp.float32)
  router = jax.random.normal(keys[1], (D, E), jnp.float32)
  experts = moe.Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in zip(
      keys[2:], [(E, D, F), (E, D, F), (E, F, D)])))
  return x, router, experts


def _layer(dispatch):
  def apply(x, router, experts):
    return dispatch(x, moe.route(x, router, K), experts)
  return jax.jit(apply)


def test_dropless_is_the_dense_reference_values_and_gradients(block):
  x, router, experts = block
  got, want = _layer(moe.dropless)(*block), _layer(moe.dense_reference)(*block)
  assert _relative(got, want) < 1e-6
  # Every token's k experts were used: the routing is not degenerate.
  counts = moe.tokens_per_expert(moe.route(x, router, K), E)
  assert int(counts.sum()) == N * K and int((counts > 0).sum()) == E
  probe = jax.random.normal(jax.random.key(9), (N, D))
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2)))  # noqa: E731
  for g, w in zip(jax.tree.leaves(grad(_layer(moe.dropless))(*block)),
                  jax.tree.leaves(grad(_layer(moe.dense_reference))(*block))):
    assert _relative(g, w) < 1e-5


def test_capacity_keeps_the_first_assignments_of_each_expert(block):
  x, router, experts = block
  routing = jax.jit(moe.route, static_argnums=2)(x, router, K)
  # At a factor that gives every expert room for all tokens, nothing is dropped.
  out, dropped = jax.jit(moe.with_capacity, static_argnums=3)(x, routing, experts, E / K)
  assert int(dropped) == 0 and _relative(out, moe.dense_reference(x, routing, experts)) < 1e-6
  # At 1.0, an expert's assignments past ceil(N k / E) = 12 (token order) add nothing:
  # the reference with those weights zeroed, found here by counting in numpy.
  out, dropped = jax.jit(moe.with_capacity, static_argnums=3)(x, routing, experts, 1.0)
  chosen, seen = np.asarray(routing.experts), np.zeros(E, int)
  keep = np.zeros(chosen.shape, bool)
  for t in range(N):
    for j in range(K):
      keep[t, j] = seen[chosen[t, j]] < moe.capacity(N, K, E, 1.0)
      seen[chosen[t, j]] += 1
  assert int(dropped) == (~keep).sum() > 0
  kept = routing._replace(weights=routing.weights * keep)
  assert _relative(out, moe.dense_reference(x, kept, experts)) < 1e-6


def test_the_router_losses(block):
  x, router, _ = block
  logits = jnp.stack([moe.route(x, router * s, K).logits for s in (1.0, 0.5, 2.0)])
  mask = (jnp.arange(N) % 5 != 0)
  # Constant logits: p_e = 1 / E, and every token's top k are experts 0..k-1 (ties go to
  # the lower index), so E x sum_e f_e p_e = E x k x 1 / E = k; a real router is above
  # the balanced 1 (transformers' value: the test below).
  assert float(moe.load_balancing_loss(jnp.zeros_like(logits), K, mask)) == pytest.approx(K)
  assert float(moe.load_balancing_loss(logits, K, mask)) > 1
  z = float(moe.router_z_loss(logits, mask))
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1)) ** 2
  assert z == pytest.approx(lse[:, np.asarray(mask)].mean(), rel=1e-6)


def _transformers():
  transformers = pytest.importorskip("transformers", reason="the transformers check: pip "
                                     "install -e '.[hf-check]' (transformers, CPU torch)")
  torch = pytest.importorskip("torch", reason="the transformers check: a CPU torch")
  return transformers, torch


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_block_and_its_aux_loss_are_transformers(family, block):
  """transformers' sparse MoE block (its own router, top-k, renormalization and expert
  loop) on the same weights; its `load_balancing_loss_func` on the same router logits,
  with and without a padding mask."""
  transformers, torch = _transformers()
  x, router, experts = block
  if family == "qwen3_moe":
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m
    config = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                         num_experts_per_tok=K, norm_topk_prob=True)
    theirs = m.Qwen3MoeSparseMoeBlock(config)
  else:
    from transformers.models.mixtral import modeling_mixtral as m
    config = transformers.MixtralConfig(hidden_size=D, intermediate_size=F,
                                        num_local_experts=E, num_experts_per_tok=K)
    theirs = m.MixtralSparseMoeBlock(config)
  t = lambda a: torch.tensor(np.asarray(a, np.float32))  # noqa: E731
  with torch.no_grad():  # Their layout: router [E, D], gate_up [E, 2F, D], down [E, D, F].
    theirs.gate.weight.copy_(t(router.T))
    theirs.experts.gate_up_proj.copy_(t(jnp.concatenate([experts.gate, experts.up], -1)
                                        .transpose(0, 2, 1)))
    theirs.experts.down_proj.copy_(t(experts.down.transpose(0, 2, 1)))
    want = theirs(t(x)[None])
    want = (want[0] if isinstance(want, tuple) else want)[0].numpy()
  got = _layer(moe.dropless)(x, router, experts)
  assert _relative(got, want) < 1e-5
  logits = [moe.route(x, router * s, K).logits for s in (1.0, 0.5)]
  mask = np.arange(N) % 5 != 0
  for m_ in (None, mask):
    want = m.load_balancing_loss_func(tuple(t(a) for a in logits), E, K,
                                      None if m_ is None else torch.tensor(m_[None]))
    got = moe.load_balancing_loss(jnp.stack(logits), K, m_)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
