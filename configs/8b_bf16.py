"""Llama-3-8B shape: bf16 params, Kahan-compensated AdamW with bf16 state, ZeRO-3.

    python train.py --config configs/8b_bf16.py --config.data.name=tokens --config.data.path=...
    python train.py --config configs/8b_bf16.py --dry_run --fake_devices 8   # compile only
    python -m zerojax.memory --config configs/8b_bf16.py --target h100:8 --compile
    python train.py --config configs/8b_bf16.py --config.init_from=Meta-Llama-3.1-8B ...

init_from: a Hugging Face Llama folder (config.json + safetensors) to fine-tune from.
The model section must match its config.json (it does for Llama 3.1 8B; a mismatch is
an error listing the keys and the overrides that fix them). Export back with
`python -m zerojax.hf.export --workdir runs/x --out DIR`.

Hardware: 8 GPUs of 80 GB (one 4096-token sequence per device and step).
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.model.name = "llama"
  c.model.vocab_size = 128256
  c.model.d_model = 4096
  c.model.n_layers = 32
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.d_ff = 14336
  c.model.rope_theta = 500000.0
  c.model.rope_scaling_factor = 8.0  # Llama 3.1 long-context frequencies.
  c.model.remat = "full"
  # Positions a loss chunk: with the vocabulary sharded (zero.vocab_parallel) its backward
  # holds the chunk's fp32 logits and their gradient, two where a gathered head held one.
  c.model.loss_chunk = 512
  c.precision.param_dtype = "bfloat16"
  c.optimizer.state_dtype = "bfloat16"
  c.optimizer.update_rule = "kahan"
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  c.zero.stage = 3
  c.train.seq_len = 4096
  c.train.global_batch_size = 8  # One sequence per device on 8 devices.
  c.train.steps = 100_000
  c.train.log_every = 10
  c.train.eval_every = 1000
  return c
