"""The chain a fine-tuning user runs, as one test on 8 CPU devices: a Hugging Face Llama
folder → train.py packed chat SFT with gradient release at stage 3 → `zerojax.hf.export` →
the exported folder re-imported → `zerojax.generate --chat` from the exported folder
and from the workdir. Each CLI's `main` runs in this process (the same 8 devices the
command would have; no JAX start per step). With `transformers` and a CPU `torch`
installed (the `hf-check` extra; `.ci/run` installs them), the exported folder also
loads in transformers and its fp32 logits are zerojax's within 1e-4 (1.5e-5 measured)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax.train
from zerojax import hf
from zerojax.data import chat, sft_demo
from zerojax.generate import cli as generate_cli
from zerojax.hf import export
from zerojax.models.llama import LlamaLM

from test_hf import bits, hf_config, hf_weights, plan_for, write_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_TINY = os.path.join(REPO, "configs", "sft_tiny.py")
# configs/sft_tiny.py's shapes (vocabulary: 256 bytes + Llama 3's special tokens, 264).
SHAPES = dict(V=264, D=128, L=4, H=4, K=2, F=384)
MODEL = ["--config.model.rope_theta=10000.0", "--config.model.norm_eps=1e-05"]
PROMPTS = ["12+30=", "reverse abc:", "sort dcba:"]


def hf_chat_folder(folder):
  """A HF Llama folder with random fp32 weights, the demo's byte-level tokenizer.json and a
  tokenizer_config.json naming Llama 3's chat template and special tokens."""
  write_hf(folder, hf_weights(**SHAPES), hf_config(**SHAPES))
  sft_demo.byte_tokenizer().save(os.path.join(folder, "tokenizer.json"))
  side = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
          "eos_token": "<|eot_id|>", "chat_template": chat.LLAMA3_TEMPLATE,
          "clean_up_tokenization_spaces": False}
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(side, f)


def answers(capsys, *source):
  """`python -m zerojax.generate <source> --chat --json` on PROMPTS: [(prompt ids, ids)]."""
  capsys.readouterr()
  argv = [*source, "--chat", "--json", "--max_new", "24", "--compute_dtype", "float32"]
  for p in PROMPTS:
    argv += ["--prompt", p]
  assert generate_cli.main(argv) == 0, capsys.readouterr().err[-2000:]
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r["prompt"] for r in lines] == PROMPTS
  return [(r["prompt_ids"], r["ids"]) for r in lines]


def test_hf_folder_to_chat_sft_to_export_to_generate(tmp_path, capsys):
  source, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
  hf_chat_folder(str(source))
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps(c) + "\n" for c in sft_demo.chats(600, seed=0)))
  # Packed chat SFT, release at stage 3 (per-layer clipping), fp32, from the HF weights.
  code = zerojax.train.main([
      "--config", SFT_TINY, *MODEL, f"--config.init_from={source}",
      f"--config.data.path={chats}", "--config.data.eval_path=",
      f"--config.data.tokenizer={source / 'tokenizer.json'}", "--config.data.pack=True",
      "--config.zero.stage=3", "--config.optimizer.release=True",
      "--config.optimizer.release_clipping=per_layer", "--config.precision.param_dtype=float32",
      "--config.precision.compute_dtype=float32", "--config.optimizer.update_rule=nearest",
      "--config.optimizer.state_dtype=float32", "--config.train.steps=4",
      "--config.optimizer.warmup_steps=1", "--config.train.eval_every=0",
      "--config.train.eval_exact_match=0", f"--config.workdir={run}"])
  assert code == 0, capsys.readouterr().err[-3000:]
  assert "packed" in capsys.readouterr().out
  assert export.main(["--workdir", str(run), "--out", str(out)]) == 0

  # Re-imported: the checkpoint's params bit for bit, the same config.json shapes.
  _, _, state, step = export.restore(str(run))
  assert step == 4
  model, plan = plan_for(str(out), 3)
  assert bits(hf.load_params(str(out), plan)) == bits(state.params)
  assert hf.config_overrides(str(out)) == hf.config_overrides(str(source))
  # The tokenizer files, the chat template and the special ids round-trip.
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (out / name).read_bytes() == (source / name).read_bytes(), name
  eot, bos = 260, 256  # <|eot_id|>, <|begin_of_text|> of the byte tokenizer.
  generation = json.loads((out / "generation_config.json").read_text())
  config = json.loads((out / "config.json").read_text())
  assert generation["bos_token_id"] == config["bos_token_id"] == bos
  assert eot in np.atleast_1d(generation["eos_token_id"]).tolist()
  assert config["eos_token_id"] == generation["eos_token_id"]

  # The same chat answers, token for token, from the workdir and the exported folder;
  # prompts rendered with the template as training rendered them.
  from_run = answers(capsys, "--workdir", str(run))
  from_export = answers(capsys, "--hf", str(out))
  assert from_run == from_export and all(ids for _, ids in from_run)
  template = chat.compile_template(chat.LLAMA3_TEMPLATE, chat.LLAMA3_TOKENS, "test")
  tokenizer = sft_demo.byte_tokenizer()
  for (prompt_ids, _), p in zip(from_run, PROMPTS, strict=True):
    text = chat.render(template, [{"role": "user", "content": p}], add_generation_prompt=True)
    assert prompt_ids == tokenizer.encode(text, add_special_tokens=False).ids

  transformers = pytest.importorskip("transformers", reason="the transformers check: "
                                     "pip install transformers torch (CPU)")
  torch = pytest.importorskip("torch", reason="the transformers check: a CPU torch (pip "
                              "install torch --index-url https://download.pytorch.org/whl/cpu)")
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
  tokens = np.asarray([from_run[0][0] + from_run[0][1]], np.int32)
  with torch.no_grad():
    theirs = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  ours = np.asarray(jax.jit(LlamaLM(model.config).logits)(
      jax.device_get(state.params), jnp.asarray(tokens)))
  print(f"transformers vs zerojax logits: max |diff| {np.abs(ours - theirs).max():.2e}, "
        f"max |logit| {np.abs(theirs).max():.2f}")
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
