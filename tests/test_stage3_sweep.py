"""Stage 3 trains on every mesh size, vocabulary and SFT layout (issue 30's abort).

A character-level SFT task (a 78-token tokenizer, vocab 80 below d_model 128) aborted at
stage 3 on 4 and 8 fake CPU devices: XLA:CPU ran the head's gather beside the layer
loop's gathers, each device in its own order, and its collectives deadlocked or read
each other's buffers (`zerojax.stage3.after`, docs/design/cpu-collectives.md). This file
trains the same task at stage 3 over 1, 2, 4 and 8 devices x a vocabulary below and
above d_model, each with gradient release off or on and packed or unpacked rows such
that every pair of levels of the four factors is trained (a covering array of strength
2: 8 runs, not the 32 of the whole product), 3 steps each, in one child process with
XLA:CPU's memory-optimized scheduler (train.py's flags), which is the schedule that put
the two gathers side by side. Without the fix the child aborts (exit 134) or hangs
within its first configurations.
"""

import json
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest

from zerojax import build as build_lib, data as data_lib
from zerojax.config import load_config
from zerojax.data import sft
from zerojax.runtime.device_env import CPU_MEMORY_FLAGS, fake_devices_env
from zerojax.step import init_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = (4, 8, 2, 1)  # The meshes that aborted first: a regression fails fast.
VOCABS = (80, 160)  # Below and above d_model (128): the embedding is sharded on D, then V.
STEPS = 3
LEVELS = dict(devices=DEVICES, vocab=VOCABS, release=(False, True), pack=(False, True))


def write_task(folder: str) -> tuple[str, str]:
  """A reverse-the-word SFT task and its character-level tokenizer (78 tokens)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (text extra)
  rng = random.Random(7)
  letters = "abcdefghijklmnopqrstuvwxyz"
  data = os.path.join(folder, "train.jsonl")
  with open(data, "w") as f:
    for _ in range(600):
      w = "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
      f.write(json.dumps({"prompt": f"reverse: {w}\n", "completion": w[::-1]}) + "\n")
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eot_id|>", "<pad>"]
  chars = sorted(set(letters + " :\n0123456789" + letters.upper() + ".,?!'-"))
  vocab = {t: i for i, t in enumerate(specials + chars)}
  vocab["[UNK]"] = len(vocab)
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tokenizer.add_special_tokens(specials)
  tokenizer.decoder = decoders.Fuse()
  path = os.path.join(folder, "tokenizer.json")
  tokenizer.save(path)
  return data, path


def configurations() -> list[tuple[int, int, bool, bool]]:
  """(devices, vocab, release, pack) of every run: each mesh with each vocabulary (the
  pair that aborted), release and packing varied so that each of the six pairs of
  factors meets all its level pairs. The abort needs a mesh of 4+ devices and the head
  sharded on d_model (vocab below it); release and packing change the loops and the
  batch layout around it. The whole product (32 runs, 160 s) found nothing these miss."""
  runs = []
  for i, n in enumerate(DEVICES):
    for j, vocab in enumerate(VOCABS):
      # The first run is the one that aborted first: 4 devices, vocab 80, packed rows.
      runs.append((n, vocab, bool(j ^ (i & 1)), not j ^ (i >> 1)))
  return runs


def sweep(data: str, tokenizer: str) -> None:
  """The child: every configuration, 3 steps each, a JSON line per run (runs in order:
  an abort leaves the runs done so far on stdout). Its devices and XLA flags come from
  the environment the test gives it."""
  for n, vocab, release, pack in configurations():
    overrides = [
        f"model.vocab_size={vocab}", "zero.stage=3",
        f"mesh.fsdp={n}", f"train.steps={STEPS}",
        "optimizer.warmup_steps=1", "data.name=sft", f"data.path={data}",
        f"data.tokenizer={tokenizer}", f"data.pack={pack}",
        f"optimizer.release={release}"]
    if release:
      overrides.append("optimizer.release_clipping=per_layer")
    c = load_config(os.path.join(ROOT, "configs", "tiny.py"),
                    [f"--config.{o}" for o in overrides], num_devices=n)
    built = build_lib.build(c, devices=jax.devices()[:n])
    train, _, _ = sft.load(c.data, vocab, c.train.seq_len)
    state = init_state(built.plan, built.model.init, built.tx, jax.random.key(0),
                       built.loss_scaling)
    losses = []
    for step in range(STEPS):
      local = sft.batch_at(train, step, c.train.global_batch_size, c.seed)
      state, m = built.train_step(
          state, data_lib.global_batch(local, built.batch_sharding))
      losses.append(float(m["loss"]))  # Waits: one step in flight at a time.
    print(json.dumps(dict(devices=n, vocab=vocab, release=release, pack=pack,
                          losses=losses, finite=bool(np.isfinite(losses).all()))),
          flush=True)


@pytest.mark.slow  # 8 compiles (32 took 162 s in the full suite: benchmarks/README.md).
def test_stage3_trains_on_every_mesh_vocab_and_layout(tmp_path):
  pytest.importorskip("tokenizers")
  data, tokenizer = write_task(str(tmp_path))
  # The suite's quicker code generation (conftest.FAST_COMPILE: LLVM at -O0, the legacy
  # fusion emitters, one codegen chunk) beside train.py's memory flags: the HLO schedule
  # is train.py's scheduler's, and the code before the fix aborts in the first
  # configuration with them too (tests/mutations.sh's stage3_order).
  from conftest import FAST_COMPILE  # noqa: PLC0415  (not in the child: its devices)
  env = fake_devices_env(8, *CPU_MEMORY_FLAGS, *FAST_COMPILE)
  out = subprocess.run([sys.executable, __file__, data, tokenizer], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
  assert out.returncode == 0, (f"exit {out.returncode} after {len(runs)} runs:\n"
                               + out.stderr[-3000:])
  assert len(runs) == len(configurations())
  pairs = lambda a, b: {(r[a], r[b]) for r in runs}  # Every pair of levels, trained.
  for a, b in [("devices", "vocab"), ("devices", "release"), ("devices", "pack"),
               ("vocab", "release"), ("vocab", "pack"), ("release", "pack")]:
    want = {(x, y) for x in LEVELS[a] for y in LEVELS[b]}
    assert pairs(a, b) == want, (a, b)
  for run in runs:
    assert run["finite"], run
    # lr warms up from 0 at step 1: the later steps learn.
    assert run["losses"][-1] < run["losses"][0], run


if __name__ == "__main__":
  sweep(*sys.argv[1:])
