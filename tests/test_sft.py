"""Tests for zerojax.data.sft and zerojax.data.chat on real files: formats, masks, chat
templates, bad lines, batch order and resume, process rows; train.py's exit on unusable data."""

import json
import os

import jinja2
import numpy as np
import pytest

from zerojax import data
from zerojax.config import base_config
from zerojax.data import DataError, chat, sft, sft_demo

tokenizers = pytest.importorskip("tokenizers")

# Meta's Llama-3-8B-Instruct chat_template, as its tokenizer_config.json has it.
META_LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "What is 2+3?  "},
     {"role": "assistant", "content": " 5"},
     {"role": "user", "content": "And reversed 'héllo'?"},
     {"role": "assistant", "content": "olléh\n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"},
     {"role": "user", "content": "ok"}],
]


def folder_with(tmp_path, template: str | None = META_LLAMA3) -> str:
  """A folder with the byte tokenizer and (unless None) a tokenizer_config.json."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  sft_demo.byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").unlink(missing_ok=True)
  if template is not None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
  return str(tmp_path / "tokenizer.json")


def data_config(tokenizer: str, path: str = "", **values):
  d = base_config().data
  d.update(name="sft", tokenizer=tokenizer, path=path, **values)
  return d


def read(tmp_path, lines: list, seq_len: int = 256, tokenizer: str | None = None, **values):
  tok_path = tokenizer or folder_with(tmp_path)
  path = tmp_path / "data.jsonl"
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  d = data_config(tok_path, str(path), **values)
  return sft.read_examples(str(path), "data.path", d, tokenizers.Tokenizer.from_file(tok_path),
                           seq_len)


def example(ex: sft.Examples, i: int) -> tuple[np.ndarray, np.ndarray]:
  at = slice(ex.starts[i], ex.starts[i] + ex.lengths[i])
  return ex.ids[at], ex.mask[at]


def test_chat_template_renders_as_jinja_and_masks_exactly_the_assistant_tokens(tmp_path):
  """Byte-identical to Jinja's rendering of Meta's Llama 3 template (HF's settings), the
  built-in template too; the trained tokens are exactly each assistant turn's trimmed
  content and its <|eot_id|>."""
  tok_path = folder_with(tmp_path)
  reference = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(META_LLAMA3)
  builtin = chat.compile_template(chat.LLAMA3_TEMPLATE, chat.LLAMA3_TOKENS)
  loaded = chat.load_template(tok_path)
  assert loaded.source.endswith("tokenizer_config.json")
  for messages in CONVERSATIONS:
    for gen in (False, True):
      want = reference.render(messages=messages, bos_token="<|begin_of_text|>",
                              add_generation_prompt=gen)
      assert chat.render(loaded, messages, gen) == want
      assert chat.render(builtin, messages, gen) == want
  assert chat.render(loaded, CONVERSATIONS[0][:3]) == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou answer briefly."
      "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>")

  ex, _ = read(tmp_path, [{"messages": m} for m in CONVERSATIONS], tokenizer=tok_path)
  tok = tokenizers.Tokenizer.from_file(tok_path)
  for i, messages in enumerate(CONVERSATIONS):
    ids, mask = example(ex, i)
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == chat.render(loaded, messages)
    # The expected mask, built turn by turn (byte tokens: pieces encode as the whole does).
    want = []
    for j, m in enumerate(messages):
      head = chat.render(loaded, messages[:j], add_generation_prompt=m["role"] == "assistant")
      upto = chat.render(loaded, messages[:j + 1])
      done = sum(len(w) for w in want)
      prefix_ids = tok.encode(head, add_special_tokens=False).ids
      turn_ids = tok.encode(upto, add_special_tokens=False).ids
      want.append([False] * (len(prefix_ids) - done)
                  + [m["role"] == "assistant"] * (len(turn_ids) - len(prefix_ids)))
    assert mask.tolist() == sum(want, [])
    trained = tok.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert trained == "".join(m["content"].strip() + "<|eot_id|>" for m in messages
                              if m["role"] == "assistant")


def test_without_tokenizer_config_the_builtin_llama3_template_is_used(tmp_path):
  tok_path = folder_with(tmp_path, template=None)
  t = chat.load_template(tok_path)
  assert t.source == "built-in Llama 3" and chat.render(t, CONVERSATIONS[1][:2]).startswith(
      "<|begin_of_text|><|start_header_id|>user")


def test_prompt_completion_tokens_and_masks(tmp_path):
  """[BOS] prompt completion [EOS], trained on completion + EOS; the keys change it."""
  line = {"prompt": "12+3=", "completion": "15"}
  bos, eos = 256, 257  # <|begin_of_text|>, <|end_of_text|> of the byte tokenizer.
  body = list(b"12+3=15")
  for values, ids, trained in [
      ({}, [bos, *body, eos], [0] * 6 + [1] * 3),
      ({"add_bos": False}, [*body, eos], [0] * 5 + [1] * 3),
      ({"add_eos": False}, [bos, *body], [0] * 6 + [1] * 2),
      ({"train_on": "all"}, [bos, *body, eos], [0] + [1] * 8)]:
    ex, _ = read(tmp_path, [line], tokenizer=folder_with(tmp_path, template=None), **values)
    got_ids, got_mask = example(ex, 0)
    assert got_ids.tolist() == ids and got_mask.astype(int).tolist() == trained, values


def test_bad_lines_are_skipped_counted_and_named(tmp_path):
  raising = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
             "{{ raise_exception('no booms') }}{% endif %}{{ m['content'] }}{% endfor %}")
  lines = ['{"prompt": "1+1=", "completion": "2"}', "not json", '{"prompt": "x"}',
           '{"prompt": "x", "completion": "  "}', {"text": "a document"},
           {"messages": [{"role": "wizard", "content": "x"},
                         {"role": "assistant", "content": "y"}]},
           {"messages": [{"role": "user", "content": "only a question"}]},
           {"messages": [{"role": "user", "content": "boom"},
                         {"role": "assistant", "content": "x"}]},
           {"prompt": "y" * 20, "completion": "z" * 20}, '[1, 2]', "",
           {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
  ex, line = read(tmp_path, lines, seq_len=32, tokenizer=folder_with(tmp_path, raising),
                  too_long="drop")
  assert len(ex) == 2
  for reason, first in [("not JSON", 2), ("no string field 'completion'", 3),
                        ("an empty completion", 4), ("neither 'messages' nor", 5),
                        ("an unknown role", 6), ("no assistant turn", 7),
                        ("the chat template failed", 8), ("longer than train.seq_len + 1", 9),
                        ("not a JSON object", 10)]:
    assert f"1 {reason}" in line and f"(first: line {first}" in line, (reason, line)
  assert "no booms" in line and "'wizard'" in line and "skipped 9" in line
  # Truncated instead of dropped: kept, counted.
  ex, line = read(tmp_path, [lines[8]], seq_len=32, tokenizer=folder_with(tmp_path, None))
  assert len(ex) == 1 and ex.lengths[0] == 33 and "1 truncated to 33 tokens" in line
  with pytest.raises(DataError, match="no usable example: 1 not JSON"):
    read(tmp_path, ["{oops"], tokenizer=folder_with(tmp_path, None))
  # Every example too long, the completion past the cut: nothing usable left.
  with pytest.raises(DataError, match="no usable example: 1 longer than"):
    read(tmp_path, [lines[8]], seq_len=16, tokenizer=folder_with(tmp_path, None))


def test_a_template_that_does_not_parse_or_whose_turns_do_not_follow_their_prompt_is_an_error(
    tmp_path):
  with pytest.raises(DataError, match="does not parse"):
    read(tmp_path, [{"messages": CONVERSATIONS[1]}], tokenizer=folder_with(tmp_path, "{% for %}"))
  backwards = "{% for m in messages | reverse %}{{ m['content'] }}{% endfor %}"
  with pytest.raises(DataError, match="does not render the first 1 messages as a prefix"):
    read(tmp_path, [{"messages": CONVERSATIONS[1]}], tokenizer=folder_with(tmp_path, backwards))


def small(tmp_path, pack: bool) -> sft.Examples:
  lines = [{"prompt": f"q{i}" * (1 + i % 3), "completion": f"a{i}"} for i in range(13)]
  ex, _ = read(tmp_path, lines, seq_len=24, tokenizer=folder_with(tmp_path, None), pack=pack)
  return ex


@pytest.mark.parametrize("pack", [True, False])
def test_batches_are_a_pure_function_of_seed_and_step_over_epochs(tmp_path, pack):
  """Fresh loaders (as after a resume) give each step's batch; every epoch holds every
  example once; positions restart per example; process rows make up the global batch."""
  ex = small(tmp_path, pack)
  B, steps = 4, 12  # 48 rows: several epochs of 13 examples.
  run = [sft.batch_at(ex, s, B, seed=3) for s in range(steps)]
  for s in (0, 5, 11):  # Resumed at step s: a loader that never saw the earlier steps.
    again = sft.batch_at(small(tmp_path / f"r{s}", pack), s, B, seed=3)
    assert all(np.array_equal(again[k], run[s][k]) for k in run[s])
  assert not np.array_equal(sft.batch_at(ex, 0, B, seed=4)["tokens"], run[0]["tokens"])
  # Epoch by epoch, each example exactly once (tokens counted per example id).
  stream, epoch = [r for s in range(steps) for r in sft.rows_at(ex, s * B, B, 3)], 0
  at = 0
  while at + len(sft.epoch_rows(ex, 3, epoch)) <= len(stream):
    n = len(sft.epoch_rows(ex, 3, epoch))
    assert sorted(np.concatenate(stream[at:at + n]).tolist()) == list(range(len(ex)))
    at, epoch = at + n, epoch + 1
  assert epoch >= 2
  for b in run:
    for r in range(B):
      seg, pos = b["segment_ids"][r], b["positions"][r]
      for k in range(1, seg.max() + 1):
        assert pos[seg == k].tolist() == list(range((seg == k).sum()))
    # The trained weights average 1 over the global batch's B x T positions.
    assert abs(b["loss_mask"].sum() - b["loss_mask"].size) < 1e-3
    for count in (2, 4):
      parts = [sft.batch_at(ex, 7, B, 3, rows=data.rows_for(B, i, count)) for i in range(count)]
      whole = sft.batch_at(ex, 7, B, 3)
      assert all(np.array_equal(np.concatenate([p[k] for p in parts]), whole[k]) for k in whole)


def test_train_py_exits_2_when_no_example_is_usable(tmp_path):
  """Bad lines are reported, and a file with none usable stops train.py before it builds
  anything: one error line naming the file and each reason, exit 2, no traceback."""
  import subprocess
  import sys

  from zerojax.runtime.device_env import fake_devices_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1="}\nnot json\n{"messages": [{"role": "user", "content": "x"}]}\n')
  out = subprocess.run(
      [sys.executable, os.path.join(repo, "train.py"), "--config",
       os.path.join(repo, "configs", "sft_tiny.py"), f"--config.data.path={bad}"],
      cwd=repo, env=fake_devices_env(1), capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.startswith(f"error: {bad} (data.path): no usable example: ")
  for reason in ("no string field 'completion' (first: line 1)", "not JSON (first: line 2",
                 "no assistant turn with content (first: line 3)"):
    assert reason in out.stderr
  assert "Traceback" not in out.stderr and not out.stdout


def test_sft_keys_with_another_source_are_refused():
  from zerojax.config import ConfigError, load_config
  base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "base.py")
  with pytest.raises(ConfigError, match="data.pack .*only data.name='sft' reads it"):
    load_config(base, ["data.pack=False"])
  with pytest.raises(ConfigError, match="data.name='sft' needs a model that reads segment ids"):
    load_config(base, ["data.name=sft", "data.path=x.jsonl", "data.tokenizer=t.json",
                       "model.name=mlp_lm"])


def test_generation_tags_render_their_body():
  """transformers' `{% generation %}` blocks parse and render as their contents."""
  t = chat.compile_template("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                            "{% generation %}A:{{ m['content'] }}{% endgeneration %}"
                            "{% else %}U:{{ m['content'] }}{% endif %}{% endfor %}")
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  assert chat.assistant_examples(t, messages) == [("U:hiA:yo", [(4, 8)])]
