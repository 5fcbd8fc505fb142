"""A train.py checkpoint -> a Hugging Face Llama folder.

    python -m zerojax.export --workdir runs/x --out hf_model/ [--step N] [--dtype bfloat16]

The checkpoint's own config is built as train.py builds it (`zerojax.build`), at stage
3 over every device here (checkpoints restore onto any plan), so each device holds
1/N of the state; then `zerojax.models.hf.save_params` streams the params out one HF
tensor at a time. Exit status 0, or 2 (`exits.BAD_INPUT`) with one `error: ...` line
for a workdir without a usable checkpoint or a model that is not a Llama.
"""

import argparse
import os
import sys
from typing import Any

from zerojax import exits
from zerojax.models.safetensors_file import HFError
from zerojax.units import parse_bytes


def restore(workdir: str, step: int | None = None) -> tuple[Any, Any, Any, int]:
  """The checkpoint `step` (default: the newest intact one) of `workdir`, on every device.

  Its own config is built as train.py builds it, at stage 3 over every device here.

  Returns:
    (config, built, state, step).

  Raises:
    HFError: no checkpoint, or not a Llama.
    zerojax.checkpoint.CheckpointError: a damaged checkpoint.
  """
  # pylint: disable=import-outside-toplevel
  import ml_collections

  from zerojax import build, checkpoint
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise HFError("no checkpoints directory: nothing to read", path=directory,
                  fix="pass the --workdir of a train.py run that saved a checkpoint")
  ckpt = checkpoint.Checkpointer(directory, save_every_steps=0, async_save=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise HFError("no checkpoint in it", path=directory)
    config = ml_collections.ConfigDict(ckpt.read_meta(step or steps[-1])["config"])
    if config.model.name != "llama":
      raise HFError(f"model {config.model.name!r} is not a Llama", path=directory)
    # Every device here, whatever the run had: stage 3 over all of them.
    config.zero.stage, config.mesh.data, config.mesh.fsdp = 3, 1, -1
    built = build.build(config)
    state, meta = ckpt.restore(step, built.plan) if step else ckpt.restore_latest(built.plan)
    print(f"restored {directory}/{meta['step']}", flush=True)
    return config, built, state, meta["step"]
  finally:
    ckpt.close()


def export_checkpoint(workdir: str, out: str, *, step: int | None = None,
                      **kwargs: Any) -> list[str]:
  """Exports checkpoint `step` of `workdir` (default: the newest intact one) to `out`.

  Args:
    workdir: train.py's `--workdir`.
    out: the folder to write.
    step: the checkpoint's step.
    **kwargs: for `hf.save_params` (dtype, max_shard_size, max_position_embeddings).

  Returns:
    The safetensors file names written.

  Raises:
    HFError: no checkpoint, or not a Llama.
    zerojax.checkpoint.CheckpointError: a damaged checkpoint.
  """
  from zerojax.models import hf  # pylint: disable=import-outside-toplevel
  _, built, state, _ = restore(workdir, step)
  return hf.save_params(state.params, built.model.config, out, **kwargs)


def main(argv: list[str] | None = None) -> int:
  """The CLI (see the module docstring); returns the exit status."""
  from zerojax import checkpoint  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="python -m zerojax.export",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="train.py's --workdir")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                      help="tensor dtype (default: the params' own)")
  parser.add_argument("--max_shard_size", default="5GB", type=parse_bytes,
                      help="bytes per file, e.g. 5GB, 500MB")
  parser.add_argument("--max_position_embeddings", type=int, default=None,
                      help="for config.json (default: 131072 with RoPE scaling, else 8192)")
  args = parser.parse_args(argv)
  try:
    names = export_checkpoint(args.workdir, args.out, step=args.step, dtype=args.dtype,
                              max_shard_size=args.max_shard_size,
                              max_position_embeddings=args.max_position_embeddings)
  except (HFError, checkpoint.CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.BAD_INPUT
  print(f"wrote {args.out}: config.json, {', '.join(names)}", flush=True)
  return exits.DONE


if __name__ == "__main__":
  sys.exit(main())
