"""The step most JAX users write, beside zerojax's, both compiled for the same GPUs.

Issue 53's yardstick. The peer step is MaxText's recipe for the model and batch of a
zerojax config: one `jax.jit` with `NamedSharding`s and the state donated; every leaf of
the params and of the optimizer state sharded over all devices of the mesh along its
largest dimension they divide (FSDP; replicated if none does); optax AdamW with bf16
params and bf16 mu and nu; zerojax's own Llama (the same model) with `model.remat='full'`
(each layer under `jax.checkpoint`, nothing saveable); bf16 gradients, straight from
`jax.value_and_grad`; no microbatches; the model's cross-entropy over the whole sequence
at once (`model.loss_chunk = train.seq_len`: one chunk, [B, T, V] fp32 logits). Both steps
are compiled by XLA's GPU compiler for the same target with the same XLA flags
(train.py's profile for the config), as `python -m zerojax.memory --target T --compile`
compiles zerojax's: no GPU needed, the `gpu-compile` extra. For each step the table
gives XLA's bytes a device, the largest temporaries live at the peak (read from XLA's
dump of its buffer assignment), and the matmul and attention FLOPs a device a step in
the compiled module (each loop body times its trip count) beside the model's (6 x
params x tokens + attention, `flops_per_token`: no recompute).

    pip install -e ".[gpu-compile]"
    python benchmarks/peer_step.py [--config configs/8b_bf16.py] [--target h100:8] \\
        [--config.optimizer.update_rule=nearest] [--out FILE.json]

Overrides go to zerojax's config; the peer takes from it the model (its remat and loss
chunk set as above), the batch and AdamW's hyperparameters (schedule, betas, eps, weight
decay, clipping), and has no use for the rest (the ZeRO stage, the update rule,
microbatches, release, offload). Each run replaces its own entry (config, overrides,
target) in --out (default benchmarks/results/peer_step.json) with the command, the config
digest, the jax version and the commit. Takes ~25 s (16 s of CPU) on 2 busy cores for the
8B at h100:8, about as long for configs/tiny.py: a GPU compile's time is its kernels',
~10 s a step's whatever the model's size.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import build, models, optim
from zerojax.config import ArgumentParser, digest, exit_on_config_error, load_config, parse_argv
from zerojax.gpu import compile as gpu_compile, targets
from zerojax.runtime import xla_dump
from zerojax.runtime.units import fmt_bytes
from zerojax.streaming import schedule

DEFAULT_CONFIG = "configs/8b_bf16.py"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "peer_step.json")
PEER = "jax.jit + FSDP (MaxText's recipe)"
TOP = 10  # Live buffers recorded per step; the table shows the first four.


def peer_config(config):
  """`config` with the peer's model choices: bf16 params the model sees as they are, full
  remat, the loss over the whole sequence in one chunk."""
  peer = copy.deepcopy(config)
  peer.precision.param_dtype = "bfloat16"
  peer.precision.upcast_params = "none"
  peer.model.remat = "full"
  peer.model.loss_chunk = config.train.seq_len
  return peer


def fsdp(mesh, shape: tuple[int, ...]) -> NamedSharding:
  """MaxText's FSDP layout of a leaf: split over every device of `mesh` along its largest
  dimension they divide (the first of equals); replicated if none does (scalars)."""
  n = mesh.devices.size
  dims = [d for d, size in enumerate(shape) if size % n == 0]
  spec = [None] * len(shape)
  if dims:
    spec[max(dims, key=lambda d: shape[d])] = mesh.axis_names
  return NamedSharding(mesh, P(*spec))


def peer_step(config, mesh, abstract_batch):
  """The peer's jitted step and its abstract (state, batch), for `config`'s model and batch
  on `mesh` (zerojax's: the same CPU devices the GPU compile traces over)."""
  model = models.from_config(peer_config(config))
  params, axes = build.abstract_params(model)
  o = config.optimizer
  # nu takes the params' dtype (optax has no nu_dtype): bf16 like mu.
  tx = optax.adamw(optim.learning_rate_schedule(o, config.train.steps), o.b1, o.b2, o.eps,
                   weight_decay=o.weight_decay, mu_dtype=jnp.bfloat16,
                   mask=optim.decay_mask(axes))
  if o.grad_clip:
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), tx)
  state = jax.eval_shape(lambda p: (p, tx.init(p)), params)
  shardings = jax.tree.map(lambda x: fsdp(mesh, x.shape), state)
  batch_sharding = NamedSharding(mesh, P(mesh.axis_names))  # Sequences over every device.
  aux = bool(getattr(model.config, "n_experts", 0))  # With experts: (loss, router metrics).

  def step(state, batch):  # Named `step`: XLA dumps modules matching jit_step.
    params, opt_state = state
    loss, grads = jax.value_and_grad(model.loss, has_aux=aux)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  jitted = jax.jit(step, in_shardings=(shardings, batch_sharding),
                   out_shardings=(shardings, None), donate_argnums=0)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state, shardings)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
           for k, v in abstract_batch.items()}
  return jitted, (abstract, batch), model


