"""Mixtures of experts (`zerojax.models.moe`, the decoder's `n_experts`), under jax.jit in
fp32.

The block's parts: dropless dispatch (sorted by expert, grouped matmuls) and the capacity
mode equal a dense reference that gathers each token's experts (values 1e-6 relative,
gradients 1e-5); the router, the block's output and the load-balancing loss equal
transformers' own Qwen3-MoE and Mixtral code on the same weights. The decoder: tiny
Qwen3-MoE and Mixtral checkpoints written by transformers in the test (random norm
weights; the `hf-check` extra) import with fp32 logits within 1e-4 of transformers',
the load-balancing loss is transformers' `aux_loss`, export loads back as the same class
with the same logits; `train.py` fine-tunes the tiny MoE config on chat data on 8
devices at stage 3 and its checkpoint answers a prompt.
Expert parallelism (`mesh.expert`): the same params and losses as the experts on every
device, gradients reduced in fp32 over the axes that replicate each leaf (from the HLO),
a checkpoint restored onto another expert split.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax import build, hf, memory
from zerojax.config import ConfigError, load_config
from zerojax.data import sft_demo
from zerojax.generate import cli as generate_cli
from zerojax.memory import report
from zerojax.models import from_config, llama, moe
from zerojax.testing import hlo, run_logs

from test_families import Checkpoint, _torch
from test_train import run_main, train_here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.parametrize("dispatch", ["ragged_dot", "tiles"])
def test_dropless_is_the_dense_reference_values_and_gradients(block, dispatch):
  """`dropless` (grouped matmuls by `ragged_dot`) and `dropless_tiled` (each expert's
  run in whole tiles of 5 rows, a matmul a tile, its own backward)."""
  x, router, experts = block
  fn = moe.dropless if dispatch == "ragged_dot" else functools.partial(moe.dropless_tiled,
                                                                       tile=5)
  got, want = _layer(fn)(*block), _layer(moe.dense_reference)(*block)
  assert _relative(got, want) < 1e-6
  # Every token's k experts were used: the routing is not degenerate.
  counts = moe.tokens_per_expert(moe.route(x, router, K), E)
  assert int(counts.sum()) == N * K and int((counts > 0).sum()) == E
  probe = jax.random.normal(jax.random.key(9), (N, D))
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2)))  # noqa: E731
  for g, w in zip(jax.tree.leaves(grad(_layer(fn))(*block)),
                  jax.tree.leaves(grad(_layer(moe.dense_reference))(*block))):
    assert _relative(g, w) < 1e-5


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_dispatch_is_dropless_on_one_device(ep):
  """8 devices as data x expert = (8 / ep) x ep, each with its own 16 tokens and the
  experts split over 'expert' (E = 8: 8 / ep a device): `expert_parallel`'s
  all-to-alls give every token what `dropless` gives on one device with all experts
  (fp32, 1e-6), and the gradients of x, the router and the experts (1e-5)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8 // ep, ep), ("data", "expert"))
  keys = jax.random.split(jax.random.key(1), 5)
  E = 8
  x = jax.random.normal(keys[0], (8 * 16, D), jnp.float32)
  router = jax.random.normal(keys[1], (D, E), jnp.float32)
  experts = moe.Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in zip(
      keys[2:], [(E, D, F), (E, D, F), (E, F, D)])))
  P = jax.sharding.PartitionSpec
  tokens = P(("data", "expert"))

  def parallel(x, router, experts):
    body = lambda x, r, e: moe.expert_parallel(x, moe.route(x, r, K), e, "expert")[0]  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, P(), P("expert")),
                         out_specs=tokens)(x, router, experts)

  def single(x, router, experts):
    return moe.dropless(x, moe.route(x, router, K), experts)

  got, want = jax.jit(parallel)(x, router, experts), jax.jit(single)(x, router, experts)
  assert _relative(got, want) < 1e-6
  probe = jax.random.normal(jax.random.key(2), x.shape)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2)))  # noqa: E731
  for g, w in zip(jax.tree.leaves(grad(parallel)(x, router, experts)),
                  jax.tree.leaves(grad(single)(x, router, experts))):
    assert _relative(g, w) < 1e-5


