"""A train.py checkpoint -> a Hugging Face Llama folder.

    python -m zerojax.hf.export --workdir runs/x --out hf_model/ [--step N] [--dtype bfloat16]

The checkpoint's own config is built as train.py builds it (`zerojax.build`), at stage
3 over every device here (checkpoints restore onto any plan), so each device holds
1/N of the state; then `zerojax.hf.save_params` streams the params out one HF
tensor at a time. A run with a tokenizer (`data.tokenizer`) also gets its tokenizer
files, generation_config.json and bos/eos ids in config.json (`export_tokenizer`). Exit
status 0, or 2 (`exits.BAD_INPUT`) with one `error: ...` line for a workdir without a
usable checkpoint or a model that is not a Llama.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
from typing import Any

import jax

from zerojax import build, checkpoint, data, hf
from zerojax.checkpoint import layout
from zerojax.data import sft
from zerojax.hf.safetensors_file import HFError
from zerojax.runtime import exits
from zerojax.runtime.units import parse_bytes


def restore(workdir: str, step: int | None = None) -> tuple[Any, Any, Any, int]:
  """The checkpoint `step` (default: the newest intact one) of `workdir`, on every device.

  Its own config is built as train.py builds it, at stage 3 over every device here.

  Returns:
    (config, built, state, step).

  Raises:
    HFError: no checkpoint, or not a Llama.
    zerojax.checkpoint.CheckpointError: a damaged checkpoint.
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise HFError("no checkpoints directory: nothing to read", path=directory,
                  fix="pass the --workdir of a train.py run that saved a checkpoint")
  ckpt = checkpoint.Checkpointer(directory, save_every_steps=0, async_save=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise HFError("no checkpoint in it", path=directory)
    where = os.path.join(directory, str(step or steps[-1]))
    # The config as the checkpoint's format has it, every key of today's schema set.
    config = layout.config(layout.upgrade(ckpt.read_meta(step or steps[-1]), where), where)
    if config.model.name != "llama":
      raise HFError(f"model {config.model.name!r} is not a Llama", path=directory)
    # Every device here, whatever the run had: stage 3 over all of them.
    config.zero.stage, config.mesh.data, config.mesh.fsdp = 3, 1, -1
    config.mesh.expert = 1
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

  config, built, state, _ = restore(workdir, step)
  names = hf.save_params(state.params, built.model.config, out, **kwargs)
  if config.data.tokenizer and jax.process_index() == 0:
    names += export_tokenizer(config.data, config.model.vocab_size, out)
  return names


def export_tokenizer(d: Any, vocab_size: int, out: str) -> list[str]:
  """Completes the HF folder `out` with the run's tokenizer (data section `d`).

  Copies tokenizer.json and, when there is one beside it, tokenizer_config.json; else
  writes one naming the BOS and EOS and, when the vocabulary has Llama 3's header
  tokens, the chat template the run trained with (`chat.LLAMA3_TEMPLATE`). Writes
  generation_config.json and adds bos_token_id / eos_token_id to config.json; the end
  ids are the EOS and, for chat, the template's end of turn (`sft.turn_end_ids`).

  Returns:
    The file names written.
  """
  tokenizer = data.load_tokenizer(d.tokenizer, vocab_size)
  side = os.path.join(os.path.dirname(d.tokenizer), "tokenizer_config.json")
  shutil.copyfile(d.tokenizer, os.path.join(out, "tokenizer.json"))
  eos = data.eos_token_id(tokenizer, d.tokenizer, d.eos_id)
  try:
    bos = sft.bos_token_id(tokenizer, d.tokenizer)
  except data.DataError:
    bos = None  # A tokenizer without one.
  ends = [eos]
  if os.path.isfile(side):
    shutil.copyfile(side, os.path.join(out, "tokenizer_config.json"))
    with open(side, encoding="utf-8") as f:
      end = data.token_text(json.load(f).get("eos_token"))
    ends.append(tokenizer.token_to_id(end) if end else None)
    with contextlib.suppress(data.DataError):  # A bad template: the EOS only, as training.
      ends += sorted(sft.turn_end_ids(tokenizer, d.tokenizer))
  else:
    from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
    text = lambda i: None if i is None else tokenizer.id_to_token(i)
    side_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text(bos),
                   "eos_token": text(eos), "clean_up_tokenization_spaces": False}
    if tokenizer.token_to_id("<|start_header_id|>") is not None:
      side_config["chat_template"] = chat.LLAMA3_TEMPLATE
      ends.append(tokenizer.token_to_id(chat.LLAMA3_TOKENS["eos_token"]))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(side_config, f, indent=2)
  ends = list(dict.fromkeys(i for i in ends if i is not None))
  ids = {"bos_token_id": bos, "eos_token_id": ends[0] if len(ends) == 1 else ends}
  with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump({**ids, "do_sample": False}, f, indent=2)
  with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
    hf_config = json.load(f)
  with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
    json.dump({**hf_config, **ids}, f, indent=2)
  return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def main(argv: list[str] | None = None) -> int:
  """The CLI (see the module docstring); returns the exit status."""
  parser = argparse.ArgumentParser(prog="python -m zerojax.hf.export",
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
