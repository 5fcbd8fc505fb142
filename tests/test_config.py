"""Tests for zerojax.config: loading, overrides, and one clear ConfigError per mistake."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from zerojax import config as zc
from zerojax.config import checks

from conftest import FAST_COMPILE
from test_train import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.py")
TINY = os.path.join(REPO, "configs", "tiny.py")


def write_config(tmp_path, body: str, name: str = "bad.py") -> str:
  """Writes a real config file that starts from the base schema and runs `body` on `c`."""
  path = tmp_path / name
  path.write_text("from zerojax.config import base_config\n\n\n"
                  "def get_config():\n  c = base_config()\n"
                  + textwrap.indent(textwrap.dedent(body), "  ") + "\n  return c\n")
  return str(path)


def test_base_and_tiny_load_and_validate():
  base = zc.load_config(BASE, num_devices=8)
  assert base.zero.stage == 3 and base.mesh.fsdp == -1
  assert zc.resolve_mesh_shape(base, 8) == (1, 1, 8)
  tiny = zc.load_config(TINY, num_devices=8)
  # tiny starts from base: same keys, only values differ.
  assert tiny.to_dict().keys() == base.to_dict().keys()
  assert tiny.train.steps != base.train.steps
  for n in (1, 2, 4, 8, 16):
    zc.validate(tiny, num_devices=n)
  zc.validate(zc.base_config())


def test_loaded_config_is_locked():
  config = zc.load_config(TINY)
  with pytest.raises(AttributeError):
    config.zero.stag = 2
  config.zero.stage = 1  # Values may still change.


def test_overrides_of_each_type():
  config = zc.load_config(TINY, [
      "zero.stage=2", "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=5",
      "optimizer.nesterov=TRUE",
      "--config.optimizer.name=sgd", "config.workdir='/tmp/run 1'", "optimizer.eps=1",
      "mesh.data=2",
  ], num_devices=8)
  assert config.zero.stage == 2 and isinstance(config.zero.stage, int)
  assert config.optimizer.learning_rate == 1e-3
  assert config.optimizer.nesterov is True
  assert config.optimizer.name == "sgd"
  assert config.workdir == "/tmp/run 1"
  assert config.optimizer.eps == 1.0 and isinstance(config.optimizer.eps, float)
  assert zc.resolve_mesh_shape(config, 8) == (2, 1, 4)
  for text, want in [("0", False), ("1", True), ("false", False), ("True", True)]:
    assert zc.load_config(TINY, [f"optimizer.nesterov={text}"]).optimizer.nesterov is want


def test_file_with_argument(tmp_path):
  path = tmp_path / "arg.py"
  path.write_text("from zerojax.config import base_config\n\n\ndef get_config(stage='3'):\n"
                  "  c = base_config()\n  c.zero.stage = int(stage)\n  return c\n")
  assert zc.load_config(f"{path}:1").zero.stage == 1
  assert zc.load_config(str(path)).zero.stage == 3


def test_parse_argv():
  argv = ["--config", "configs/tiny.py", "--config.zero.stage=2", "--steps_hint",
          "--config.train.steps", "7",
          "--config.optimizer.learning_rate", "-1e-3", "extra"]
  path, overrides, rest = zc.parse_argv(argv)
  assert path == "configs/tiny.py"
  assert overrides == ["zero.stage=2", "train.steps=7", "optimizer.learning_rate=-1e-3"]
  assert rest == ["--steps_hint", "extra"]
  assert zc.parse_argv(["--config=a.py", "--", "--config.x=1"]) == (
      "a.py", [], ["--", "--config.x=1"])
  assert zc.parse_argv([], default="configs/tiny.py")[0] == "configs/tiny.py"
  config = zc.load_config(TINY, zc.parse_argv(["--config", TINY, "--config.zero.stage", "1"])[1])
  assert config.zero.stage == 1


@pytest.mark.parametrize("argv, key", [
    (["--config", "a.py", "--config.zero.stage"], "zero.stage"),
    (["--config", "a.py", "--config.zero.stage", "--config.seed=1"], "zero.stage"),
    (["--config.zero.stage=1"], "--config"),
    (["--config", "a.py", "--config=b.py"], "--config"),
    (["--config"], "--config"),
])
def test_parse_argv_errors(argv, key):
  with pytest.raises(zc.ConfigError, match=key):
    zc.parse_argv(argv)


# Bad config FILES: (body run on `c` after base_config(), key the message must name, more
# text it must contain).
BAD_FILES = [
    ("c.seeed = 1", "seeed", "did you mean seed"),
    ("c.zero.stag = 2", "zero.stag", "zero.stage"),
    ("import ml_collections\nc.bfloat16 = ml_collections.ConfigDict({'enabled': True})",
     "bfloat16.enabled",
     "precision.param_dtype"),
    ("c.zero_optimization = 2", "zero_optimization", "zero.stage"),
    ("c.train_batch_size = 32", "train_batch_size", "train.global_batch_size"),
    ("c.gradient_accumulation_steps = 4", "gradient_accumulation_steps", "train.microbatches"),
    ("c.zero.stage = '2'", "zero.stage", "without quotes"),
    ("c.train.steps = 1.5", "train.steps", "float"),
    ("c.zero.stage = True", "zero.stage", "must be an int"),
    ("c.zero.stage = 4", "zero.stage", "0, 1, 2, 3"),
    ("c.precision.param_dtype = 'bf16'", "precision.param_dtype", "'bfloat16'"),
    ("c.precision.compute_dtype = 'float16'", "precision.compute_dtype", "loss scaling"),
    ("c.precision.reduce_dtype = 'fp32'", "precision.reduce_dtype", "'float32'"),
    ("c.optimizer.name = 'adam'", "optimizer.name", "adamw"),
    ("c.optimizer.schedule = 'cosin'", "optimizer.schedule", "cosine"),
    ("c.mesh.data = -1", "mesh", "both -1"),
    ("c.mesh.data = 0", "mesh.data", "-1"),
    ("c.optimizer.warmup_steps = 500", "optimizer.warmup_steps", "train.steps"),
    ("c.optimizer.b2 = 1.0", "optimizer.b2", "[0, 1)"),
    ("c.optimizer.learning_rate = 0", "optimizer.learning_rate", "> 0"),
    ("c.model.name = 'mlp_lm'; c.model.context = 1000", "model.context", "train.seq_len"),
    ("c.model.context = 16", "model.context", "mlp_lm"),
    ("c.model.name = 'mlp_lm'; c.model.remat = 'save_qkv_proj'", "model.remat", "by-name"),
    ("c.model.n_kv_heads = 3", "model.n_kv_heads", "divide"),
    ("c.data.eval_fraction = 0.9", "data.eval_fraction", "(0, 0.5]"),
    ("c.train.microbatches = 3", "train.global_batch_size", "microbatches"),
    ("del c.zero['stage']", "zero.stage", "missing"),
    ("c.lock()\nc.zero.stag = 1", "zero.stag", "zero.stage"),
    ("c.zero = 3", "zero", "group"),
    ("c.train.steps = c.train.stepz", "train.stepz", "did you mean train.steps"),
]


@pytest.mark.parametrize("body, key, text", BAD_FILES,
                         ids=[b[1] + ":" + b[0][:20] for b in BAD_FILES])
def test_bad_config_file(tmp_path, body, key, text):
  path = write_config(tmp_path, body)
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(path)
  message = str(info.value)
  assert key in message and text in message, message
  assert path in message, message  # Says which file it came from.


# Bad overrides on a good file: (override, num_devices, key the message must name, more
# text it must contain).
BAD_OVERRIDES = [
    ("optimizer.nesterov=maybe", None, "optimizer.nesterov", "true or false"),
    ("train.steps=1.5", None, "train.steps", "an int"),
    ("optimizer.learning_rate=fast", None, "optimizer.learning_rate", "a number"),
    ("optimizer.learning_rate=nan", None, "optimizer.learning_rate", "finite"),
    ("zero.stag=2", None, "zero.stag", "zero.stage"),
    ("bf16=true", None, "bf16", "precision.param_dtype"),
    ("fp16.enabled=true", None, "fp16.enabled", "loss scaling"),
    ("gradient_clipping=1", None, "gradient_clipping", "optimizer.grad_clip"),
    ("train_micro_batch_size_per_gpu=2", None, "train_micro_batch_size_per_gpu",
     "train.microbatches"),
    ("optimizer.lr=1", None, "optimizer.lr", "optimizer.learning_rate"),
    ("max_steps=10", None, "max_steps", "train.steps"),
    ("zero.stage", None, None, "key=value"),
    ("mesh.data=3", 8, "mesh.data", "1, 2, 4, 8"),
    ("mesh.data=3", None, "train.global_batch_size", "15 or 18"),
    ("mesh.fsdp=2", 8, "mesh.data", "fsdp=-1"),
    ("mesh.data=-1", 8, "mesh", "both -1"),
    ("train.global_batch_size=20", 8, "train.global_batch_size", "16 or 24"),
    ("optimizer.release_write_behind=true", None, "optimizer.release_write_behind",
     "needs gradient release and a layer stack in host memory"),
    ("optimizer.release_writes_first=true", None, "optimizer.release_writes_first",
     "needs optimizer.release_write_behind=True"),
]


@pytest.mark.parametrize("override, num_devices, key, text", BAD_OVERRIDES,
                         ids=[b[0] for b in BAD_OVERRIDES])
def test_bad_override(override, num_devices, key, text):
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(TINY, [override], num_devices=num_devices)
  message = str(info.value)
  assert (key is None or key in message) and text in message, message
  if "=" in override:
    assert f"override --config.{override}" in message, message


def test_the_digest_follows_the_resolved_values_not_how_they_were_set():
  """`zc.digest`: the same for a config however a value got there (its default, an
  override naming it), other for any value changed."""
  base = zc.digest(zc.load_config(TINY))
  assert zc.digest(zc.load_config(TINY, ["zero.stage=3"])) == base  # tiny's own value.
  assert zc.digest(zc.load_config(TINY, ["zero.stage=2"])) != base
  assert zc.digest(zc.load_config(TINY, ["optimizer.learning_rate=0.5"])) != base


def test_batch_microbatch_combination():
  zc.load_config(TINY, ["train.microbatches=2"], num_devices=8)
  with pytest.raises(zc.ConfigError, match="train.global_batch_size"):
    zc.load_config(TINY, ["train.microbatches=4"], num_devices=8)


def test_missing_file_and_missing_get_config(tmp_path):
  with pytest.raises(zc.ConfigError, match="does not exist"):
    zc.load_config(str(tmp_path / "nope.py"))
  empty = tmp_path / "empty.py"
  empty.write_text("x = 1\n")
  with pytest.raises(zc.ConfigError, match="get_config"):
    zc.load_config(str(empty))
  broken = tmp_path / "broken.py"
  broken.write_text("def get_config(:\n")
  with pytest.raises(zc.ConfigError, match="SyntaxError"):
    zc.load_config(str(broken))


def _run_cli(*args: str) -> subprocess.CompletedProcess:
  """`python -m zerojax.config`'s `main` in this process (`test_train.run_main`: the exit
  status, stdout and stderr). The module run as a process, from an installed wheel, is
  test_non_editable_install_loads_configs_from_anywhere's."""
  return run_main(zc.main, *args)