def test_expert_parallel_at_a_capacity_drops_and_counts_what_a_reference_drops():
  """Skewed routing (half of each device's tokens to expert 0) over 2 x 4 devices (data x
  expert, 2 experts a device) at factor 1: each device sends each expert-parallel device
  at most ceil(16 x 2 / 4) = 8 rows, the first in expert order, then token order. The
  outputs and the gradients of x, the router and the experts equal the dense
  reference's with the rows past a destination's 8 weighted 0 (found here in numpy;
  1e-6 and 1e-5), and each device's count is the reference's."""
  ep, E, n, factor = 4, 8, 16, 1.0
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, ep), ("data", "expert"))
  keys = jax.random.split(jax.random.key(3), 5)
  x = np.array(jax.random.normal(keys[0], (8 * n, D), jnp.float32))
  x[np.arange(8 * n) % n < n // 2, 0] = 5.0  # Half of each device's tokens ...
  router = np.array(jax.random.normal(keys[1], (D, E), jnp.float32))
  router[0, 0] = 10.0  # ... prefer expert 0.
  experts = moe.Experts(*(0.3 * jax.random.normal(kk, s, jnp.float32) for kk, s in zip(
      keys[2:], [(E, D, F), (E, D, F), (E, F, D)])))
  P = jax.sharding.PartitionSpec
  tokens = P(("data", "expert"))

  def parallel(factor):
    def body(x, r, e):
      out, dropped = moe.expert_parallel(x, moe.route(x, r, K), e, "expert", factor=factor)
      return out, dropped[None]
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, P(), P("expert")),
                         out_specs=(tokens, tokens))

  run = lambda factor: jax.jit(parallel(factor))(x, router, experts)  # noqa: E731
  out, dropped = run(factor)
  routing = jax.jit(moe.route, static_argnums=2)(jnp.asarray(x), jnp.asarray(router), K)
  chosen, keep = np.asarray(routing.experts), np.ones((8 * n, K), bool)
  slots = moe.exchange_slots(n * K, ep, factor)
  assert slots == 8
  for device in range(8):
    sent = np.zeros(ep, int)
    mine = chosen[device * n:(device + 1) * n]
    for a in np.argsort(mine.reshape(-1), kind="stable"):  # By expert, then token.
      t, j = divmod(int(a), K)
      dest = mine[t, j] // (E // ep)
      keep[device * n + t, j] = sent[dest] < slots
      sent[dest] += 1
  want = (~keep).reshape(8, -1).sum(axis=1)
  assert want.sum() > 0 and np.array_equal(np.asarray(dropped), want)
  kept = routing._replace(weights=routing.weights * keep)
  assert _relative(out, moe.dense_reference(jnp.asarray(x), kept, experts)) < 1e-6
  probe = jax.random.normal(jax.random.key(4), x.shape)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2)))  # noqa: E731
  reference = lambda x, r, e: moe.dense_reference(x, (lambda g: g._replace(  # noqa: E731
      weights=g.weights * keep))(moe.route(x, r, K)), e)
  for g, w in zip(jax.tree.leaves(grad(lambda *a: parallel(factor)(*a)[0])(x, router, experts)),
                  jax.tree.leaves(grad(reference)(x, router, experts))):
    assert _relative(g, w) < 1e-5
  # Dropless (factor 0) on the same skew: nothing dropped, the whole reference.
  out, dropped = run(0.0)
  assert int(np.asarray(dropped).sum()) == 0
  assert _relative(out, moe.dense_reference(jnp.asarray(x), routing, experts)) < 1e-6


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


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_block_and_its_aux_loss_are_transformers(family, block):
  """transformers' sparse MoE block (its own router, top-k, renormalization and expert
  loop) on the same weights; its `load_balancing_loss_func` on the same router logits,
  with and without a padding mask."""
  transformers, torch = _torch()
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


