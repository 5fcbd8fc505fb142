"""The schema: every config key zerojax knows, with its default.

Every other file in configs/ starts from `get_config()` here and changes values;
a key that is not defined here is an error, wherever it comes from.

    python train.py --config configs/base.py --config.zero.stage=2
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # PRNG seed for parameter init, data order and dropout.
  c.workdir = ""  # Where logs (and later checkpoints) go; "" = do not write.
  c.init_from = ""  # A Hugging Face Llama folder to start from (model.* must match its config.json); a resumed checkpoint wins.

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Replicas ('data' axis); -1 = the devices left over.
  c.mesh.fsdp = -1  # Devices the ZeRO state is sharded over ('fsdp' axis); -1 = the rest.

  c.distributed = ml_collections.ConfigDict()  # Multi-host (jax.distributed); nothing set and no cluster detected = one process.
  c.distributed.coordinator_address = ""  # host:port of process 0; "" = $JAX_COORDINATOR_ADDRESS, else SLURM / Open MPI / k8s detection.
  c.distributed.num_processes = 0  # Processes in the run; 0 = $ZEROJAX_NUM_PROCESSES, else detected, else 1.
  c.distributed.process_id = -1  # This process's id, 0..num_processes-1; -1 = $ZEROJAX_PROCESS_ID, else detected.
  c.distributed.local_device_ids = ""  # Devices this process uses: "0,1,..."; "all"; "" = JAX's choice (SLURM / Open MPI: the local rank's GPU).
  c.distributed.initialization_timeout = 300  # Seconds for every process to join; then each exits with status 4 and a message.
  c.distributed.wait_report_every = 30  # While the processes join: seconds between lines saying what is awaited.
  c.distributed.heartbeat_timeout = 100  # Seconds without heartbeats before a process counts as dead and JAX aborts the others.
  c.distributed.shutdown_timeout = 300  # Seconds a finishing process waits at exit for the others to finish too.

  c.zero = ml_collections.ConfigDict()
  c.zero.stage = 3  # 0: plain data parallel, 1: +optimizer state sharded, 2: +gradients, 3: +params.
  c.zero.min_shard_size = 4096  # Leaves with fewer elements stay replicated (DeepSpeed's persistence threshold).

  c.precision = ml_collections.ConfigDict()
  c.precision.param_dtype = "bfloat16"  # Stored parameters: float32 | bfloat16 | float16.
  c.precision.compute_dtype = "bfloat16"  # Activations and matmuls: float32 | bfloat16 | float16.
  c.precision.reduce_dtype = "float32"  # Cross-device gradient reductions: float32 | bfloat16.
  c.precision.accum_dtype = "float32"  # Gradient accumulation over microbatches: float32 | bfloat16.
  c.precision.max_consecutive_skips = 10  # Stop after this many non-finite steps in a row; 0 = never.
  c.precision.loss_scale = ml_collections.ConfigDict()  # Dynamic loss scaling, used with float16 only.
  c.precision.loss_scale.initial_power = 16  # The first scale is 2**initial_power.
  c.precision.loss_scale.window = 1000  # Finite steps in a row before the scale doubles.
  c.precision.loss_scale.hysteresis = 2  # Overflows in a row tolerated before it halves.
  c.precision.loss_scale.min_scale = 1.0  # The scale never goes below this.

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"  # adamw | lion | sgd.
  c.optimizer.state_dtype = "bfloat16"  # Every moment (Adam's mu and nu too): float32 | bfloat16.
  c.optimizer.update_rule = "kahan"  # How updates land on low-precision params: nearest | kahan | stochastic | master.
  c.optimizer.learning_rate = 3e-3  # Peak learning rate.
  c.optimizer.schedule = "cosine"  # constant | cosine | linear (decay after warmup).
  c.optimizer.warmup_steps = 20  # Linear warmup from 0 to the peak.
  c.optimizer.min_lr_ratio = 0.1  # Final learning rate as a fraction of the peak (cosine, linear).
  c.optimizer.b1 = 0.9  # AdamW first-moment decay; Lion's interpolation.
  c.optimizer.b2 = 0.95  # AdamW second-moment decay; Lion's momentum decay.
  c.optimizer.eps = 1e-8  # AdamW epsilon.
  c.optimizer.weight_decay = 0.1  # Decoupled weight decay (AdamW) or L2 (sgd).
  c.optimizer.momentum = 0.9  # SGD momentum; 0 disables it.
  c.optimizer.nesterov = False  # SGD Nesterov momentum.
  c.optimizer.grad_clip = 1.0  # Clip the global gradient norm (fp32) to this; 0 disables.

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200  # Optimizer steps.
  c.train.global_batch_size = 16  # Sequences per optimizer step, over all devices and microbatches.
  c.train.microbatches = 1  # Gradient accumulation steps per optimizer step.
  c.train.seq_len = 128  # Tokens per sequence.
  c.train.log_every = 10  # Print metrics every this many steps.
  c.train.eval_every = 50  # Held-out loss every this many steps; 0 disables.
  c.train.eval_batches = 4  # Held-out batches per evaluation.
  c.train.peak_flops = 0.0  # Peak FLOP/s of one device, for MFU; 0 = from the device kind (none on CPU).

  c.checkpoint = ml_collections.ConfigDict()  # Only when workdir is set: <workdir>/checkpoints.
  c.checkpoint.every_steps = 100  # Save every this many steps; 0 = not by step.
  c.checkpoint.every_minutes = 0.0  # Also save once this many minutes passed since the last save; 0 = off.
  c.checkpoint.keep = 3  # Keep the newest this many; 0 = all.
  c.checkpoint.keep_every = 0  # Also keep steps that are multiples of this, forever; 0 = none.
  c.checkpoint.async_save = True  # Write in the background while training goes on.

  c.model = ml_collections.ConfigDict()
  c.model.name = "llama"  # Model family: llama | mlp_lm (a small scanned MLP LM, for tests).
  c.model.vocab_size = 256  # Token vocabulary (256 = bytes).
  c.model.d_model = 128  # Residual stream width.
  c.model.d_ff = 384  # Hidden width of each MLP block.
  c.model.n_layers = 4  # Blocks, run under nn.scan / lax.scan.
  c.model.n_heads = 4  # llama: query heads.
  c.model.n_kv_heads = 2  # llama: key/value heads (grouped-query attention; divides n_heads).
  c.model.rope_theta = 500000.0  # llama: rotary base frequency.
  c.model.rope_scaling_factor = 0.0  # llama: Llama 3.1 RoPE scaling factor; 0 = off.
  c.model.rope_low_freq_factor = 1.0  # llama: Llama 3.1 scaling, low-frequency factor.
  c.model.rope_high_freq_factor = 4.0  # llama: Llama 3.1 scaling, high-frequency factor.
  c.model.rope_original_context = 8192  # llama: Llama 3.1 scaling, original max positions.
  c.model.norm_eps = 1e-5  # llama: RMSNorm epsilon.
  c.model.tie_embeddings = False  # llama: output head shares the embedding matrix.
  c.model.attention = "auto"  # llama: auto (dot_product on GPU in bf16/fp16, else blocked) | blocked (query blocks, recomputed) | dot_product (cuDNN on GPU).
  c.model.attention_block = 512  # llama: query positions per attention block.
  c.model.loss_chunk = 1024  # llama: sequence positions per loss chunk (fp32 logits).
  c.model.context = 8  # mlp_lm: previous tokens each position mixes in.
  c.model.remat = "full"  # Backward-pass recompute per layer: none | full | dots (keep matmul outputs).

  c.data = ml_collections.ConfigDict()
  c.data.name = "stdlib"  # stdlib (Python source as bytes, no download) | tokens (.bin/.npy) | text (.txt/.jsonl).
  c.data.path = ""  # tokens: a .bin or .npy file of token ids; text: a .txt (one document) or .jsonl file.
  c.data.eval_path = ""  # A held-out file of the same kind; "" = hold out the last eval_fraction of data.path.
  c.data.dtype = "uint16"  # Token id dtype of .bin files: uint16 | uint32 (.npy files carry their own).
  c.data.tokenizer = ""  # text: a Hugging Face tokenizer.json (pip install zerojax[text]).
  c.data.text_key = "text"  # text, .jsonl: the field of each JSON object that holds the document.
  c.data.eos_id = -1  # text: id appended after every document; -1 = the tokenizer's end-of-sequence token.
  c.data.eval_fraction = 0.05  # Share of the tokens held out for evaluation when data.eval_path is "".
  return c