def test_cli_bad_config_exits_2_without_traceback(tmp_path):
  path = write_config(tmp_path, "c.zero.stag = 2")
  result = _run_cli("--config", path)
  assert result.returncode == 2, result
  assert result.stderr.startswith("error: ") and "zero.stag" in result.stderr, result.stderr
  assert "Traceback" not in result.stderr
  result = _run_cli("--config", TINY, "--config.optimizer.nesterov", "maybe")
  assert result.returncode == 2 and "optimizer.nesterov" in result.stderr
  assert "Traceback" not in result.stderr


def test_cli_prints_resolved_config():
  result = _run_cli("--config", TINY, "--config.zero.stage=1", "--num_devices", "8")
  assert result.returncode == 0, result.stderr
  assert "stage: 1" in result.stdout and "(1, 1, 8)" in result.stdout


# Precision and optimizer combinations: (body run on `c`, key the message must name, more
# text it must contain).
BAD_PRECISION = [
    ("c.precision.param_dtype = 'float16'\nc.precision.compute_dtype = 'bfloat16'",
     "precision.compute_dtype",
     "mixes float16 and bfloat16"),
    ("c.precision.param_dtype = 'bfloat16'\nc.precision.compute_dtype = 'float16'",
     "precision.compute_dtype",
     "same 16-bit format"),
    ("c.precision.param_dtype = 'float16'\nc.precision.compute_dtype = 'float16'\n"
     "c.optimizer.update_rule = 'stochastic'", "optimizer.update_rule",
     "bfloat16 params, not float16"),
    ("c.precision.param_dtype = 'float32'\nc.optimizer.update_rule = 'stochastic'",
     "optimizer.update_rule",
     "'kahan'"),
    ("c.precision.param_dtype = 'float32'\nc.optimizer.update_rule = 'kahan'",
     "optimizer.update_rule",
     "'nearest'"),
    ("c.precision.param_dtype = 'float32'\nc.optimizer.update_rule = 'master'",
     "optimizer.update_rule",
     "float32"),
    ("c.optimizer.state_dtype = 'bfloat16'\nc.optimizer.b2 = 0.999", "optimizer.b2", "b2 <= 0.996"),
    ("c.precision.reduce_dtype = 'float16'", "precision.reduce_dtype", "overflow"),
    ("c.precision.accum_dtype = 'fp16'", "precision.accum_dtype", "overflow"),
    ("c.optimizer.update_rule = 'kahn'", "optimizer.update_rule", "did you mean 'kahan'"),
    ("c.optimizer.state_dtype = 'float64'", "optimizer.state_dtype", "'float32', 'bfloat16'"),
    ("c.optimizer.name = 'lino'", "optimizer.name", "did you mean 'lion'"),
    ("c.precision.loss_scale.window = 0", "precision.loss_scale.window", ">= 1"),
    ("c.precision.loss_scale.hysteresis = 0", "precision.loss_scale.hysteresis", ">= 1"),
    ("c.precision.loss_scale.initial_power = 41", "precision.loss_scale.initial_power", "[0, 40]"),
    ("c.precision.loss_scale.min_scale = 0.0", "precision.loss_scale.min_scale", "> 0"),
    ("c.precision.max_consecutive_skips = -1", "precision.max_consecutive_skips", ">= 0"),
]