# ------------------------------------------------------------------- the decoder


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def ckpt(request, tmp_path_factory) -> Checkpoint:
  """A tiny MoE checkpoint written by transformers (norm weights off their init, weights
  at std 0.15: logits of a few units), and zerojax's fp32 import of it."""
  transformers, torch = _torch()
  torch.manual_seed(0)
  common = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.15, num_experts_per_tok=2,
                rms_norm_eps=1e-6)
  if request.param == "qwen3_moe":
    config = transformers.Qwen3MoeConfig(**common, intermediate_size=40, moe_intermediate_size=24,
                                         num_experts=6, norm_topk_prob=False, head_dim=16)
    theirs = transformers.Qwen3MoeForCausalLM(config)
  else:
    config = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=6)
    theirs = transformers.MixtralForCausalLM(config)
  theirs = theirs.eval()
  with torch.no_grad():
    for p in theirs.parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn_like(p))
  folder = str(tmp_path_factory.mktemp(request.param))
  theirs.save_pretrained(folder)
  model = llama.LlamaLM(hf.llama_config(folder, attention="blocked", attention_block=4,
                                        param_dtype=jnp.float32, compute_dtype=jnp.float32))
  params = hf.load_params(folder, jax.eval_shape(model.init, jax.random.key(0)))
  tokens = np.random.default_rng(0).integers(0, 97, (2, 13))
  return Checkpoint(request.param, folder, theirs, model, params, tokens,
                    jax.jit(model.logits))


def test_the_imported_decoder_is_transformers_logits_and_aux_loss(ckpt):
  """config.json's experts (Qwen3-MoE without norm_topk_prob, Mixtral always
  renormalized), fp32 logits within 1e-4, and the load-balancing loss from the layer
  loop's router statistics equal to transformers' `aux_loss` (1e-5)."""
  _, torch = _torch()
  c = ckpt.model.config
  assert (c.family, c.n_experts, c.experts_per_token) == (ckpt.name, 6, 2)
  assert c.norm_topk_prob == (ckpt.name == "mixtral") and c.expert_d_ff == 24
  with torch.no_grad():
    out = ckpt.theirs(input_ids=torch.tensor(ckpt.tokens), output_router_logits=True)
  theirs = out.logits.float().numpy()
  ours = np.asarray(ckpt.logits(ckpt.params, ckpt.tokens))
  assert np.abs(theirs).max() > 1.0  # Logits of a few units: 1e-4 is a real bound.
  assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()
  print(f"{ckpt.name}: logits max abs {np.abs(ours - theirs).max():.1e}")  # pytest -s
  carry = jax.jit(lambda p, t: llama.Llama(c).apply({"params": p}, t,
                                                     method=llama.Llama.layer_loop))(
      ckpt.params, ckpt.tokens)
  aux, _ = moe.losses_from_stats(carry[-1], ckpt.tokens.size, c.n_layers)
  assert float(aux) == pytest.approx(float(out.aux_loss), rel=1e-5)


def test_export_loads_as_the_same_class_with_the_same_logits(ckpt, tmp_path):
  """save_params writes each expert's tensors under the family's names; transformers'
  Auto class loads the family's class with the same logits (1e-4); config.json reads
  back the same model keys."""
  transformers, torch = _torch()
  hf.save_params(ckpt.params, ckpt.model.config, str(tmp_path))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                           dtype=torch.float32).eval()
  assert type(back).__name__ == type(ckpt.theirs).__name__
  with torch.no_grad():
    theirs = back(input_ids=torch.tensor(ckpt.tokens)).logits.float().numpy()
  ours = np.asarray(ckpt.logits(ckpt.params, ckpt.tokens))
  assert np.abs(theirs - ours).max() < 1e-4
  print(f"{ckpt.name}: exported logits max abs {np.abs(theirs - ours).max():.1e}")
  assert hf.config_overrides(str(tmp_path)) == hf.config_overrides(ckpt.folder)


