"""Fine-tuning quick start: the tiny Llama on generated instructions, on a CPU.

    python train.py --config configs/sft_tiny.py
    python train.py --config configs/sft_tiny.py --config.data.pack=False --workdir runs/sft

Data: `zerojax.sft_demo` writes 20,000 {prompt, completion} tasks (sums and differences of
two numbers below 100, reversing or sorting a short word), 200 held-out prompts not in
them and a byte-level tokenizer into <tmp>/zerojax-sft-tiny-v1 the first time this file
is read; nothing is downloaded. The loss is on the completions only, examples packed
into rows of 128 tokens; the held-out loss is the completions' loss.
"""

import os
import tempfile

import ml_collections

from zerojax import sft_demo
from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()  # Every key and its default; only values change here.
  paths = sft_demo.write(os.path.join(tempfile.gettempdir(), "zerojax-sft-tiny-v1"))
  c.data.name = "sft"
  c.data.path = paths["train"]
  c.data.eval_path = paths["eval"]
  c.data.tokenizer = paths["tokenizer"]
  c.model.name = "llama"
  c.model.vocab_size = 264  # 256 bytes + 5 special tokens, rounded up to a multiple of 8.
  c.model.d_model = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.d_ff = 384
  c.model.attention_block = 128  # One block at this length.
  c.model.loss_chunk = 128
  c.model.remat = "dots"  # Small enough to keep matmul outputs.
  c.train.seq_len = 128  # About 8 examples per row.
  c.train.global_batch_size = 16  # Divisible by 1, 2, 4, 8 and 16 devices.
  c.train.steps = 600
  c.train.log_every = 50
  c.train.eval_every = 100
  c.train.eval_batches = 2  # 32 rows: the 200 held-out examples, about once.
  c.train.eval_exact_match = 200  # Greedy answers to the held-out prompts, exact or not.
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  return c