@pytest.mark.parametrize("body, key, text", BAD_PRECISION,
                         ids=[b[1] + ":" + b[0][-24:] for b in BAD_PRECISION])
def test_bad_precision_combination(tmp_path, body, key, text):
  path = write_config(tmp_path, body)
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(path)
  message = str(info.value)
  assert key in message and text in message, message
  assert path in message, message


def test_bad_precision_override_names_the_override():
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(TINY, ["optimizer.b2=0.999"])
  message = str(info.value)
  assert "optimizer.b2" in message and "fix:" in message, message
  assert "state_dtype='float32'" in message, message
  assert "override --config.optimizer.b2=0.999" in message, message
  with pytest.raises(zc.ConfigError, match="precision.compute_dtype"):
    zc.load_config(TINY, ["precision.param_dtype=float16"])  # compute stays bfloat16.
  with pytest.raises(zc.ConfigError, match="precision.loss_scale.window"):
    zc.load_config(TINY, ["precision.loss_scale.window=0"])


@pytest.mark.parametrize("overrides", [
    ["optimizer.name=lion"],
    ["optimizer.name=lion", "optimizer.state_dtype=float32", "optimizer.update_rule=nearest",
     "precision.param_dtype=float32", "precision.compute_dtype=float32"],
    ["precision.param_dtype=float16", "precision.compute_dtype=float16",
     "precision.loss_scale.initial_power=12",
     "precision.loss_scale.window=200", "precision.loss_scale.min_scale=0.5",
     "precision.max_consecutive_skips=0"],
    # fp32 params, fp16 compute.
    ["precision.param_dtype=float32", "precision.compute_dtype=float16",
     "optimizer.update_rule=nearest"],
    ["precision.param_dtype=float32", "precision.compute_dtype=bfloat16",
     "optimizer.update_rule=nearest"],
    ["optimizer.update_rule=stochastic"],  # bfloat16 params (the default).
    ["optimizer.update_rule=master"],
    ["optimizer.state_dtype=float32", "optimizer.b2=0.999"],
    ["optimizer.state_dtype=bfloat16", "optimizer.b2=0.996"],
    ["optimizer.name=lion", "optimizer.b2=0.999"],  # Lion keeps one momentum: no nu to freeze.
    ["optimizer.name=sgd", "optimizer.b2=0.999"],
], ids=lambda o: ",".join(x.split(".")[-1] for x in o))
def test_good_precision_combinations_load(overrides):
  config = zc.load_config(TINY, overrides, num_devices=8)
  for override in overrides:
    key, value = override.split("=")
    parent, name = checks.parent_of(config, key)
    assert str(parent[name]) == value or float(parent[name]) == float(value), (key, parent[name])