def test_train_py_trains_the_tiny_moe_on_8_devices(tmp_path):
  """`train.py --config configs/qwen3_moe_tiny.py` (8 experts, 2 a token; the
  load-balancing loss at 0.01 in the loss) fine-tuning on chat data (`sft_demo`: packed
  rows, the prompt masked out) at stage 3, at one layer and 64 positions (the experts are
  the point, not the depth), with expert parallelism: 4 steps on mesh.expert=4 x
  mesh.fsdp=2, stopped (a checkpoint), resumed on mesh.expert=2 x mesh.fsdp=4 (the
  checkpoint restores onto the other split) for 4 more, each device sending each other
  at most 0.75 x a balanced router's rows (`model.expert_capacity_factor`): of a device's
  128 tokens' 256 assignments at least 64 do not fit, and are counted; the loss falls
  over the 8 steps, and the checkpoint answers a prompt (KV-cached decoding)."""
  data = sft_demo.write(str(tmp_path / "sft"), train=300, held_out=20)
  common = ("--config", os.path.join(REPO, "configs", "qwen3_moe_tiny.py"),
            "--config.model.n_layers=1", "--config.train.seq_len=64",
            "--config.model.attention_block=64", "--config.model.loss_chunk=64",
            "--config.train.steps=8", "--config.train.log_every=1",
            "--config.optimizer.warmup_steps=2", "--config.train.eval_every=0",
            "--config.train.eval_batches=1", "--config.checkpoint.every_steps=4",
            "--config.data.name=sft", f"--config.data.path={data['train']}",
            f"--config.data.tokenizer={data['tokenizer']}", "--config.model.vocab_size=264",
            "--config.model.expert_capacity_factor=0.75", f"--config.workdir={tmp_path}")
  first = train_here(*common, "--config.mesh.expert=4", "--config.mesh.fsdp=2", "--stop_after=4")
  assert first.returncode == 75, first.stderr[-3000:]
  again = train_here(*common, "--config.mesh.expert=2", "--config.mesh.fsdp=4")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {tmp_path}/checkpoints/4" in again.stdout
  records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  heads = [r for r in records if "devices" in r]
  assert [r["mesh"]["expert"] for r in heads] == [4, 2] and heads[0]["stage"] == 3
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
  # What the routers did, each step: the load-balancing loss (1 when balanced, at least 1
  # in expectation) and each expert's share of the assignments (summing to 1), in
  # metrics.jsonl and TensorBoard ('moe/...').
  steps = [r for r in records if "loss" in r]
  shares = [[r[f"expert_load/{e:03d}"] for e in range(8)] for r in steps]
  assert all(abs(sum(x) - 1) < 1e-5 and min(x) >= 0 for x in shares), shares
  assert all(0.5 < r["router_aux_loss"] < 8 and r["router_z_loss"] > 0 for r in steps)
  board = run_logs.tensorboard_scalars(str(tmp_path / "tb"))
  assert [v for _, v in board["moe/aux_loss"]] == pytest.approx(
      [r["router_aux_loss"] for r in steps], rel=1e-6)
  assert len(board["moe/expert_load/007"]) == 8
  # The assignments dropped (a device's, summed over the layers; the devices' mean): at
  # least 64 of 256, room being 0.75 x a balanced router's.
  dropped = [r["router_dropped_tokens"] for r in steps]
  assert min(dropped) >= 64, dropped
  assert [v for _, v in board["moe/dropped_tokens"]] == pytest.approx(dropped)
  said = run_main(generate_cli.main, f"--workdir={tmp_path}", "--prompt=12+30=", "--max_new=4")
  assert said.returncode == 0, said.stderr[-2000:]
  assert said.stdout.startswith(f"restored {tmp_path}/checkpoints/8\n"), said.stdout


def test_the_planner_counts_the_active_parameters_as_flops_per_token_does():
  """`memory.active_params` (all but (E - k) / E of the experts) is what MFU's
  `flops_per_token` multiplies: 6 x (active params less the embedding and the norms) +
  attention's, for the tiny MoE; the report's header says both counts."""
  config = load_config(os.path.join(REPO, "configs", "qwen3_moe_tiny.py"))
  c, spec = from_config(config).config, memory.RunSpec.from_config(config, 8)
  shapes = llama.param_shapes(c)
  experts = sum(int(np.prod(s)) for p, (s, _) in shapes.items()
                if p[:3] == ("layers", "mlp", "experts"))
  total = memory.param_counts(spec).total
  assert memory.active_params(spec) == total - experts * 6 // 8
  unmultiplied = sum(int(np.prod(s)) for p, (s, _) in shapes.items()
                     if p[-1] == "scale" or p[0] == "embed_tokens")
  attention = 12 * c.n_layers * c.n_heads * c.head_dim * 128 * 0.5
  assert llama.flops_per_token(c, 128) == (
      6.0 * (memory.active_params(spec) - unmultiplied) + attention)
  header = report.format_table(memory.estimate(spec)).splitlines()[1]
  assert header.startswith("  1.64M params (0.76M active a token: 2 of 8 experts);"), header


