"""Chat SFT in each family's format (`zerojax.data.chat`, `zerojax.data.sft`): Qwen2.5,
Qwen3, Mistral v0.3 and Gemma 3.

The templates below are this suite's own Jinja, written to produce each family's
documented chat format (not the published template files): ChatML with Qwen2.5's default
system message; ChatML with Qwen3's reasoning kept only after the last user message;
Mistral's `[INST] ... [/INST]` with the system prompt in the last user message; Gemma 3's
`<start_of_turn>` turns, the assistant as `model`, the system message in the first user
turn. Each marks the assistant's part with transformers' `{% generation %}` tags, so
transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` gives an
independent mask (the `hf-check` extra; skipped without it). A character-level tokenizer
with each family's special tokens keeps the vocabulary under the tiny checkpoints' 97
ids (tests/test_families.py trains Qwen3's on these conversations).
"""

import json
import string

import numpy as np
import pytest

from zerojax.config import base_config
from zerojax.data import chat, sft
from zerojax.hf import export

tokenizers = pytest.importorskip("tokenizers")

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25 = (
    "{%- if not messages or messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' }}"
    "{%- if m.role == 'assistant' %}"
    "{%- generation %}{{- m.content ~ '<|im_end|>\\n' }}{%- endgeneration %}"
    "{%- else %}{{- m.content ~ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Reasoning: a message's `reasoning_content`, else what its content has before `</think>`.
# Shown (in a think block) only on the assistant turns after the last user message, and
# always on the final one (empty when there is none), as Qwen3's format.
QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set answer = m.content %}{%- set thought = m.reasoning_content or '' %}"
    "{%- if not thought and '</think>' in answer %}"
    "{%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or thought) %}"
    "{{- '<think>\\n' ~ thought ~ '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- answer ~ '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- else %}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
ALTERNATE = ("{{- raise_exception('after an optional system message the roles must alternate "
             "user, assistant, user, ...') }}")
# v0.3: no generation prompt (the answer follows `[/INST]`), the answer trimmed after a space.
MISTRAL = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in turns %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{{- bos_token }}"
    "{%- for m in turns %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}" + ALTERNATE + "{%- endif %}"
    "{%- if m.role == 'user' %}"
    "{%- if system and loop.index0 == ns.last_user %}"
    "{{- '[INST] ' ~ system ~ '\\n\\n' ~ m.content ~ '[/INST]' }}"
    "{%- else %}{{- '[INST] ' ~ m.content ~ '[/INST]' }}{%- endif %}"
    "{%- else %}{%- generation %}{{- ' ' ~ m.content | trim ~ eos_token }}{%- endgeneration %}"
    "{%- endif %}"
    "{%- endfor %}")
GEMMA3 = (
    "{{- bos_token }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set lead = messages[0].content | trim ~ '\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set lead = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for m in turns %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}" + ALTERNATE + "{%- endif %}"
    "{%- if m.role == 'assistant' %}{{- '<start_of_turn>model\\n' }}"
    "{%- generation %}{{- m.content | trim ~ '<end_of_turn>\\n' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- '<start_of_turn>user\\n' ~ (lead if loop.first else '') ~ m.content | trim"
    " ~ '<end_of_turn>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")
# family -> (template, tokenizer_config.json's special tokens, the tokenizer's specials).
FAMILIES = {
    "qwen25": (QWEN25, {"eos_token": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>"]),
    "qwen3": (QWEN3, {"eos_token": "<|im_end|>"},
              ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}, ["<s>", "</s>", "[INST]",
                                                                     "[/INST]"]),
    "gemma3": (GEMMA3, {"bos_token": "<bos>", "eos_token": "<eos>"},
               ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]),
}
CHARS = string.ascii_letters + string.digits + " \n.,?!:'+-=()"

SYSTEM = {"role": "system", "content": "Answer briefly."}
TWO_TURNS = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5."},
             {"role": "user", "content": "And 4+4?"}, {"role": "assistant", "content": "8."}]


def family_folder(folder, family: str) -> str:
  """A folder with a character-level tokenizer.json (CHARS, then the family's special
  tokens) and a tokenizer_config.json with the family's template; the tokenizer's path."""
  template, tokens, specials = FAMILIES[family]
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
  tokenizer.add_special_tokens(specials)
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                            **tokens}))
  return str(folder / "tokenizer.json")


def read(folder, family: str, conversations: list, **values) -> tuple[sft.Examples, str, object]:
  """`sft.read_examples` of the conversations in the family's format; the tokenizer too."""
  path = family_folder(folder, family)
  (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n"
                                             for m in conversations))
  d = base_config().data
  d.update(name="sft", tokenizer=path, path=str(folder / "chat.jsonl"), **values)
  tokenizer = tokenizers.Tokenizer.from_file(path)
  examples, line = sft.read_examples(d.path, "data.path", d, tokenizer, 512)
  return examples, line, tokenizer


