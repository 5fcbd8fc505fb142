"""`python -m zerojax.generate`: a train.py checkpoint's or a Hugging Face folder's answers.

    python -m zerojax.generate --workdir runs/sft --prompt "12+30=" --prompt "sort dcba:"
    python -m zerojax.generate --hf hf_model/ --chat --prompt "Reverse 'abc'." --json
    python -m zerojax.generate --workdir runs/sft --prompt "12+" --temperature 0.8 --top_p 0.9

`--workdir` restores the checkpoint at stage 3 over every device (`export.restore`);
`--hf` reads a Llama folder as `zerojax.hf.export` writes it straight onto a stage-3 plan
(`hf.load_params`), its tokenizer, chat template and end ids from the folder's files.
Both decode with the KV cache on the params as sharded (`decode.generate`). A row stops
at the end ids generation_config.json lists (EOS and the chat template's end of turn:
for `--workdir`, the same ids `zerojax.hf.export` would write), so an exported folder
answers with the same token ids as its checkpoint.

Output: one line per prompt, its answer (up to its stop id; newlines written as \\n);
with `--json`, a JSON object per prompt with the token ids, and only those on stdout.
Bad input: one `error: ...` line on stderr, exit 2.
"""

import argparse
import contextlib
import json
import os
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp

import zerojax
from zerojax import checkpoint, data, hf
from zerojax.data import sft
from zerojax.generate import decode, sampling
from zerojax.generate.sampling import Sampling
from zerojax.hf import export
from zerojax.hf.safetensors_file import HFError
from zerojax.models import LlamaLM
from zerojax.runtime import exits


class _BadArgs(ValueError):
  pass


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):  # One `error:` line, not argparse's usage block.
    raise _BadArgs(f"{message} (see {self.prog} --help)")


def encode_prompt(d: Any, tokenizer: Any, prompt: str, as_chat: bool) -> tuple[list[int], set]:
  """A prompt's ids as training saw them (data section `d`) and the ids that end an answer.

  Plain: [BOS] (data.add_bos) + the prompt, ended by the EOS. Chat: one user turn rendered
  with the chat template and its generation prompt, ended by EOS or the template's end
  of turn (`sft.turn_end_ids`: Llama 3's <|eot_id|>, Gemma 3's <end_of_turn>).
  """
  stops = {data.eos_token_id(tokenizer, d.tokenizer, d.eos_id)}
  if as_chat:
    template = sft._template(d.tokenizer)
    from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
    text = chat.render(template, [{"role": "user", "content": prompt}],
                       add_generation_prompt=True)
    return (tokenizer.encode(text, add_special_tokens=False).ids,
            stops | sft.turn_end_ids(tokenizer, d.tokenizer))
  head = [sft.bos_token_id(tokenizer, d.tokenizer)] if d.add_bos else []
  return head + tokenizer.encode(prompt, add_special_tokens=False).ids, stops


def _parser() -> _Parser:
  p = _Parser(prog="python -m zerojax.generate", description=__doc__.split("\n")[0])
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="train.py's --workdir (its newest checkpoint)")
  source.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama folder")
  p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  p.add_argument("--chat", action="store_true", help="a user turn of the chat template")
  p.add_argument("--max_new", type=int, default=64, help="tokens to generate at most")
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
  p.add_argument("--top_k", type=int, default=0, help="0: no limit")
  p.add_argument("--top_p", type=float, default=1.0, help="in (0, 1]")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--gather", default="auto", choices=("auto", "whole", "layer"),
                 help="params gathered whole once, or per layer and token")
  p.add_argument("--compute_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="--hf: activations' dtype (default: training's default)")
  p.add_argument("--json", action="store_true", help="a JSON line per prompt, with ids")
  return p