# The tiny MoE in fp32 with AdamW, no clipping: 1 layer of 8 experts, 32 positions, 16
# sequences.
EP_RUN = ("precision.param_dtype=float32", "precision.compute_dtype=float32",
          "optimizer.name=adamw", "optimizer.update_rule=nearest", "optimizer.state_dtype=float32",
          "optimizer.warmup_steps=0", "optimizer.learning_rate=1e-3", "model.n_layers=1",
          "train.seq_len=32", "model.attention_block=32", "model.loss_chunk=32",
          "train.global_batch_size=16", "zero.min_shard_size=64",
          "optimizer.grad_clip=0.0")  # Release clips by other rules: none in every run.


def _ep_run(ep, stage, *extra, steps=5, devices=8):
  """(losses, final params as numpy) of `steps` AdamW steps of the tiny MoE on `devices`
  devices as mesh.expert=ep x mesh.fsdp=devices/ep at `stage` (and `extra` overrides), on
  fixed random tokens; the plan."""
  config = load_config(os.path.join(REPO, "configs", "qwen3_moe_tiny.py"),
                       [f"--config.{o}" for o in (*EP_RUN, f"mesh.expert={ep}",
                                                   f"zero.stage={stage}", *extra)],
                       num_devices=devices)
  built = build.build(config, jax.devices()[:devices])
  state = zerojax.init_state(built.plan, built.model.init, built.tx, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (steps, 16, 33), 0, config.model.vocab_size)
  losses = []
  for i in range(steps):
    state, metrics = built.train_step(state, {"tokens": jax.device_put(tokens[i],
                                                                        built.batch_sharding)})
    losses.append(float(metrics["loss"]))
    assert float(metrics["router_dropped_tokens"]) == 0  # Dropless: none, and counted so.
  return losses, jax.tree.map(np.asarray, state.params), built.plan


@functools.cache
def _ep_reference():
  return _ep_run(1, 0)


def test_expert_parallel_on_8_devices_trains_as_one_device():
  """mesh.expert=8 (one expert a device, stage 3) and one device with every expert: the
  same 5 AdamW steps, losses and every param within 1e-5 (fp32). Without the router's
  load-balancing loss, which each device computes over its own tokens (transformers: over
  its batch), so it differs between 8 devices and one (the other EP cases compare equal
  splits of the batch)."""
  losses, params, _ = _ep_run(8, 3, "model.router_aux_loss_coef=0.0")
  want_losses, want, _ = _ep_run(1, 0, "model.router_aux_loss_coef=0.0", devices=1)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  worst = max(jax.tree.leaves(jax.tree.map(_relative, params, want)))
  assert worst < 1e-5, worst


RELEASE = ("optimizer.release=True",)
OFFLOAD = ("optimizer.offload=host", "zero.param_offload=host")


@pytest.mark.parametrize("ep,stage,extra", [
    (2, 3, ()), (4, 2, ()), (2, 3, RELEASE), (4, 3, (*RELEASE, *OFFLOAD))],
    ids=["ep2-stage3", "ep4-stage2", "ep2-release", "ep4-release-offload"])
def test_expert_parallel_trains_as_the_experts_on_every_device(ep, stage, extra):
  """mesh.expert=ep: each device holds 8 / ep experts of every layer (its shard of the
  experts' stacks [layers, experts, ...] is [1, 8 / ep, ...]; ep = 8 below), and the
  tokens reach them by all-to-all; 5 AdamW steps give the losses and every param of the
  run with all experts on every device (mesh.expert=1 at stage 0, the same 8 devices and
  batch split, so the router's per-device losses are the same): fp32, 1e-5. With
  gradient release too, and with the optimizer state and the layers' params in host
  memory."""
  losses, params, plan = _ep_run(ep, stage, *extra)
  want_losses, want, _ = _ep_reference()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  worst = max(jax.tree.leaves(jax.tree.map(_relative, params, want)))
  assert worst < 1e-5, worst
  mlp = plan.param_specs["layers"]["mlp"]
  gate = mlp["experts"]["gate_proj"]  # [layers, experts, embed, mlp]: experts over 'expert',
  assert gate[1] == "expert" and "expert" not in gate[2:], gate  # ZeRO over the rest.
  # The router is every device's whole (ZeRO-sharded over both axes, like attention).
  assert plan.expert_dims["layers"]["mlp"]["router"]["kernel"] is None, mlp["router"]


