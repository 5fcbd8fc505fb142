"""Fine-tuning quick start: the tiny Llama on generated instructions, on a CPU.

    python train.py --config configs/sft_tiny.py
    python train.py --config configs/sft_tiny.py --config.data.pack=False --workdir runs/sft

Data: `zerojax.data.sft_demo` writes 20,000 {prompt, completion} tasks (sums and differences of
two numbers below 100, reversing or sorting a short word), 200 held-out prompts not in
them and a byte-level tokenizer into <tmp>/zerojax-sft-tiny-v1 the first time this file
is read; nothing is downloaded. The model, optimizer, batch and steps are
configs/tiny.py's; the loss is on the completions only, examples packed into rows of 128
tokens; each evaluation reports the completions' loss and the share of held-out prompts
answered exactly by greedy decoding.
"""

import os
import tempfile

import ml_collections

from zerojax.config import load_config
from zerojax.data import sft_demo

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")


def get_config() -> ml_collections.ConfigDict:
  c = load_config(TINY)  # The quick start; only the data and evaluation change here.
  paths = sft_demo.write(os.path.join(tempfile.gettempdir(), "zerojax-sft-tiny-v1"))
  c.data.name = "sft"
  c.data.path = paths["train"]
  c.data.eval_path = paths["eval"]
  c.data.tokenizer = paths["tokenizer"]
  c.model.vocab_size = 264  # 256 bytes + 5 special tokens, rounded up to a multiple of 8.
  c.train.eval_every = 100
  c.train.eval_batches = 2  # 32 rows of about 8 examples: the 200 held-out ones, about once.
  c.train.eval_exact_match = 200  # Greedy answers to the held-out prompts, exact or not.
  return c