def hlo_flops(hlo_text: str, unknown_trips: int = 1) -> float:
  """Matmul and attention FLOPs of one run of a compiled module: its entry's instructions,
  each loop body times its trip count, `unknown_trips` where that is dynamic
  (`schedule.computation_flops`)."""
  per_inst, comps = schedule.computation_flops(hlo_text, unknown_trips)
  entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M).group(1)
  return sum(per_inst[name] for name, *_ in comps[entry])


def measure(name: str, compile_fn, model_flops: float) -> dict:
  """One step's row: `compile_fn(dump_to)` (a `GpuCompiled`), its bytes a device, the
  largest temporaries live at its peak, its FLOPs a device beside `model_flops`."""
  dump = tempfile.mkdtemp(prefix="peer_step_")
  try:
    out = compile_fn(dump)
    live = xla_dump.live_at_peak(dump)
  finally:
    shutil.rmtree(dump, ignore_errors=True)
  m = out.memory
  return dict(step=name, arguments=m["arguments"], temporaries=m["temporaries"],
              total=m["arguments"] + m["temporaries"], host_arguments=m["host_arguments"],
              compile_seconds=round(m["seconds"], 1),
              live_at_peak=[dict(shape=shape, bytes=size) for size, shape, _ in live[:TOP]],
              hlo_flops=hlo_flops(out.hlo), model_flops=model_flops)


def both_steps(config, spec) -> list[dict]:
  """The peer's row and zerojax's, compiled for `spec` with `config`'s XLA flags."""
  built = build.build(config)
  options = gpu_compile.profile_options(config)  # One flag profile for both.
  jitted, args, peer_model = peer_step(config, built.mesh, built.abstract_batch)
  t = config.train
  tokens = t.global_batch_size * t.seq_len / spec.devices  # A device's, a step.
  peer = measure(PEER, lambda dump: gpu_compile.compile_jitted(
      jitted, args, built.mesh, spec, options, dump_to=dump),
      peer_model.flops_per_token(t.seq_len) * tokens)
  ours = measure("zerojax", lambda dump: gpu_compile.compile_step(
      built, config, spec, dump_to=dump), built.model.flops_per_token(t.seq_len) * tokens)
  return [peer, ours]


def table(rows: list[dict]) -> str:
  """The rows as a markdown table."""
  size = lambda n: f"{n / 1e9:.2f} GB ({fmt_bytes(n)})"  # noqa: E731
  lines = ["| step | arguments | temporaries | total | largest live at the peak | "
           "compiled TFLOP a device | model TFLOP a device | compiled / model |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    live = "; ".join(f"{b['shape']} {b['bytes'] / 1e9:.3g} GB" for b in r["live_at_peak"][:4])
    lines.append(f"| {r['step']} | {size(r['arguments'])} | {size(r['temporaries'])} | "
                 f"{size(r['total'])} | {live} | {r['hlo_flops'] / 1e12:.4g} | "
                 f"{r['model_flops'] / 1e12:.4g} | {r['hlo_flops'] / r['model_flops']:.3f} |")
  return "\n".join(lines)


def revision() -> str:
  """The checkout's commit, with '+changes' where zerojax/ or configs/ differ from it
  (the numbers are of the code that ran); '' outside a git checkout."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True,  # noqa: E731
                                  text=True, check=False).stdout.strip()
  head = git("rev-parse", "--short=12", "HEAD")
  return head + ("+changes" if head and git("status", "--porcelain", "zerojax", "configs")
                 else "")


def save(path: str, key: str, record: dict) -> None:
  """`record` as `path`'s entry `key`, the file's other runs kept."""
  runs = {}
  if os.path.exists(path):
    with open(path) as f:
      runs = json.load(f)
  runs[key] = record
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(runs, f, indent=1, sort_keys=True)
    f.write("\n")


@exit_on_config_error
def main(argv: list[str] | None = None) -> dict:
  """Compiles both steps, prints the table, saves the record to --out; returns it."""
  argv = sys.argv[1:] if argv is None else argv
  path, overrides, rest = parse_argv(argv, default=DEFAULT_CONFIG)
  p = ArgumentParser(prog="python benchmarks/peer_step.py", description=__doc__.splitlines()[0],
                     default_config=DEFAULT_CONFIG)
  p.add_argument("--target", default="h100:8", help="the GPU target (default h100:8)")
  p.add_argument("--out", default=DEFAULT_OUT, help="the JSON file the record goes into")
  args = p.parse_args(rest)
  spec = targets.parse(args.target)
  gpu_compile.prepare(spec.devices)  # Before JAX starts a backend.
  config = load_config(path, overrides, num_devices=spec.devices)
  rows = both_steps(config, spec)
  print(f"{' '.join([path, *overrides])} on {spec}: XLA's GPU compiler, a device's bytes "
        "and FLOPs a step\n")
  print(table(rows))
  record = dict(command=" ".join(["python benchmarks/peer_step.py", *argv]), config=path,
                overrides=overrides, target=str(spec), digest=digest(config),
                jax=jax.__version__, commit=revision(), steps=rows)
  save(args.out, " ".join([path, *overrides, str(spec)]), record)
  return record


if __name__ == "__main__":
  main()
