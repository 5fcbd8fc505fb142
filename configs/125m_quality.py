"""A 113.7M-param Llama on the stdlib bytes: the quality benchmark's model (issue 15).

    python benchmarks/quality.py                    # one GPU: the five arms, 2 seeds
    python train.py --config configs/125m_quality.py    # one run of the default recipe
    python -m zerojax.memory --config configs/125m_quality.py --target h200:1 --compile

GPT-2-small's width and depth (d_model 768, 12 layers, 12 heads) with a byte
vocabulary, so nearly every parameter is in the blocks: 113.7M with d_ff 3072 (SwiGLU).
Hardware: one GPU; 8 x 256 tokens per step, about one pass over the 4 MiB corpus in
2,000 steps. bf16 params + Kahan AdamW with bf16 state (the library's recipe);
benchmarks/quality.py sets each arm's precision keys.
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.name = "llama"
  c.model.d_model = 768
  c.model.n_layers = 12
  c.model.n_heads = 12
  c.model.n_kv_heads = 12
  c.model.d_ff = 3072
  c.model.attention_block = 256  # One block at this length.
  c.model.loss_chunk = 256
  c.model.remat = "none"  # Small: every activation fits.
  c.train.seq_len = 256
  c.train.global_batch_size = 8
  c.train.steps = 2000
  c.train.log_every = 100
  c.train.eval_every = 250
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 100
  return c
