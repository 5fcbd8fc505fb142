"""Quick start: a small Llama on the bytes of Python's standard library, on a CPU.

    python train.py --config configs/tiny.py
    python train.py --config configs/tiny.py --config.zero.stage=2 --workdir runs/tiny

Hardware: any CPU (2 cores: under 8 minutes; 7.7 measured on a busy machine).
Data: embedded, nothing downloaded.
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()  # Every key and its default; only values change here.
  c.model.name = "llama"
  c.model.d_model = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.d_ff = 384
  c.model.attention_block = 128  # One block at this length.
  c.model.loss_chunk = 128
  c.model.remat = "dots"  # Small enough to keep matmul outputs.
  c.train.seq_len = 128
  c.train.global_batch_size = 16  # Divisible by 1, 2, 4, 8 and 16 devices.
  c.train.steps = 600
  c.train.log_every = 50
  c.train.eval_every = 200
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  return c
