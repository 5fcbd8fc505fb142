"""Chat templates: conversations rendered as Hugging Face renders them, and where the
assistant's tokens are.

A model's chat template is the Jinja `chat_template` of the `tokenizer_config.json` beside
its `tokenizer.json`; without one, `LLAMA3_TEMPLATE` (Llama 3's format). Rendering follows
transformers' `apply_chat_template`: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
the globals `raise_exception` and `strftime_now`, and the special tokens (`bos_token`,
`eos_token`, ...) and `add_generation_prompt` as variables. `{% generation %}` blocks
(transformers' assistant-mask tags) render their body.

The assistant's part of a conversation is found by rendering its prefixes: turn i spans
from the end of `render(messages[:i], add_generation_prompt=True)` (so the assistant
header is not trained) to the end of `render(messages[:i + 1])` (its end-of-turn token
is): the prompt a model answering turn i is given, then what the template writes for the
answer. A template that renders a conversation's beginning as a prefix of the whole
(Llama 3's, Qwen2.5's, Gemma 3's) gives one example with every turn in it. Some render
an earlier turn differently once later messages follow (Qwen3 drops the reasoning of
turns before the last user message; Mistral's v0.3 puts the system prompt in the last
user message): such a turn is an example of its own, `render(messages[:i + 1])`, the
text the template gives at that turn, so every turn is trained on what the model sees
when it answers it. A template whose generation prompt is not a prefix of the turn it
starts is an error.

    template = load_template("tok/tokenizer.json")
    [(text, spans)] = assistant_examples(template, [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"}])
"""

import datetime
import json
import os
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.sandbox

from zerojax.data import token_text

ROLES = ("system", "user", "assistant", "tool", "ipython")

# Llama 3's chat format: BOS, then per message a role header, the trimmed content and
# <|eot_id|>; the generation prompt is an assistant header. Renders byte for byte what
# Meta's Llama-3 Instruct template renders (tests/test_sft.py).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\n\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}")
# The special tokens of LLAMA3_TEMPLATE when tokenizer_config.json names none.
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
# tokenizer_config.json keys passed to the template as strings (transformers'
# special_tokens_map).
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


class TemplateError(ValueError):
  """A chat template that cannot be used: a syntax error, or a generation prompt that is
  not where its turn begins."""


class RenderError(ValueError):
  """The template failed on one conversation (its `raise_exception`, or an error)."""


class ChatTemplate(NamedTuple):
  """A compiled template, the special tokens it sees and where it came from."""
  template: jinja2.Template
  tokens: dict[str, str]
  source: str  # "<path>" or "built-in Llama 3".


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders the body (masks are found by
  rendering prefixes, so the tags need do nothing)."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


def compile_template(text: str, tokens: dict[str, str] | None = None,
                     source: str = "template") -> ChatTemplate:
  """Compiles Jinja `text` in transformers' environment.

  Raises:
    TemplateError: the template does not parse.
  """
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    template = env.from_string(text)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise TemplateError(f"the chat template of {source} does not parse (line {e.lineno}: "
                        f"{e.message})") from None
  return ChatTemplate(template, dict(tokens or {}), source)


def load_template(tokenizer_path: str) -> ChatTemplate:
  """The chat template of the `tokenizer_config.json` beside `tokenizer_path`, else Llama 3's.

  A `chat_template` given as a list of named templates (transformers' format for several)
  uses the one named "default".

  Raises:
    TemplateError: the side file is not JSON, or its template does not parse.
  """
  path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_path)), "tokenizer_config.json")
  if not os.path.isfile(path):
    return compile_template(LLAMA3_TEMPLATE, LLAMA3_TOKENS, "built-in Llama 3")
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except ValueError as e:
    raise TemplateError(f"{path} is not JSON ({e})") from None
  tokens = {k: t for k in _SPECIAL_KEYS if (t := token_text(config.get(k))) is not None}
  text = config.get("chat_template")
  if isinstance(text, list):
    text = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}.get("default")
  if not text:
    return compile_template(LLAMA3_TEMPLATE, {**LLAMA3_TOKENS, **tokens},
                            f"built-in Llama 3 ({path} has no chat_template)")
  return compile_template(text, tokens, path)


def render(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = False
           ) -> str:
  """The conversation as text, exactly as `apply_chat_template(..., tokenize=False)`.

  Raises:
    RenderError: the template refused it (`raise_exception`) or failed on it.
  """
  try:
    return template.template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **template.tokens)
  except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
    raise RenderError(f"{type(e).__name__}: {e}") from None


def turn_end(template: ChatTemplate) -> str:
  """What the template writes after an assistant's content to close the turn (Llama 3's
  `<|eot_id|>`, ChatML's `<|im_end|>\n`, Gemma 3's `<end_of_turn>\n`, Mistral's `</s>`):
  the trained text a model ends its answer with. '' when the template does not render a
  one-turn conversation."""
  probe = "zerojax-probe"  # Content no template rewrites (trim, reasoning split).
  try:
    examples = assistant_examples(template, [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": probe}])
  except (RenderError, TemplateError):
    return ""
  text, spans = examples[-1]
  start, end = spans[-1]
  at = text.rfind(probe, start, end)
  return text[at + len(probe):end] if at >= 0 else ""


def assistant_examples(template: ChatTemplate, messages: list[dict]
                       ) -> list[tuple[str, list[tuple[int, int]]]]:
  """The conversation as examples: [(text, character spans [start, end) of its assistant
  turns)], one example per run of turns the template renders as prefixes of each other.

  Each span runs from after the generation prompt that precedes the turn to the end of
  the turn as rendered (its end-of-turn token included). A turn that renders otherwise
  once later messages follow (Qwen3's reasoning, Mistral's system prompt) closes an
  example ending with it; the examples are in the conversation's order, the last one the
  whole conversation's rendering.

  Raises:
    RenderError: the template failed on this conversation.
    TemplateError: the generation prompt after the first i messages is not a prefix of
      their rendering with the assistant's turn i after them.
  """
  turns = []  # (generation prompt, through the turn) per assistant turn, as rendered alone.
  for i, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    before = render(template, messages[:i], add_generation_prompt=True)
    through = render(template, messages[:i + 1])
    if not through.startswith(before):
      raise TemplateError(
          f"the chat template of {template.source} does not render the first {i} messages as "
          f"a prefix of the first {i + 1} (the generation prompt, then the assistant's turn), "
          "so the assistant's tokens cannot be found")
    turns.append((before, through))
  examples, text, spans = [], render(template, messages), []
  for before, through in reversed(turns):  # Latest first: the whole rendering holds the last.
    if not text.startswith(through):  # Rendered otherwise once later messages follow.
      if spans:
        examples.append((text, spans))
      text, spans = through, []
    spans.insert(0, (len(before), len(through)))
  examples.append((text, spans))
  return examples[::-1]
