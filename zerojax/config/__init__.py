"""Configs: the schema, key-by-key checks, the rules between keys, and loading.

The config room: `schema` (every key: default, type, choices, range, one line of help),
`checks` (a config against the schema key by key; `ConfigError`), `rules` (the rules
between keys and the mesh arithmetic), `families` (each Hugging Face family's architecture
keys), and here the loading (files, overrides, the command line). It imports the runtime
and `zerojax.mesh` only.

A config is a Python file whose `get_config()` starts from the schema's defaults
(`base_config()`, from `zerojax.config.schema`) and changes values. Command-line
overrides use ml_collections' `--config.a.b=value` syntax. Every mistake becomes
one `ConfigError` that names the key, where the value came from and the fix,
before any device work starts.

    python -m zerojax.config --config configs/tiny.py --config.zero.stage=2
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from zerojax.config.checks import (
  ConfigError,
  check_tree,
  closest,
  deepspeed_keys,
  flat_schema,
  group_error,
  parent_of,
  type_name,
  unknown_key,
)
from zerojax.config.families import family_preset
from zerojax.config.rules import resolve_mesh_shape, validate
from zerojax.config.schema import base_config, describe
from zerojax.runtime import exits

__all__ = ["ArgumentParser", "ConfigError", "base_config", "beside", "digest", "family_preset",
           "load_config", "parse_argv", "validate", "resolve_mesh_shape", "apply_override",
           "exit_on_config_error"]


def digest(config: ml_collections.ConfigDict) -> str:
  """A short hash of every key's value (16 hex digits): two configs that resolve alike,
  however their files and overrides got there, have the same digest. A recorded compile
  keeps its config's, so a change to the config (or to one it starts from) shows."""
  text = json.dumps(config.to_dict(), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _parse_value(text: str, kind: type, key: str, source: str) -> Any:
  """Parses an override string as the schema field's type, like ml_collections config_flags."""
  text = text.strip()
  try:
    if kind is bool:
      return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
    if kind is int:
      return int(text)
    if kind is float:
      return float(text)
    if kind is str:
      return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    return kind(ast.literal_eval(text))
  except (KeyError, ValueError, SyntaxError, TypeError):
    fix = "use true or false" if kind is bool else f"give {type_name(kind)}"
    raise ConfigError(f"cannot parse {text!r} as {type_name(kind)}.", key=key, source=source,
                      fix=fix) from None


def apply_override(config: ml_collections.ConfigDict, override: str,
                   origins: dict[str, str] | None = None) -> None:
  """Sets one `a.b=value` override on an unlocked config; `--config.` or `config.` may lead."""
  text = override.strip()
  for prefix in ("--config.", "config."):
    text = text[len(prefix):] if text.startswith(prefix) else text
  key, sep, raw = text.partition("=")
  key = key.strip()
  source = f"override --config.{text}"
  if not sep or not key:
    raise ConfigError(f"override {override!r} is not of the form key=value.", key=key or None,
                      fix="write it as --config.zero.stage=2")
  leaves, groups = flat_schema()
  if key in groups:
    raise group_error(key, source)
  if key not in leaves:
    raise unknown_key(key, source)
  value = _parse_value(raw, type(leaves[key]), key, source)
  parent, name = parent_of(config, key)
  try:
    setattr(parent, name, value)
  except TypeError:  # The file stored a wrongly typed value; ml_collections pins that type.
    del parent[name]
    setattr(parent, name, value)
  if origins is not None:
    origins[key] = source


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _describe_failure(exc: BaseException, path: str) -> ConfigError:
  """Turns an exception raised by a config file into a ConfigError naming the file line and key."""
  line, code = getattr(exc, "lineno", None), (getattr(exc, "text", None) or "").strip()
  for frame in traceback.extract_tb(exc.__traceback__):
    if os.path.abspath(frame.filename) == os.path.abspath(path):
      line, code = frame.lineno, (frame.line or "").strip()
  where = f"{path}, line {line}" + (f": {code}" if code else "") if line else path
  inner: Any = exc
  # ml_collections wraps KeyErrors in AttributeErrors.
  while isinstance(inner, BaseException) and inner.args:
    inner = inner.args[0]
  message = str(inner)
  field = re.search(r"field '(\w+)'.*?(\S+) is of original type <class '([\w.]+)'>"
                    r".*?type <class '([\w.]+)'>", message)
  missing = (re.search(r'Key "(\w+)" does not exist and cannot be added', message)
             or re.match(r"'(\w+)'(\nDid you mean|$)", message))
  name = (field or missing).group(1) if field or missing else None
  key = None
  if name:  # Recover the dotted key from `c.zero.stage = ...` on the failing line.
    written = re.search(r"\w+((?:\.\w+)*\." + name + r")\b", code)
    key = written.group(1)[1:] if written else name
  if missing:
    return unknown_key(key, where)
  if field:
    got, want = field.group(3).rsplit(".", 1)[-1], field.group(4).rsplit(".", 1)[-1]
    if want == "ConfigDict":
      return group_error(key, where)
    fix = "write the number without quotes" if got == "str" and want in ("int", "float") else (
        f"assign {type_name(_TYPES.get(want, object))}")
    shown = repr(field.group(2)) if got == "str" else field.group(2)
    return ConfigError(f"the file assigns {got} {shown}, but this key takes {want}.",
                       key=key, source=where, fix=fix)
  first = message.splitlines()[0][:300] if message else ""
  return ConfigError(f"running the config file failed: {type(exc).__name__}: {first}",
                     source=where, fix="fix the file so that get_config() runs")


def _not_python(path: str) -> ConfigError:
  """A config file that is not Python; for a DeepSpeed JSON, the zerojax key of each setting."""
  problem = (f"{path} is not a Python file; a zerojax config is a .py file whose get_config() "
             "returns an ml_collections.ConfigDict (e.g. configs/tiny.py).")
  fix = ("copy its values into such a file, or start from configs/tiny.py and pass "
         "--config.a.b=value")
  try:
    with open(path, encoding="utf-8") as f:
      tree = json.load(f)
  except (OSError, ValueError):
    tree = None
  if isinstance(tree, dict) and tree:
    problem += (" It parses as JSON (a DeepSpeed config?); its settings are these keys here:"
                "\n    ")
    problem += deepspeed_keys(tree)
  return ConfigError(problem, source="--config", fix=fix)


def _run_file(spec: str) -> tuple[ml_collections.ConfigDict, str]:
  """Runs `get_config()` (or `get_config(arg)` for `file.py:arg`) from a config file."""
  match = re.match(r"^(.*?\.py):(.*)$", spec)
  path, arg = ((match.group(1), match.group(2)) if match and not os.path.isfile(spec)
               else (spec, None))
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    near = (difflib.get_close_matches(os.path.basename(path), os.listdir(folder), n=3)
            if os.path.isdir(folder) else [])
    fix = ("did you mean " + ", ".join(os.path.join(folder, n) for n in near) + "?" if near
           else "pass the path of a Python file with get_config(), e.g. --config configs/tiny.py")
    raise ConfigError(f"config file {path} does not exist.", source="--config", fix=fix)
  if not path.endswith(".py"):
    raise _not_python(path)
  try:
    module_spec = importlib.util.spec_from_file_location("_zerojax_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
      raise ConfigError("the file has no get_config() function.", source=path,
                        fix="define get_config() that starts from zerojax.config.base_config() "
                            "and returns it")
    params = inspect.signature(get_config).parameters
    if arg is not None and not params:
      raise ConfigError(f"the file was given the argument {arg!r} (file.py:arg) but "
                        "get_config() takes none.", source=path,
                        fix=f"drop ':{arg}' or define get_config(arg)")
    config = get_config(arg) if arg is not None else get_config()
  except ConfigError:
    raise
  except Exception as exc:  # Anything the file raises is a config mistake, not a zerojax crash.
    raise _describe_failure(exc, path) from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"get_config() returned {type(config).__name__}, not an "
                      "ml_collections.ConfigDict.", source=path,
                      fix="start from zerojax.config.base_config() and return it")
  return config, path


def beside(config_file: str, name: str) -> ml_collections.ConfigDict:
  """The config of the file `name` in the folder of `config_file` (a config's own
  `__file__`): how one config file starts from another, wherever the folder is.

  Raises:
    ConfigError: as for `--config` (no such file, no `get_config()`, ...).
  """
  return _run_file(os.path.join(os.path.dirname(os.path.abspath(config_file)), name))[0]


def load_config(path: str, overrides: Sequence[str] = (), *,
                num_devices: int | None = None) -> ml_collections.ConfigDict:
  """Loads a config file, applies `--config.a.b=value` overrides, validates, returns it locked.

  Args:
    path: a Python file with get_config(); `file.py:arg` passes `arg` to get_config(arg).
    overrides: strings like "zero.stage=2" or "--config.zero.stage=2", applied in order.
    num_devices: when given, the mesh and batch are checked against this many devices.

  Raises:
    ConfigError: naming the key, its source (file or override) and the fix.
  """
  config, file_source = _run_file(path)
  check_tree(config, file_source)
  schema_leaves, _ = flat_schema()
  # A replaced group may hold ints in float fields; unify.
  for key, default in schema_leaves.items():
    parent, name = parent_of(config, key)
    if type(default) is float and type(parent[name]) is int:
      parent[name] = float(parent[name])
  origins = {"": file_source}
  for override in overrides:
    apply_override(config, override, origins)
  validate(config, num_devices=num_devices, source=origins)
  config.lock()  # Later typos in Python code (config.zero.stag) fail instead of adding keys.
  return config


def parse_argv(argv: Sequence[str], *,
               default: str | None = None) -> tuple[str, list[str], list[str]]:
  """Splits CLI args into (config path, overrides, remaining args).

  Understands `--config PATH`, `--config=PATH`, `--config.a.b=v` and `--config.a.b v`; stops
  at `--`.

  Raises:
    ConfigError: no --config (and no default), two of them, or an override without a value.
  """
  path, overrides, rest = None, [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == "--":
      rest += args[i:]
      break
    if arg == "--config" or arg.startswith("--config=") or arg.startswith("--config."):
      name, sep, value = arg.partition("=")
      if not sep:
        if i + 1 >= len(args) or args[i + 1].startswith("--"):
          fix = (f"write {name}=VALUE" if name != "--config"
                 else "write --config path/to/config.py")
          raise ConfigError(f"{name} has no value.", key=name[len("--config."):] or None,
                            source="the command line", fix=fix)
        value = args[i + 1]
        i += 1
      if name == "--config":
        if path is not None:
          raise ConfigError(f"--config was given twice ({path} and {value}).",
                            source="the command line",
                            fix="pass one config file; change single values with "
                                "--config.a.b=value")
        path = value
      else:
        overrides.append(f"{name[len('--config.'):]}={value}")
    else:
      rest.append(arg)
    i += 1
  if path is None:
    if default is None:
      raise ConfigError("no config file given.", source="the command line",
                        fix="pass --config path/to/config.py, e.g. --config configs/tiny.py")
    path = default
  return path, overrides, rest


class ArgumentParser(argparse.ArgumentParser):
  """argparse for the arguments `parse_argv` leaves: every mistake is a ConfigError.

  So a CLI under `exit_on_config_error` answers a bad command line with one `error:` line
  and exit status 2, never argparse's usage block, and names what was probably meant:
  `--confg` -> `--config`, a bare `configs/tiny.py` -> `--config configs/tiny.py`.
  """

  def __init__(self, *args: Any, default_config: str | None = None, **kwargs: Any):
    super().__init__(*args, **kwargs)
    # `parse_argv` takes these out before argparse runs; they are here for --help.
    group = self.add_argument_group("config (a Python file with get_config(), then overrides)")
    group.add_argument("--config", metavar="PATH", help="the config file" + (
        f" (default: {default_config})" if default_config else ""))
    group.add_argument("--config.KEY", metavar="VALUE", dest="_override",
                       help="set one key, e.g. --config.zero.stage=2; every key: "
                            "python -m zerojax.config --keys")

  def error(self, message: str):  # argparse's own mistakes: a bad or missing value.
    raise ConfigError(f"{message}.", source="the command line", fix=f"see {self.prog} --help")

  def parse_args(self, args=None, namespace=None):  # pylint: disable=arguments-differ
    known, extra = self.parse_known_args(args, namespace)
    if extra:
      raise self._unknown(extra[0])
    return known

  def _unknown(self, arg: str) -> ConfigError:
    if arg.startswith("-"):
      name = arg.split("=", 1)[0]
      options = [o for a in self._actions for o in a.option_strings
                 if o.startswith("--") and o not in ("--help", "--config.KEY")]
      # --cofig.zero.stage=2 is a --config.zero.stage=2 with a typo in its prefix.
      head = name.partition(".")[0]
      near = difflib.get_close_matches(head, options, n=1, cutoff=0.6)
      keys = closest(name.lstrip("-"), list(flat_schema()[0]))  # --steps: --config.train.steps.
      fix = (f"did you mean {near[0]}{arg[len(head):]}?" if near else
             f"did you mean --config.{keys[0]}{arg[len(name):]}?" if keys else
             f"see {self.prog} --help; config values are set with --config.a.b=value")
      return ConfigError(f"unknown option {name}.", source="the command line", fix=fix)
    if arg.endswith(".py") or os.path.isfile(arg):
      fix = f"write --config {arg}"
    elif "=" in arg:
      fix = f"write --config.{arg}"
    else:
      fix = f"see {self.prog} --help"
    return ConfigError(f"{arg!r} is not an option: {self.prog} takes no positional arguments.",
                       source="the command line", fix=fix)


def exit_on_config_error(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Decorates a CLI entry point: a ConfigError prints `error: <message>` to stderr and exits
  with `exits.BAD_INPUT`."""

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    try:
      return fn(*args, **kwargs)
    except ConfigError as exc:
      print(f"error: {exc}", file=sys.stderr, flush=True)
      sys.exit(exits.BAD_INPUT)

  return wrapper


@exit_on_config_error
def main(argv: Sequence[str] | None = None) -> int:
  """Prints the resolved config of --config F [--config.a.b=v ...] [--num_devices N]."""
  path, overrides, rest = parse_argv(sys.argv[1:] if argv is None else argv, default="")
  parser = ArgumentParser(prog="python -m zerojax.config", description=main.__doc__)
  parser.add_argument("--num_devices", type=int,
                      help="check the mesh and batch against this many devices")
  parser.add_argument("--keys", action="store_true",
                      help="print every config key: default, choices, help")
  args = parser.parse_args(rest)  # --help, and unknown arguments exit here (status 2).
  if args.keys:
    print(describe())
    return 0
  if not path:
    raise ConfigError("no config file given.", source="the command line",
                      fix="pass --config configs/tiny.py")
  config = load_config(path, overrides, num_devices=args.num_devices)
  print(config, end="")
  if args.num_devices is not None:
    shape = resolve_mesh_shape(config, args.num_devices)
    print(f"# mesh (data, expert, fsdp) on {args.num_devices} devices: {shape}")
  return 0