def test_new_schema_keys_have_defaults():
  c = zc.load_config(TINY)
  assert c.optimizer.state_dtype == "bfloat16" and c.optimizer.update_rule == "kahan"
  assert c.precision.max_consecutive_skips == 10 and c.precision.loss_scale.window == 1000
  assert c.precision.loss_scale.hysteresis == 2 and c.precision.loss_scale.min_scale == 1.0


def test_config_that_is_not_python_says_so(tmp_path):
  ds = tmp_path / "ds_config.json"
  ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9,
                                                                                            0.95]}},
                            "zero_optimization": {"stage": 2, "overlap_comm": True}}))
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(str(ds))
  message = str(info.value)
  assert "not a Python file" in message and "get_config()" in message
  for line in ["train_micro_batch_size_per_gpu = 4: set train.global_batch_size and "
               "train.microbatches",
               "steps_per_print = 10: use train.log_every",
               'optimizer.type = "AdamW": use optimizer.name',
               "optimizer.params.lr = 0.0001: use optimizer.learning_rate",
               "optimizer.params.betas = [0.9, 0.95]: use optimizer.b1, optimizer.b2",
               "zero_optimization.stage = 2: use zero.stage",
               "no zerojax setting: zero_optimization.overlap_comm"]:  # Not the ZeRO stage's hint.
    assert "\n    " + line in message, (line, message)
  for name, text in [("base.yml", "train:\n  steps: 10\n"), ("list.json", "[1, 2]")]:
    (tmp_path / name).write_text(text)
    with pytest.raises(zc.ConfigError, match="is not a Python file") as info:
      zc.load_config(str(tmp_path / name))
    assert "DeepSpeed" not in str(info.value)