def texts(examples: sft.Examples, tokenizer) -> list[tuple[str, str]]:
  """(text, trained text) of each example (a character tokenizer: ids -> text exactly)."""
  out = []
  for start, n in zip(examples.starts, examples.lengths):
    ids, mask = examples.ids[start:start + n], examples.mask[start:start + n]
    pieces = [tokenizer.id_to_token(int(i)) for i in ids]
    out.append(("".join(pieces), "".join(p for p, m in zip(pieces, mask) if m)))
  return out


def test_each_family_renders_its_documented_format():
  """The conversation system + two turns, and with the generation prompt after a user
  turn, rendered character for character in each family's format."""
  rendered = {f: chat.render(chat.compile_template(t, tokens), [SYSTEM, *TWO_TURNS])
              for f, (t, tokens, _) in FAMILIES.items()}
  chatml = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhat is 2+3?"
            "<|im_end|>\n<|im_start|>assistant\n5.<|im_end|>\n<|im_start|>user\nAnd 4+4?"
            "<|im_end|>\n<|im_start|>assistant\n")
  assert rendered["qwen25"] == chatml + "8.<|im_end|>\n"
  assert rendered["qwen3"] == chatml + "<think>\n\n</think>\n\n8.<|im_end|>\n"
  assert rendered["mistral"] == ("<s>[INST] What is 2+3?[/INST] 5.</s>[INST] Answer briefly."
                                 "\n\nAnd 4+4?[/INST] 8.</s>")
  assert rendered["gemma3"] == (
      "<bos><start_of_turn>user\nAnswer briefly.\n\nWhat is 2+3?<end_of_turn>\n"
      "<start_of_turn>model\n5.<end_of_turn>\n<start_of_turn>user\nAnd 4+4?<end_of_turn>\n"
      "<start_of_turn>model\n8.<end_of_turn>\n")
  qwen25 = chat.compile_template(QWEN25, FAMILIES["qwen25"][1])
  assert chat.render(qwen25, TWO_TURNS[:1], add_generation_prompt=True) == (
      f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
      "<|im_start|>assistant\n")
  gemma = chat.compile_template(GEMMA3, FAMILIES["gemma3"][1])
  with pytest.raises(chat.RenderError, match="roles must alternate"):
    chat.render(gemma, [TWO_TURNS[0], TWO_TURNS[0]])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_prefix_stable_conversation_is_one_example_masked_as_transformers_masks_it(
    tmp_path, family):
  """Two turns (Qwen3 and Mistral: those their format renders as prefixes of each other;
  the other two with a system message): one example, its text the template's rendering
  and its trained characters exactly the assistant turns after their generation prompts,
  end-of-turn token included; with transformers, the mask is
  `apply_chat_template(..., return_assistant_tokens_mask=True)`'s token for token (but
  the example's first token, which is never trained)."""
  # Qwen3 renders a think block on the final turn only: one turn is prefix-stable.
  messages = {"qwen3": TWO_TURNS[:2], "mistral": TWO_TURNS}.get(family, [SYSTEM, *TWO_TURNS])
  examples, line, tokenizer = read(tmp_path, family, [messages])
  [(text, trained)] = texts(examples, tokenizer)
  template, tokens, _ = FAMILIES[family]
  assert text == chat.render(chat.compile_template(template, tokens), messages)
  answers = {"qwen25": "5.<|im_end|>\n8.<|im_end|>\n",
             "qwen3": "<think>\n\n</think>\n\n5.<|im_end|>\n",
             "mistral": " 5.</s> 8.</s>",
             "gemma3": "5.<end_of_turn>\n8.<end_of_turn>\n"}
  assert trained == answers[family]
  assert "split" not in line

  transformers = pytest.importorskip("transformers", reason="the hf-check extra")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **tokens)
  theirs = fast.apply_chat_template(messages, chat_template=template, tokenize=True,
                                    return_dict=True, return_assistant_tokens_mask=True)
  assert list(theirs["input_ids"]) == examples.ids.tolist()
  assert [False] + [bool(m) for m in theirs["assistant_masks"][1:]] == examples.mask.tolist()


