"""Llama-3-70B shape: bf16 params, Kahan-compensated AdamW with bf16 state, ZeRO-3.

    python train.py --config configs/70b_bf16.py --config.data.name=tokens --config.data.path=...
    python train.py --config configs/70b_bf16.py --dry_run --fake_devices 64   # compile only

Hardware: 64 GPUs of 80 GB (one 4096-token sequence per device and step: 28.42 GiB per
device compiled for 64 x H100 by XLA's GPU compiler, `python -m zerojax.memory --config
configs/70b_bf16.py --target h100:64 --compile`), or 16 with
`--config.train.global_batch_size=16` (62.69 GiB on 16 x H100). Model
state is 8 bytes per parameter (bf16 params, mu, nu and Kahan buffer) plus one fp32
gradient shard (reduce-scattered per layer); microbatches add an fp32 accumulator.
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.name = "llama"
  c.model.vocab_size = 128256
  c.model.d_model = 8192
  c.model.n_layers = 80
  c.model.n_heads = 64
  c.model.n_kv_heads = 8
  c.model.d_ff = 28672
  c.model.rope_theta = 500000.0
  c.model.rope_scaling_factor = 8.0  # Llama 3.1 long-context frequencies.
  c.model.norm_eps = 1e-5
  c.model.remat = "full"
  c.model.attention_block = 512
  # Positions a loss chunk: with the vocabulary sharded (zero.vocab_parallel) its backward
  # holds the chunk's fp32 logits and their gradient, two where a gathered head held one.
  c.model.loss_chunk = 512
  c.precision.param_dtype = "bfloat16"
  c.precision.compute_dtype = "bfloat16"
  c.optimizer.name = "adamw"
  c.optimizer.state_dtype = "bfloat16"
  c.optimizer.update_rule = "kahan"
  c.optimizer.learning_rate = 1.5e-4
  c.optimizer.warmup_steps = 2000
  c.optimizer.b2 = 0.95
  c.zero.stage = 3
  c.train.seq_len = 4096
  c.train.global_batch_size = 64  # One sequence per device on 64 devices.
  c.train.steps = 100_000
  c.train.log_every = 10
  c.train.eval_every = 1000
  return c