def test_expert_parallelism_is_refused_where_it_is_not_built():
  """mesh.expert needs experts it divides (exit 2 in train.py), each naming the key; a
  capacity factor with it is the exchange's size (`moe.expert_parallel`), accepted."""
  moe_tiny = os.path.join(REPO, "configs", "qwen3_moe_tiny.py")
  cases = [("configs/tiny.py", ["mesh.expert=2"], "no experts"),
           (moe_tiny, ["mesh.expert=3", "mesh.fsdp=1", "mesh.data=1"], "does not divide")]
  for path, overrides, match in cases:
    with pytest.raises(ConfigError, match=match):
      load_config(path, [f"--config.{o}" for o in overrides], num_devices=8)
  load_config(moe_tiny, ["--config.mesh.expert=2", "--config.model.expert_capacity_factor=1.5"],
              num_devices=8)


def test_the_experts_gradients_are_reduced_in_fp32_over_the_axes_that_replicate_them():
  """The bf16 tiny MoE at stage 3 on mesh.expert=4 x mesh.fsdp=2, read from the HLO as
  partitioned (before XLA:CPU upcasts bf16 collectives): each layer's experts' gradient
  (a device's 2 experts, [2, D, F] or [2, F, D]) is reduce-scattered in fp32 over its 2
  'fsdp' devices only, never over 'expert' (the other devices hold other experts); the
  attention's over all 8; the tokens go to their experts and back by all-to-alls over
  the 4 'expert' devices inside the layer loop."""
  config = load_config(os.path.join(REPO, "configs", "qwen3_moe_tiny.py"),
                       ["--config.mesh.expert=4", "--config.mesh.fsdp=2", "--config.zero.stage=3",
                        "--config.model.n_layers=2", "--config.train.seq_len=32",
                        "--config.model.attention_block=32", "--config.model.loss_chunk=32",
                        "--config.zero.min_shard_size=64"], num_devices=8)
  assert config.precision.param_dtype == "bfloat16"
  built = build.build(config)
  _, text = hlo.compile_partitioned(built.train_step.lower(built.abstract_state,
                                                           built.abstract_batch))
  found = hlo.collectives(text)
  c = from_config(config).config
  experts = {(2, c.d_model, c.expert_d_ff), (2, c.expert_d_ff, c.d_model)}
  shard = lambda shape: {s for _, s in shape}  # noqa: E731
  reductions = [x for x in found if x.op in ("all-reduce", "reduce-scatter")]
  of_experts = [x for x in reductions if shard(x.operands) & experts]
  assert of_experts and all(x.op == "reduce-scatter" and x.group_size == 2 and x.in_loop
                            and {d for d, _ in x.operands} == {"f32"} for x in of_experts), (
                                of_experts)
  q = (c.d_model, c.n_heads * c.head_dim)  # A layer's q_proj, gathered over all 8.
  of_q = [x for x in reductions if q in shard(x.operands)]
  assert of_q and all(x.group_size == 8 and {d for d, _ in x.operands} == {"f32"}
                      for x in of_q), of_q
  exchanges = [x for x in found if x.op == "all-to-all"]
  assert exchanges and all(x.group_size == 4 and x.in_loop for x in exchanges), exchanges
  # Their operand bytes are the planner's, to the byte (`moe.all_to_all_bytes`: rows out
  # and back, the experts' ids, the backward's transposes, remat's recompute).
  planned = memory.estimate(memory.RunSpec.from_config(config, 8))
  assert sum(x.operand_bytes * x.trips for x in exchanges) == c.n_layers * planned.all_to_all
  assert "expert parallel over expert=4: 2 of 8 experts a device" in report.format_table(
      planned)