def test_workdir_must_be_a_directory(tmp_path):
  (tmp_path / "file").write_text("")
  for workdir, text in [(tmp_path / "file", "is a file, not a directory."),
                        (tmp_path / "file" / "run", "would be inside it")]:
    with pytest.raises(zc.ConfigError, match=text) as info:
      zc.load_config(TINY, [f"workdir={workdir}"])
    assert info.value.key == "workdir"
  assert zc.load_config(TINY, [f"workdir={tmp_path / 'new' / 'run'}"]).workdir  # Created later.


def test_argument_parser_mistakes_are_config_errors():
  parser = zc.ArgumentParser(prog="train.py")
  parser.add_argument("--fake_devices", type=int, default=0)
  parser.add_argument("--dry_run", action="store_true")
  assert parser.parse_args(["--fake_devices", "8"]).fake_devices == 8
  for args, text in [(["--fake_devices", "x"], "invalid int value: 'x'"),
                     (["--fake_devices"], "expected one argument"),
                     (["--dryrun"], "did you mean --dry_run?"),
                     (["--confg=a.py"], "did you mean --config=a.py?"),
                     (["--cnfig.zero.stage", "2"], "did you mean --config.zero.stage?"),
                     (["configs/tiny.py"], "write --config configs/tiny.py"),
                     (["zero.stage=2"], "write --config.zero.stage=2"),
                     (["--steps=3"], "did you mean --config.train.steps=3?"),
                     (["--xyzzy"], "--config.a.b=value")]:
    with pytest.raises(zc.ConfigError, match=re.escape(text)):
      parser.parse_args(args)