def test_qwen3_trains_each_turn_with_the_reasoning_its_format_shows_at_that_turn(tmp_path):
  """Qwen3 drops the reasoning of turns before the last user message, so a conversation's
  beginning is not a prefix of it. Each assistant turn is then trained where the format
  shows it whole, as the model answering it would see the conversation: turn 1 with its
  reasoning after the first user message, turn 2 after turn 1 without its reasoning.
  Reasoning given as `reasoning_content` or inside the content renders the same."""
  first = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5."}
  second = {"role": "assistant", "content": "8.", "reasoning_content": "4 and 4"}
  conversation = [TWO_TURNS[0], first, TWO_TURNS[2], second]
  examples, line, tokenizer = read(tmp_path, "qwen3", [conversation, conversation[:2]])
  assert line.split(": ", 1)[1].startswith("3 examples, ") and ", 1 conversations split" in line
  assert examples.lines.tolist() == [1, 1, 2]
  turn1 = ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
           "<think>\nadd them\n</think>\n\n5.<|im_end|>\n")
  assert texts(examples, tokenizer) == [
      (turn1, "<think>\nadd them\n</think>\n\n5.<|im_end|>\n"),
      ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5.<|im_end|>\n"
       "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n"
       "<think>\n4 and 4\n</think>\n\n8.<|im_end|>\n",
       "<think>\n4 and 4\n</think>\n\n8.<|im_end|>\n"),
      (turn1, "<think>\nadd them\n</think>\n\n5.<|im_end|>\n")]


def test_mistral_trains_each_turn_with_the_system_prompt_where_its_format_puts_it(tmp_path):
  """Mistral v0.3 puts the system prompt in the last user message: turn 1 is trained
  after `[INST] system\\n\\nuser 1[/INST]` (its prompt at inference), turn 2 after the
  whole conversation with the prompt moved to user 2; three turns give three examples."""
  three = [SYSTEM, *TWO_TURNS, {"role": "user", "content": "Bye."},
           {"role": "assistant", "content": "Bye!"}]
  examples, _, tokenizer = read(tmp_path, "mistral", [[SYSTEM, *TWO_TURNS], three])
  assert examples.lines.tolist() == [1, 1, 2, 2, 2]
  got = texts(examples, tokenizer)
  assert got[:2] == [
      ("<s>[INST] Answer briefly.\n\nWhat is 2+3?[/INST] 5.</s>", " 5.</s>"),
      ("<s>[INST] What is 2+3?[/INST] 5.</s>[INST] Answer briefly.\n\nAnd 4+4?[/INST] 8.</s>",
       " 8.</s>")]
  assert [trained for _, trained in got[2:]] == [" 5.</s>", " 8.</s>", " Bye!</s>"]
  assert got[4][0].endswith("[INST] Answer briefly.\n\nBye.[/INST] Bye!</s>")


def test_a_split_conversation_is_held_out_whole(tmp_path):
  """`data.eval_fraction` holds out the last examples, moved back to a conversation's
  first so that no turn is trained on and evaluated from the same conversation."""
  conversations = [[TWO_TURNS[0], {"role": "assistant", "content": f"{i}."}, TWO_TURNS[2],
                    TWO_TURNS[3]] for i in range(10)]
  path = family_folder(tmp_path, "qwen3")
  (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n"
                                               for m in conversations))
  d = base_config().data
  d.update(name="sft", tokenizer=path, path=str(tmp_path / "chat.jsonl"), eval_fraction=0.15)
  train, held_out, lines = sft.load(d, 97, 256)
  assert len(train) + len(held_out) == 20 and len(held_out) == 4  # 0.15 x 20 = 3 -> 4.
  assert set(train.lines.tolist()).isdisjoint(held_out.lines.tolist())
  assert np.array_equal(held_out.lines, [9, 9, 10, 10])
  assert "held out: the last 4 examples" in lines[1]


def test_answers_end_at_each_family_end_of_turn_and_export_lists_it(tmp_path):
  """What generation stops at (`sft.turn_end_ids`) is the template's EOS and the special
  token its turns end with: Gemma 3's `<end_of_turn>`, which is not its `<eos>` (a Gemma
  3 fine-tune would otherwise answer past its turn); ChatML's `<|im_end|>`; Mistral's
  `</s>`. The export's generation_config.json lists them."""
  ends = {}
  for family in FAMILIES:
    path = family_folder(tmp_path / family, family)
    tokenizer = tokenizers.Tokenizer.from_file(path)
    ends[family] = {tokenizer.id_to_token(i) for i in sft.turn_end_ids(tokenizer, path)}
  assert ends == {"qwen25": {"<|im_end|>"}, "qwen3": {"<|im_end|>"}, "mistral": {"</s>"},
                  "gemma3": {"<eos>", "<end_of_turn>"}}
  out = tmp_path / "export"
  out.mkdir()
  (out / "config.json").write_text("{}")
  d = base_config().data
  d.update(name="sft", tokenizer=str(tmp_path / "gemma3" / "tokenizer.json"))
  export.export_tokenizer(d, 97, str(out))
  written = json.loads((out / "generation_config.json").read_text())
  assert written["bos_token_id"] == len(CHARS) and written["eos_token_id"] == [
      len(CHARS) + 1, len(CHARS) + 3]  # <bos>, <eos>, <start_of_turn>, <end_of_turn>.
