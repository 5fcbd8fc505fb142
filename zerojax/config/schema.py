"""The config schema: every key zerojax knows, once, with its default, choices, range and help.

`base_config()` builds the default config from this table; config files start from it
and change values, and `zerojax.config.checks` checks any config against it. Adding a
key is one row here (and the code that reads it). The type of a key is its default's.

    python -m zerojax.config --keys    # this table, as the user sees it
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections


class Range(NamedTuple):
  """A value check beyond type and choices: `test(value)` must hold; `text` says what it wants."""
  test: Callable[[Any], bool]
  text: str


class Field(NamedTuple):
  """One config key: dotted `key`, `default` (whose type is the key's), one-line `help`."""
  key: str
  default: Any
  help: str
  choices: tuple[Any, ...] | None = None
  range: Range | None = None


POSITIVE = Range(lambda v: v > 0, "> 0")
NON_NEGATIVE = Range(lambda v: v >= 0, ">= 0")
AT_LEAST_1 = Range(lambda v: v >= 1, ">= 1")
UNIT = Range(lambda v: 0 <= v < 1, "in [0, 1)")
MESH_SIZE = Range(lambda v: v > 0 or v == -1, "a positive size, or -1 for the devices left over")
DTYPES = ("float32", "bfloat16")  # Reductions, accumulation and optimizer state.
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # Params and compute; float16 adds loss scaling.

# Groups of keys, each with a line saying what it is for (in the order printed).
GROUPS: dict[str, str] = {
    "mesh": "The device mesh: axes ('data', 'fsdp').",
    "distributed": "Multi-host (jax.distributed); nothing set and no cluster detected = one "
                   "process.",
    "zero": "What ZeRO shards.",
    "precision": "Dtypes of params, compute, reductions; non-finite steps.",
    "precision.loss_scale": "Dynamic loss scaling, used with float16 only.",
    "optimizer": "The optimizer, its state dtype, update rule and schedule.",
    "train": "Steps, batch, sequence length, logging and evaluation.",
    "checkpoint": "Only when workdir is set: <workdir>/checkpoints.",
    "model": "The model family and its shape (Llama keys follow Hugging Face's config.json).",
    "data": "Where tokens come from.",
    "logging": "Metrics writers beside <workdir>/metrics.jsonl (process 0 only).",
    "logging.wandb": "Weights & Biases (pip install -e \".[wandb]\"); off while project is \"\".",
    "xla": "XLA compiler settings (python -m zerojax.gpu.xla_flags --config F prints them).",
}

_ROWS = (
    Field("seed", 0, "PRNG seed for parameter init, data order and dropout.", range=NON_NEGATIVE),
    Field("workdir", "", 'Where logs and checkpoints go; "" = do not write.'),
    Field("init_from", "", "A Hugging Face Llama folder to start from (model.* must match its "
          "config.json); a resumed checkpoint wins."),
    # mesh
    Field("mesh.data", 1, "Replicas ('data' axis); -1 = the devices left over.", range=MESH_SIZE),
    Field("mesh.fsdp", -1, "Devices the ZeRO state is sharded over ('fsdp' axis) besides 'expert'; "
          "-1 = the rest.", range=MESH_SIZE),
    Field("mesh.expert", 1, "Devices the experts are split over ('expert' axis: expert "
          "parallelism, all-to-all inside each MoE block); divides model.n_experts. The "
          "other params are ZeRO-sharded over it too; -1 = the rest.", range=MESH_SIZE),
    Field("mesh.sequence_parallel", False, "Split each sequence over the 'fsdp' devices by "
          "position (Ulysses attention: all-to-all to whole sequences for a share of the "
          "heads), the examples over 'data' only; llama, fsdp must divide n_heads and "
          "train.seq_len."),
    # distributed
    Field("distributed.coordinator_address", "", 'host:port of process 0; "" = '
          "$JAX_COORDINATOR_ADDRESS, else SLURM / Open MPI / k8s detection."),
    Field("distributed.num_processes", 0, "Processes in the run; 0 = $ZEROJAX_NUM_PROCESSES, else "
          "detected, else 1.",
          range=Range(lambda v: v >= 0, ">= 0 (0 = $ZEROJAX_NUM_PROCESSES or detected)")),
    Field("distributed.process_id", -1, "This process's id, 0..num_processes-1; -1 = "
          "$ZEROJAX_PROCESS_ID, else detected.",
          range=Range(lambda v: v >= -1, "an id >= 0, or -1 for $ZEROJAX_PROCESS_ID or detected")),
    Field("distributed.local_device_ids", "", 'Devices this process uses: "0,1,..."; "all"; "" = '
          "JAX's choice (SLURM / Open MPI: the local rank's GPU)."),
    Field("distributed.initialization_timeout", 300, "Seconds for every process to join; then each "
          "exits with status 4 and a message.", range=POSITIVE),
    Field("distributed.wait_report_every", 30, "While the processes join: seconds between lines "
          "saying what is awaited.", range=POSITIVE),
    Field("distributed.heartbeat_timeout", 100, "Seconds without heartbeats before a process "
          "counts as dead and JAX aborts the others.", range=POSITIVE),
    Field("distributed.shutdown_timeout", 300, "Seconds a finishing process waits at exit for the "
          "others to finish too.", range=POSITIVE),
    # zero
    Field("zero.stage", 3, "0: plain data parallel, 1: +optimizer state sharded, 2: +gradients, "
          "3: +params.", choices=(0, 1, 2, 3)),
    Field("zero.param_offload", "none", "'host' (stage 3): the layer-stacked parameter shards "
          "live in pinned host memory; each layer comes to the device one layer ahead of its "
          "use (with release, its update goes straight back).", choices=("none", "host")),
    Field("zero.min_shard_size", 4096, "Leaves with fewer elements stay replicated (DeepSpeed's "
          "persistence threshold).", range=NON_NEGATIVE),
    Field("zero.vocab_parallel", True, "Stage 3: the embedding and head stay sharded by "
          "vocabulary rows, used in place, where the tokens a microbatch gathers over the "
          "shards are fewer than the vocabulary (their activations travel instead: "
          "zerojax.vocab): no whole vocabulary leaf or gradient on a device."),
    # precision
    Field("precision.param_dtype", "bfloat16", "Stored parameters.", choices=PARAM_DTYPES),
    Field("precision.compute_dtype", "bfloat16", "Activations and matmuls.", choices=PARAM_DTYPES),
    Field("precision.reduce_dtype", "float32", "Cross-device gradient reductions.", choices=DTYPES),
    Field("precision.accum_dtype", "float32", "Gradient accumulation over microbatches.",
          choices=DTYPES),
    Field("precision.upcast_params", "none", "Params the model sees in reduce_dtype (values "
          "unchanged, cast at each matmul), so their weight gradients are never rounded to "
          "param_dtype: 'gathered' (stage 3's layer stacks, a layer at a time: within 0.5 GiB "
          "at 70B), 'all' (every param: whole fp32 gradients, +8.1 GiB a device for the 70B "
          "on 8 x H100) or 'none'.", choices=("none", "gathered", "all")),
    Field("precision.max_consecutive_skips", 10, "Stop after this many non-finite steps in a row; "
          "0 = never.", range=NON_NEGATIVE),
    Field("precision.loss_scale.initial_power", 16, "The first scale is 2**initial_power.",
          range=Range(lambda v: 0 <= v <= 40, "in [0, 40]")),
    Field("precision.loss_scale.window", 1000, "Finite steps in a row before the scale doubles.",
          range=AT_LEAST_1),
    Field("precision.loss_scale.hysteresis", 2, "Overflows in a row tolerated before it halves.",
          range=AT_LEAST_1),
    Field("precision.loss_scale.min_scale", 1.0, "The scale never goes below this.",
          range=POSITIVE),
    # optimizer
    Field("optimizer.name", "adamw", "The optimizer.", choices=("adamw", "lion", "sgd")),
    Field("optimizer.state_dtype", "bfloat16", "Every moment (Adam's mu and nu too).",
          choices=DTYPES),
    Field("optimizer.update_rule", "kahan", "How updates land on low-precision params.",
          choices=("nearest", "kahan", "stochastic", "master")),
    Field("optimizer.learning_rate", 3e-3, "Peak learning rate.", range=POSITIVE),
    Field("optimizer.schedule", "cosine", "Decay after warmup.",
          choices=("constant", "cosine", "linear")),
    Field("optimizer.warmup_steps", 20, "Linear warmup from 0 to the peak.", range=NON_NEGATIVE),
    Field("optimizer.min_lr_ratio", 0.1, "Final learning rate as a fraction of the peak (cosine, "
          "linear).", range=Range(lambda v: 0 <= v <= 1, "in [0, 1]")),
    Field("optimizer.b1", 0.9, "AdamW first-moment decay; Lion's interpolation.", range=UNIT),
    Field("optimizer.b2", 0.95, "AdamW second-moment decay; Lion's momentum decay.", range=UNIT),
    Field("optimizer.eps", 1e-8, "AdamW epsilon.", range=POSITIVE),
    Field("optimizer.weight_decay", 0.1, "Decoupled weight decay (AdamW) or L2 (sgd).",
          range=NON_NEGATIVE),
    Field("optimizer.momentum", 0.9, "SGD momentum; 0 disables it.", range=UNIT),
    Field("optimizer.nesterov", False, "SGD Nesterov momentum."),
    Field("optimizer.grad_clip", 1.0, "Clip the global gradient norm (fp32) to this; 0 disables.",
          range=NON_NEGATIVE),
    Field("optimizer.release", False, "Gradient release: each layer is updated inside the "
          "backward pass, so no fp32 gradient of the layer stack exists (zero.stage 3, "
          "microbatches > 1 and grad_clip > 0 need the two keys below)."),
    Field("optimizer.release_accumulation", "none", "With release and microbatches > 1: "
          "'optimizer' = the moments absorb each microbatch's gradient, the params move "
          "once per step (approximates gradient accumulation; adamw, lion).",
          choices=("none", "optimizer")),
    Field("optimizer.release_clipping", "none", "With release and grad_clip > 0: "
          "'previous_norm' = clip by the previous step's global norm (step 1 unclipped), "
          "'per_layer' = clip each layer's gradient to grad_clip by its own norm.",
          choices=("none", "previous_norm", "per_layer")),
    Field("optimizer.release_write_behind", False, "With release and a layer stack in host "
          "memory (zero.param_offload or optimizer.offload), on a GPU: each layer's update "
          "goes back to host memory under the next layer's backward matmuls, not after its "
          "own, and the reads ahead under its recompute (one more layer of params and state "
          "on the device; XLA may keep 32 host copies in flight). The same step."),
    Field("optimizer.release_writes_first", False, "With release_write_behind: each trip "
          "writes the carried update first, under the layer's recompute, and reads the next "
          "layer after it, under the backward matmuls: the update leaves the device before "
          "the backward pass (less device memory; the dry run's timed schedule says which "
          "order hides more of the copies). The same step."),
    Field("optimizer.offload", "none", "'host': the moments and Kahan / master buffers live "
          "in pinned host memory, streamed to the device one layer at a time for the update.",
          choices=("none", "host")),
    # train
    Field("train.steps", 200, "Optimizer steps.", range=POSITIVE),
    Field("train.global_batch_size", 16, "Sequences per optimizer step, over all devices and "
          "microbatches.", range=POSITIVE),
    Field("train.microbatches", 1, "Gradient accumulation steps per optimizer step.",
          range=AT_LEAST_1),
    Field("train.seq_len", 128, "Tokens per sequence.", range=POSITIVE),
    Field("train.log_every", 10, "Print metrics every this many steps.", range=POSITIVE),
    Field("train.eval_every", 50, "Held-out loss every this many steps, before the first "
          "and after the last; 0: only before the first and after the last.",
          range=NON_NEGATIVE),
    Field("train.eval_batches", 4, "Held-out batches per evaluation.", range=AT_LEAST_1),
    Field("train.eval_exact_match", 0, "sft: at each evaluation, greedy-decode this many held-out "
          "prompts and report the share answered exactly; 0 = off.", range=NON_NEGATIVE),
    Field("train.step_timeout", 0.0, "Seconds without progress (a step, an evaluation, a save) "
          "after which a process prints every thread's stack and every process exits 7; 0 = "
          "10 x the median of the first 5 steps, at least 300.", range=NON_NEGATIVE),
    Field("train.peak_flops", 0.0, "Peak FLOP/s of one device, for MFU; 0 = from the device kind "
          "(none on CPU).", range=NON_NEGATIVE),
    # checkpoint
    Field("checkpoint.every_steps", 100, "Save every this many steps; 0 = not by step.",
          range=NON_NEGATIVE),
    Field("checkpoint.every_minutes", 0.0, "Also save once this many minutes passed since the last "
          "save; 0 = off.", range=NON_NEGATIVE),
    Field("checkpoint.keep", 3, "Keep the newest this many; 0 = all.", range=NON_NEGATIVE),
    Field("checkpoint.keep_every", 0, "Also keep steps that are multiples of this, forever; "
          "0 = none.", range=NON_NEGATIVE),
    Field("checkpoint.async_save", True, "Write in the background while training goes on."),
    # model
    Field("model.name", "llama", "Model family (mlp_lm: a small scanned MLP LM, for tests).",
          choices=("llama", "mlp_lm")),
    Field("model.vocab_size", 256, "Token vocabulary (256 = bytes).", range=POSITIVE),
    Field("model.d_model", 128, "Residual stream width.", range=POSITIVE),
    Field("model.d_ff", 384, "Hidden width of each MLP block.", range=POSITIVE),
    Field("model.n_layers", 4, "Blocks, run under nn.scan / lax.scan.", range=POSITIVE),
    Field("model.n_heads", 4, "llama: query heads.", range=POSITIVE),
    Field("model.n_kv_heads", 2, "llama: key/value heads (grouped-query attention; divides "
          "n_heads).", range=POSITIVE),
    Field("model.rope_theta", 500000.0, "llama: rotary base frequency.", range=POSITIVE),
    Field("model.rope_scaling_factor", 0.0, "llama: Llama 3.1 RoPE scaling factor; 0 = off.",
          range=NON_NEGATIVE),
    Field("model.rope_low_freq_factor", 1.0, "llama: Llama 3.1 scaling, low-frequency factor.",
          range=POSITIVE),
    Field("model.rope_high_freq_factor", 4.0, "llama: Llama 3.1 scaling, high-frequency factor.",
          range=POSITIVE),
    Field("model.rope_original_context", 8192, "llama: Llama 3.1 scaling, original max positions.",
          range=POSITIVE),
    Field("model.norm_eps", 1e-5, "llama: RMSNorm epsilon.", range=POSITIVE),
    Field("model.tie_embeddings", False, "llama: output head shares the embedding matrix."),
    Field("model.family", "llama", "llama: the Hugging Face family (what export writes; import "
          "sets it); its differences are the keys below (zerojax/models/llama.py).",
          choices=("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "mixtral")),
    Field("model.head_size", 0, "llama: head dimension when not d_model / n_heads (HF's "
          "head_dim: Qwen3, Gemma 3); 0 = d_model / n_heads.", range=NON_NEGATIVE),
    Field("model.qkv_bias", False, "llama: q, k, v projections with biases (Qwen2)."),
    Field("model.qk_norm", False, "llama: RMSNorm of each query and key head (Qwen3, Gemma 3)."),
    Field("model.norm_offset", 0.0, "llama: norms multiply by (norm_offset + scale) (Gemma: 1).",
          range=NON_NEGATIVE),
    Field("model.scale_embeddings", False, "llama: embedding output times sqrt(d_model) (Gemma)."),
    Field("model.hidden_act", "silu", "llama: MLP gate activation: silu (SwiGLU) or gelu_tanh "
          "(GeGLU, Gemma).", choices=("silu", "gelu_tanh")),
    Field("model.post_norms", False, "llama: norms on each sublayer's output too, and a "
          "pre-feed-forward norm (Gemma)."),
    Field("model.query_pre_attn_scalar", 0, "llama: attention scores times its -1/2 power "
          "(Gemma 3); 0 = head dimension.", range=NON_NEGATIVE),
    Field("model.sliding_window", 0, "llama: local layers attend to this many latest positions; "
          "0 = every layer global.", range=NON_NEGATIVE),
    Field("model.sliding_window_pattern", 0, "llama: 0 = every layer local (with a window); P = "
          "layer i global when (i + 1) % P == 0 (Gemma 3: 6).", range=NON_NEGATIVE),
    Field("model.rope_local_theta", 0.0, "llama: local layers' own RoPE base, unscaled "
          "(Gemma 3: 10000); 0 = the global RoPE.", range=NON_NEGATIVE),
    Field("model.n_experts", 0, "llama: E > 0: every layer's MLP is a mixture of E experts "
          "(Qwen3-MoE, Mixtral); 0 = dense.", range=NON_NEGATIVE),
    Field("model.experts_per_token", 0, "llama: k, the experts a token is routed to.",
          range=NON_NEGATIVE),
    Field("model.expert_d_ff", 0, "llama: each expert's hidden width (HF's "
          "moe_intermediate_size).", range=NON_NEGATIVE),
    Field("model.norm_topk_prob", True, "llama: the k routing weights renormalized to sum to 1 "
          "(Mixtral; Qwen3-MoE's option)."),
    Field("model.router_aux_loss_coef", 0.001, "llama: the load-balancing loss's weight in the "
          "training loss (with experts; HF's default).", range=NON_NEGATIVE),
    Field("model.router_z_loss_coef", 0.0, "llama: the router z-loss's weight (with experts).",
          range=NON_NEGATIVE),
    Field("model.expert_capacity_factor", 0.0, "llama: 0 = dropless dispatch; c > 0 = each "
          "expert (mesh.expert=1), or each expert-parallel device (mesh.expert=ep > 1), takes "
          "at most ceil(c N k / E), or ceil(c N k / ep), of a device's N tokens' "
          "assignments: c times a balanced router's share; the rest are dropped and counted "
          "(moe/dropped_tokens).", range=NON_NEGATIVE),
    Field("model.rope_scaling_type", "llama3", "llama: RoPE scaling when rope_scaling_factor is "
          "set: llama3 (Llama 3.1) or linear (Gemma 3's global layers).",
          choices=("llama3", "linear")),
    Field("model.attention", "auto", "llama: auto (dot_product on GPU in bf16/fp16, else blocked), "
          "blocked (query blocks, recomputed), dot_product (cuDNN on GPU).",
          choices=("auto", "blocked", "dot_product")),
    Field("model.attention_block", 512, "llama: query positions per attention block.",
          range=POSITIVE),
    Field("model.loss_chunk", 1024, "llama: sequence positions per loss chunk (fp32 logits; "
          "with the vocabulary sharded, zero.vocab_parallel, their gradient beside them).",
          range=POSITIVE),
    Field("model.activation_offload", "none", "llama: 'host' = what remat saves per layer "
          "(the layer inputs) lives in pinned host memory between the passes, back one layer "
          "ahead in the backward pass (zerojax/streaming/).", choices=("none", "host")),
    Field("model.mlp_chunk", 0, "llama: sequence positions per MLP tile (temporaries of "
          "[chunk, d_ff], not [seq_len, d_ff]); 0 = untiled.", range=NON_NEGATIVE),
    Field("model.context", 8, "mlp_lm: previous tokens each position mixes in.", range=AT_LEAST_1),
    Field("model.remat", "full", "Backward-pass recompute per layer: none, full (keep layer "
          "inputs), dots (keep matmul outputs); llama also by name (zerojax/models/remat.py): "
          "minimal, save_dot_with_context_except_mlp, save_dot_except_mlp, save_qkv_proj, "
          "save_attention_out.", choices=("none", "full", "dots", "minimal",
                                          "save_dot_with_context_except_mlp",
                                          "save_dot_except_mlp", "save_qkv_proj",
                                          "save_attention_out")),
    # data
    Field("data.name", "stdlib", "stdlib (Python source as bytes, no download), tokens "
          "(.bin/.npy), text (.txt/.jsonl) or sft (instruction / chat .jsonl, "
          "zerojax/data/sft.py).",
          choices=("stdlib", "tokens", "text", "sft")),
    Field("data.path", "", "tokens: a .bin or .npy file of token ids; text: a .txt (one document) "
          "or .jsonl file; sft: a .jsonl of {prompt, completion} or {messages} lines."),
    Field("data.eval_path", "", 'A held-out file of the same kind; "" = hold out the last '
          "eval_fraction of data.path."),
    Field("data.dtype", "uint16", "Token id dtype of .bin files (.npy files carry their own).",
          choices=("uint16", "uint32")),
    Field("data.tokenizer", "", "text, sft: a Hugging Face tokenizer.json (pip install "
          "zerojax[text]); sft: the chat template is its tokenizer_config.json's, else Llama 3's."),
    Field("data.text_key", "text", "text, .jsonl: the field of each JSON object that holds the "
          "document."),
    Field("data.eos_id", -1, "text: id appended after every document (sft: after each "
          "completion); -1 = the tokenizer's end-of-sequence token.",
          range=Range(lambda v: v >= -1,
                      "a token id >= 0, or -1 for the tokenizer's end-of-sequence token")),
    Field("data.train_on", "completion", "sft: the loss is on completions / assistant turns "
          "only, or on all tokens.", choices=("completion", "all")),
    Field("data.add_bos", True, "sft, prompt/completion lines: start each example with the "
          "tokenizer's BOS (chat templates write their own)."),
    Field("data.add_eos", True, "sft, prompt/completion lines: end each completion with the EOS "
          "(data.eos_id), trained."),
    Field("data.pack", True, "sft: several examples per sequence (attention and positions kept "
          "apart); False = one example per sequence, padded."),
    Field("data.too_long", "truncate", "sft: examples longer than train.seq_len + 1 tokens are "
          "truncated or dropped (counted either way).", choices=("truncate", "drop")),
    Field("data.eval_fraction", 0.05, 'Share of the tokens (sft: the last examples) held out for '
          'evaluation when data.eval_path is "".',
          range=Range(lambda v: 0 < v <= 0.5, "in (0, 0.5]")),
    Field("logging.tensorboard", True, "TensorBoard event files in <workdir>/tb (tensorboardX); "
          "nothing without a workdir."),
    Field("logging.wandb.project", "", 'The W&B project; "" = no W&B. The run id is kept in '
          "<workdir>/wandb_run_id, so a resumed run appends to the same W&B run."),
    Field("logging.wandb.entity", "", 'The W&B team or user; "" = your default.'),
    Field("logging.wandb.name", "", 'The W&B run name; "" = W&B picks one.'),
    Field("logging.wandb.mode", "auto", "auto: online when the W&B server answers and an API key "
          "is set (or as $WANDB_MODE says), else offline (wandb sync uploads later).",
          choices=("auto", "online", "offline")),
    Field("xla.gpu_profile", True, "On a GPU: zerojax.gpu.xla_flags' performance flags "
          "(latency-hiding scheduler, pipelined collectives, ...); a flag set in XLA_FLAGS wins."),
)
FIELDS: dict[str, Field] = {f.key: f for f in _ROWS}


def base_config() -> ml_collections.ConfigDict:
  """A fresh, unlocked config with every key of the schema at its default."""
  config = ml_collections.ConfigDict()
  for f in _ROWS:
    *path, name = f.key.split(".")
    node = config
    for part in path:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[name] = f.default
  return config


def describe() -> str:
  """The schema as text: one line per key (default, choices, range, help), groups as headings."""
  lines, group = [], None
  for f in _ROWS:
    here = f.key.rpartition(".")[0]
    if here != group:
      group = here
      if here:
        lines.append(f"\n[{here}] {GROUPS.get(here, '')}".rstrip())
    allowed = (" | ".join(map(str, f.choices)) if f.choices else f.range.text if f.range else "")
    allowed = f"  ({allowed})" if allowed else ""
    lines.append(f"{f.key} = {f.default!r}{allowed}  # {f.help}")
  return "\n".join(lines).lstrip()