@pytest.mark.slow
def test_non_editable_install_loads_configs_from_anywhere(tmp_path):
  """A built wheel, installed on its own (no checkout on sys.path), trains from a copied config
  with its `zerojax-train` console script on one CPU device (no fake devices), and its
  other scripts run.

  The schema and the trainer are in the package, so nothing depends on the checkout's
  `configs/` folder or train.py.
  """
  wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
  subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), REPO], check=True,
                 capture_output=True)
  wheel = next(wheels.glob("zerojax-*.whl"))
  subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                 capture_output=True)
  elsewhere.mkdir()
  (elsewhere / "tiny.py").write_text(open(TINY).read())
  # One CPU device (not conftest's 8), conftest's quicker code generation.
  env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": " ".join(FAST_COMPILE)}
  run = lambda *args: subprocess.run(args, cwd=elsewhere, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=300)
  # Where `import zerojax` finds the package (its spec: the same search of sys.path,
  # without importing JAX; the scripts below import it from there).
  where = run(sys.executable, "-c",
              "import importlib.util; print(importlib.util.find_spec('zerojax').origin)")
  assert where.stdout.startswith(str(site)), where.stdout + where.stderr
  printed = run(sys.executable, "-m", "zerojax.config", "--config", "tiny.py")
  assert printed.returncode == 0 and "stage: 3" in printed.stdout, printed.stderr
  script = lambda name: str(site / "bin" / f"zerojax-{name}")  # noqa: E731 (pip --target's bin/)
  # No checkout, so no default config: the error names the flag.
  bare = run(script("train"))
  assert bare.returncode == 2 and "--config path/to/config.py" in bare.stderr, bare.stderr
  # One layer, two steps: what is tested is where the code comes from, not the model.
  trained = run(script("train"), "--config", "tiny.py", "--config.train.steps=2",
                "--config.model.n_layers=1", "--config.optimizer.warmup_steps=1",
                "--config.train.eval_every=0", "--workdir", "run")
  assert trained.returncode == 0, trained.stderr[-2000:]
  assert "done: 2 steps" in trained.stdout + trained.stderr
  header = json.loads((elsewhere / "run" / "metrics.jsonl").read_text().splitlines()[0])
  assert header["devices"] == 1
  planned = run(script("memory"), "--config", "tiny.py", "--devices", "8",
                "--device-memory", "1GiB")
  assert planned.returncode == 0 and "total per device" in planned.stdout, planned.stderr
  # The run is a Llama with a checkpoint: export writes a HF folder from it.
  exported = run(script("export"), "--workdir", "run", "--out", "hf")
  assert exported.returncode == 0, exported.stderr[-2000:]
  assert (elsewhere / "hf" / "config.json").exists()
  for name in ("launch", "generate"):
    helped = run(script(name), "--help")
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr
