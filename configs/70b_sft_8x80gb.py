"""Llama-3-70B chat / instruction fine-tune on one node of 8 x 80 GB: packed SFT rows
under gradient release.

    python train.py --config configs/70b_sft_8x80gb.py --config.init_from=/models/Llama-70B \
        --config.data.path=chats.jsonl --config.data.tokenizer=/models/Llama-70B/tokenizer.json \
        --workdir runs/sft70b
    python train.py --config configs/70b_sft_8x80gb.py --dry_run --target h100:8   # compile only

`configs/70b_8x80gb.py` (Lion + Kahan, gradient release, ZeRO-3, remat 'full', 4096
tokens a device, global batch 8) on fine-tuning data (`data.name='sft'`): JSONL lines of
{"messages": [...]} (rendered with the tokenizer folder's chat template, the loss on the
assistant turns) or {"prompt", "completion"}. Examples are packed into the 4096-token
rows (`data.pack`: segment ids keep attention inside each example and positions restart
at 0), which every layer of release's backward pass reads; on chats of a few hundred
tokens a padded row would be mostly padding (`benchmarks/sft_packing.py` measures it).
Without `data.path`, the generated demo tasks of `configs/sft_tiny.py` (no download), so
the dry run needs nothing.

Compiled by XLA's GPU compiler for 8 x H100 80GB (`--dry_run --target h100:8`, no GPU
needed, nothing allocated; the `gpu-compile` extra): 49.28 GiB of state + 12.84 GiB of
temporaries = 62.13 GiB a device (the tokens-only recipe: 62.09), where XLA's allocator
has 74.72 GiB of an H100 as train.py runs it; the planner's estimate 63.98 GiB (1.03).
"""

import os
import tempfile

import ml_collections

from zerojax.config import load_config
from zerojax.data import sft_demo

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "70b_8x80gb.py")


def get_config() -> ml_collections.ConfigDict:
  c = load_config(RECIPE)  # The 70B recipe; the data and the schedule change here.
  demo = sft_demo.write(os.path.join(tempfile.gettempdir(), "zerojax-sft-tiny-v1"))
  c.data.name = "sft"
  c.data.path = demo["train"]  # Your chats.jsonl: {"messages": [...]} lines.
  c.data.eval_path = demo["eval"]  # "" = the last data.eval_fraction of data.path.
  c.data.tokenizer = demo["tokenizer"]  # The model's tokenizer.json (chat template beside).
  c.data.pack = True  # Several examples a row: release reads segment ids in every layer.
  c.data.train_on = "completion"  # The loss on completions / assistant turns only.
  c.optimizer.learning_rate = 1e-5  # Lion for fine-tuning: well below pre-training's.
  c.optimizer.warmup_steps = 50
  c.train.steps = 1000
  c.train.eval_every = 100
  return c