def _from_workdir(args) -> tuple[Any, Any, Any, Any, Any, set]:
  """(model, plan, params, data section, tokenizer, end ids) of a train.py checkpoint."""
  config, built, state, _ = export.restore(args.workdir, args.step)
  d = config.data
  if not d.tokenizer:
    raise data.DataError("the run had no tokenizer (data.tokenizer): nothing to decode with",
                         key="data.tokenizer")
  tokenizer = data.load_tokenizer(d.tokenizer, config.model.vocab_size)
  ends = {data.eos_token_id(tokenizer, d.tokenizer, d.eos_id)}
  with contextlib.suppress(data.DataError):  # No template: only the EOS, as export writes.
    ends |= sft.turn_end_ids(tokenizer, d.tokenizer)
  return built.model, built.plan, state.params, d, tokenizer, ends


def _from_hf(args) -> tuple[Any, Any, Any, Any, Any, set]:
  """(model, plan, params, data section, tokenizer, end ids) of a Hugging Face folder."""
  raw = hf.read_config(args.hf)
  dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"  # transformers 5: dtype.
  model = LlamaLM(hf.llama_config(args.hf, param_dtype=jnp.dtype(dtype),
                                  compute_dtype=jnp.dtype(args.compute_dtype)))
  path = os.path.join(args.hf, "tokenizer.json")
  if not os.path.isfile(path):
    raise hf.HFError("no tokenizer.json in this folder: nothing to encode prompts with",
                     path=args.hf, fix="copy the model's tokenizer.json (and "
                     "tokenizer_config.json) into it")
  tokenizer = data.load_tokenizer(path, model.config.vocab_size)
  side = _json(os.path.join(args.hf, "tokenizer_config.json"))
  d = types.SimpleNamespace(tokenizer=path, eos_id=-1, add_bos=side.get("add_bos_token", True))
  ends = _json(os.path.join(args.hf, "generation_config.json")).get(
      "eos_token_id", raw.get("eos_token_id"))
  ends = ({data.eos_token_id(tokenizer, path)} if ends is None else
          set(ends if isinstance(ends, list) else [ends]))
  plan = zerojax.make_plan(zerojax.make_mesh(1, -1), 3,
                           jax.eval_shape(model.init, jax.random.key(0)),
                           logical_axes=model.logical_axes())
  return model, plan, hf.load_params(args.hf, plan), d, tokenizer, ends


def _json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except ValueError as e:
    raise data.DataError(f"not JSON ({e})", path=path) from None


def main(argv: list[str] | None = None) -> int:
  """The CLI (see the module docstring); returns the exit status."""
  from zerojax.data import chat  # noqa: PLC0415  optional: jinja2 (the text extra)
  try:
    args = _parser().parse_args(argv)
    settings = Sampling(args.temperature, args.top_k, args.top_p)
    sampling.check(settings)
    if args.max_new < 1:
      raise _BadArgs(f"--max_new {args.max_new} must be >= 1")
    # With --json stdout holds the JSON lines only: restore's line goes to stderr.
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
      model, plan, params, d, tokenizer, ends = (_from_hf if args.hf else _from_workdir)(args)
    prompts = [encode_prompt(d, tokenizer, p, args.chat)[0] for p in args.prompt]
    out = decode.generate(model, params, prompts, args.max_new, plan=plan, sampling=settings,
                          seed=args.seed, stop_ids=ends, gather=args.gather)
  except (ValueError, HFError, checkpoint.CheckpointError, data.DataError, chat.RenderError,
          TypeError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return exits.BAD_INPUT
  for text, ids, tokens, n in zip(args.prompt, prompts, out.tokens, out.lengths):
    said = tokens[:n].tolist()
    answer = tokenizer.decode(said[:-1] if said and said[-1] in ends else said)
    line = (json.dumps({"prompt": text, "answer": answer, "prompt_ids": list(ids), "ids": said,
                        "stopped": bool(said and said[-1] in ends)})
            if args.json else answer.replace("\n", "\\n"))
    print(line, flush=True)
  return exits.DONE
