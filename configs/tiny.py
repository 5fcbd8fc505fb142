"""Quick start: a 2-layer MLP language model on stdlib bytes, under a minute on 2 CPU cores.

    python train.py --config configs/tiny.py
    python train.py --config configs/tiny.py --config.zero.stage=2 --config.train.steps=50
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()  # Every key and its default; only values change here.
  c.model.d_model = 64
  c.model.d_ff = 256
  c.model.n_layers = 2
  c.train.seq_len = 64
  c.train.global_batch_size = 16  # Divisible by 1, 2, 4, 8 and 16 devices.
  c.train.steps = 100
  c.train.log_every = 10
  c.train.eval_every = 50
  return c
