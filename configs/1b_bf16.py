"""Llama-3.2-1B shape (tied embeddings): bf16 params, Kahan AdamW with bf16 state, ZeRO-2.

    python train.py --config configs/1b_bf16.py --config.data.name=tokens --config.data.path=...
    python train.py --config configs/1b_bf16.py --dry_run --fake_devices 8   # compile only
    python -m zerojax.memory --config configs/1b_bf16.py --target h200:1 --compile

Hardware: one GPU of 24 GB or more: 8 x 4096 tokens per step measured 21.9 GiB on one
H200 with remat full (44 GiB with remat dots, which was also slower there:
benchmarks/README.md, gpu.sh). Stage 2 shards gradients and optimizer state when there
are several. `python -m zerojax.memory --config configs/1b_bf16.py --devices 1
--device-memory 24GiB` checks another card.
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.name = "llama"
  c.model.vocab_size = 128256
  c.model.d_model = 2048
  c.model.n_layers = 16
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.d_ff = 8192
  c.model.rope_theta = 500000.0
  c.model.rope_scaling_factor = 32.0  # Llama 3.2 long-context frequencies.
  c.model.tie_embeddings = True
  c.model.remat = "full"  # Fits 24 GB, and was faster than dots on an H200.
  c.precision.param_dtype = "bfloat16"
  c.optimizer.state_dtype = "bfloat16"
  c.optimizer.update_rule = "kahan"
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 1000
  c.zero.stage = 2
  c.train.seq_len = 4096
  c.train.global_batch_size = 8
  c.train.steps = 100_000
  c.train.log_every = 10
  c.train.eval_every = 1000
  return c
