"""Tests for zerojax.data: every token source on real files, each bad-data error, resume and
process slices."""

import json
import os
import time

import ml_collections
import numpy as np
import pytest

from zerojax import config as zc, data
from zerojax.data import DataError

tokenizers = pytest.importorskip("tokenizers")

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                    "base.py")
SENTENCES = ["the cat sat on the mat", "a dog ran to the cat",
             "the mat was red and the dog was blue",
             "on a hill the cat slept"]


def data_config(**values) -> ml_collections.ConfigDict:
  c = zc.base_config().data
  c.update(values)
  return c


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
  """A tiny word-level tokenizer.json (ids 0-1 special, 16 words), trained here."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
  path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
  tok.save(path)
  return path


def encode(tokenizer_path: str, text: str) -> list[int]:
  return tokenizers.Tokenizer.from_file(tokenizer_path).encode(text).ids


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_round_trip_and_held_out_tail(tmp_path, dtype):
  ids = np.random.default_rng(0).integers(0, 1000, size=4000).astype(dtype)
  path = tmp_path / "train.bin"
  ids.tofile(path)
  train, held_out = data.load_tokens(data_config(name="tokens", path=str(path), dtype=dtype), 1000,
                                     16)
  assert isinstance(train, np.memmap) and train.dtype == dtype
  np.testing.assert_array_equal(np.concatenate([train, held_out]), ids)
  assert len(held_out) == 200  # eval_fraction 0.05.


def test_npy_round_trip_and_eval_file(tmp_path):
  ids = np.arange(3000, dtype=np.int32) % 500
  np.save(tmp_path / "train.npy", ids)
  np.save(tmp_path / "val.npy", ids[:100].astype(np.uint16))
  train, held_out = data.load_tokens(data_config(name="tokens", path=str(tmp_path / "train.npy"),
                                                 eval_path=str(tmp_path / "val.npy")), 500, 16)
  np.testing.assert_array_equal(train, ids)  # With an eval file nothing is held out of train.
  np.testing.assert_array_equal(held_out, ids[:100])
  assert train.dtype == np.int32 and held_out.dtype == np.uint16


def test_jsonl_is_tokenized_and_packed_with_eos(tmp_path, tokenizer_path):
  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps({"id": i, "body": s}) + "\n" for i,
                          s in enumerate(SENTENCES * 5)) + "\n")
  c = data_config(name="text", path=str(path), tokenizer=tokenizer_path, text_key="body",
                  eval_fraction=0.2)
  train, held_out = data.load_tokens(c, 64, 8)
  expected = np.concatenate([encode(tokenizer_path,
                                    s) + [1] for s in SENTENCES * 5])  # </s> is id 1.
  assert train.dtype == np.uint32
  np.testing.assert_array_equal(np.concatenate([train, held_out]), expected)
  # An explicit eos_id replaces the tokenizer's.
  train, _ = data.load_tokens(data_config(**{**c.to_dict(), "eos_id": 0}), 64, 8)
  assert train[len(encode(tokenizer_path, SENTENCES[0]))] == 0


def test_txt_is_one_document_and_is_cached(tmp_path, tokenizer_path):
  text = "\n\n".join(SENTENCES * 3)
  (tmp_path / "book.txt").write_text(text)
  (tmp_path / "val.txt").write_text(SENTENCES[1] + " " + SENTENCES[2])
  c = data_config(name="text", path=str(tmp_path / "book.txt"), eval_path=str(tmp_path / "val.txt"),
                  tokenizer=tokenizer_path)
  cache = tmp_path / "cache"
  train, held_out = data.load_tokens(c, 64, 8, cache_dir=str(cache))
  np.testing.assert_array_equal(train, encode(tokenizer_path, text) + [1])
  np.testing.assert_array_equal(held_out, encode(tokenizer_path,
                                                 SENTENCES[1] + " " + SENTENCES[2]) + [1])
  cached = sorted(p.name for p in cache.iterdir())
  assert len(cached) == 2 and all(n.startswith("tokens-") and n.endswith(".npy") for n in cached)
  again, _ = data.load_tokens(c, 64, 8, cache_dir=str(cache))
  assert isinstance(again, np.memmap)  # Read back from the cache, not re-tokenized.
  np.testing.assert_array_equal(again, train)
  # The cache is itself a `tokens` source.
  np.testing.assert_array_equal(data.read_token_file(str(cache / cached[0])), train)


def test_eos_from_tokenizer_config(tmp_path, tokenizer_path):
  tok = data.load_tokenizer(tokenizer_path, 64)
  assert data.eos_token_id(tok, tokenizer_path) == 1  # Found by name: </s>.
  local = tmp_path / "tokenizer.json"
  local.write_text(open(tokenizer_path).read())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "[UNK]"}}))
  assert data.eos_token_id(tok, str(local)) == 0


def test_stdlib_is_the_default():
  c = zc.base_config()
  train, held_out = data.load_tokens(c.data, c.model.vocab_size, c.train.seq_len)
  assert train.dtype == np.uint8 and len(held_out) == pytest.approx(len(train) / 19, rel=1e-3)


def write(path, content) -> str:
  if isinstance(content, np.ndarray):
    np.save(path, content) if str(path).endswith(".npy") else content.tofile(path)
  else:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
  return str(path)


# (file name, content, config values, model vocab, text the message must hold); every case
# names its file.
BAD = [
    ("missing.bin", None, {}, 100, "no such file"),
    ("empty.bin", b"", {}, 100, "empty"),
    ("odd.bin", b"\x01\x00\x02", {}, 100, "uint16 | uint32"),
    ("wide.bin", np.arange(200, dtype=np.uint32) % 50, {"dtype": "uint16"}, 100,
     "data.dtype='uint32'"),
    ("narrow.bin", np.arange(200, dtype=np.uint16), {"dtype": "uint32"}, 100,
     "data.dtype='uint16'"),
    ("big.bin", np.r_[np.zeros(100), 77, 5, 300, np.zeros(10)].astype(np.uint16), {}, 100,
     "reach 300, but model.vocab_size is 100 (first id out of range at position 102)"),
    ("floats.npy", np.zeros(100, np.float32), {}, 100, "float32 values"),
    ("grid.npy", np.zeros((10, 10), np.int32), {}, 100, "shape (10, 10)"),
    ("neg.npy", np.r_[np.zeros(50), -3].astype(np.int64), {}, 100, "-3 at position 50"),
    ("junk.npy", b"not numpy", {}, 100, "not a readable .npy"),
    ("ids.csv", b"1,2,3", {}, 100, ".bin"),
    ("short.bin", np.zeros(16, np.uint16), {}, 100, "train split has 16 tokens"),
    ("tail.bin", np.zeros(40, np.uint16), {"eval_fraction": 0.2}, 100,
     "held-out split has 8 tokens"),
]


@pytest.mark.parametrize("name, content, values, vocab, text", BAD, ids=[b[0] for b in BAD])
def test_bad_token_file(tmp_path, name, content, values, vocab, text):
  path = str(tmp_path / name) if content is None else write(tmp_path / name, content)
  with pytest.raises(DataError) as info:
    data.load_tokens(data_config(name="tokens", path=path, **values), vocab, 16)
  message = str(info.value)
  assert path in message and text in message and "fix:" in message, message


BAD_TEXT = [
    ("docs.jsonl", '{"text": "the cat"}\n{"text": "a dog"\n', "line 2 is not JSON"),
    ("docs.jsonl", '{"text": "the cat"}\n\n{"body": "a dog"}\n',
     "line 3 has no string field 'text' (found: 'body')"),
    ("docs.jsonl", '{"text": "the cat"}\n[1, 2]\n', "line 2 has no string field"),
    ("docs.jsonl", '{"text": ""}\n', "no text"),
    ("docs.txt", b"\xff\xfe the cat", "not UTF-8"),
    ("docs.md", "the cat", ".jsonl"),
    ("docs.txt", "the cat sat", "train split has 4 tokens"),
]


@pytest.mark.parametrize("name, content, text", BAD_TEXT, ids=[b[2][:20] for b in BAD_TEXT])
def test_bad_text_file(tmp_path, tokenizer_path, name, content, text):
  path = write(tmp_path / name, content)
  with pytest.raises(DataError) as info:
    data.load_tokens(data_config(name="text", path=path, tokenizer=tokenizer_path, eval_path=path),
                     64, 8)
  message = str(info.value)
  assert path in message and text in message, message


def test_bad_tokenizer(tmp_path, tokenizer_path):
  c = data_config(name="text", path=write(tmp_path / "a.txt", " ".join(SENTENCES)),
                  tokenizer=tokenizer_path)
  with pytest.raises(DataError,
                     match=r"17 ids, more than model.vocab_size=10[\s\S]*vocab_size >= 17"):
    data.load_tokens(c, 10, 4)
  with pytest.raises(DataError, match=r"eos_id=99 is not an id of this tokenizer"):
    data.load_tokens(data_config(**{**c.to_dict(), "eos_id": 99}), 64, 4)
  c.tokenizer = write(tmp_path / "tokenizer.json", "{nope")
  with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
    data.load_tokens(c, 64, 4)
  c.tokenizer = str(tmp_path / "none.json")
  with pytest.raises(DataError, match=r"none.json \(data.tokenizer\): no such file"):
    data.load_tokens(c, 64, 4)


def test_tokenizer_without_eos_asks_for_eos_id(tmp_path):
  from tokenizers import Tokenizer, models
  path = str(tmp_path / "tokenizer.json")
  Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(path)
  with pytest.raises(DataError, match="set data.eos_id"):
    data.eos_token_id(data.load_tokenizer(path, 64), path)


def test_missing_tokenizers_package_says_how_to_install(monkeypatch, tokenizer_path):
  monkeypatch.setitem(__import__("sys").modules, "tokenizers",
                      None)  # `import tokenizers` now fails.
  with pytest.raises(DataError, match=r"pip install 'zerojax\[text\]'"):
    data.load_tokenizer(tokenizer_path, 64)


def test_bad_ids_in_a_large_file_are_found_in_bounded_chunks(tmp_path, monkeypatch):
  monkeypatch.setattr(data, "_SCAN_CHUNK", 1000)  # Many chunks; the bad id sits in the 8th.
  ids = np.zeros(10_000, np.uint32)
  ids[7_123], ids[9_999] = 5000, 70_000
  with pytest.raises(DataError, match=r"reach 70000.*position 7123"):
    data.check_ids(ids, 4096, path="x.bin")
  data.check_ids(np.full(10, 65535, np.uint16), 65536,
                 path="x.bin")  # uint16 always fits 65536 ids.


def test_resume_replays_the_uninterrupted_order(tmp_path):
  ids = np.random.default_rng(1).integers(0, 50_000, size=20_000).astype(np.uint32)
  path = write(tmp_path / "train.bin", ids)
  c = data_config(name="tokens", path=path, dtype="uint32")
  train, _ = data.load_tokens(c, 50_000, 32)
  uninterrupted = [data.batch_at(train, step, 8, 32, seed=5) for step in range(10)]
  # A new process (a fresh memmap) resuming at step 6 sees the same batches.
  resumed, _ = data.load_tokens(c, 50_000, 32)
  for step in range(6, 10):
    np.testing.assert_array_equal(data.batch_at(resumed, step, 8, 32, seed=5), uninterrupted[step])


@pytest.mark.parametrize("count", [1, 2, 4])
def test_process_slices_concatenate_to_the_global_batch(count):
  tokens = np.arange(5000, dtype=np.uint16)
  for step in (0, 3):
    full = data.batch_at(tokens, step, 16, 8, seed=2)
    rows = [data.rows_for(16, i, count) for i in range(count)]
    assert [r.stop - r.start for r in rows] == [16 // count] * count
    np.testing.assert_array_equal(np.concatenate([full[r] for r in rows]), full)
    # Each process gathers only its own rows, with the same values.
    np.testing.assert_array_equal(np.concatenate([data.batch_at(tokens, step, 16, 8, 2,
                                                                rows=r) for r in rows]),
                                  full)
  with pytest.raises(ValueError, match="cannot be split over 3"):
    data.rows_for(16, 0, 3)
  assert data.process_rows(16) == data.rows_for(16, 0, 1)


# Config keys each source needs: (body run on `c`, key the message must name, more text it
# must contain).
BAD_CONFIG = [
    ("c.data.name = 'tokens'", "data.path", ".bin or .npy"),
    ("c.data.name = 'text'\nc.data.path = 'a.jsonl'", "data.tokenizer", "tokenizer.json"),
    ("c.data.name = 'text'\nc.data.path = 'a.jsonl'\nc.data.tokenizer = 't.json'\n"
     "c.data.text_key = ''",
     "data.text_key", "'text'"),
    ("c.data.path = 'a.bin'", "data.path", "data.name='tokens'"),
    ("c.model.vocab_size = 100", "model.vocab_size", ">= 256"),
    ("c.data.name = 'bin'", "data.name", "'stdlib', 'tokens', 'text'"),
    ("c.data.dtype = 'int16'", "data.dtype", "did you mean 'uint16'"),
    ("c.data.eos_id = -2", "data.eos_id", "-1"),
]


@pytest.mark.parametrize("body, key, text", BAD_CONFIG,
                         ids=[b[1] + ":" + b[0][-16:] for b in BAD_CONFIG])
def test_bad_data_config(tmp_path, body, key, text):
  path = tmp_path / "config.py"
  path.write_text("from zerojax.config import base_config\n\n"
                  "def get_config():\n  c = base_config()\n"
                  + "".join(f"  {line}\n" for line in body.splitlines()) + "  return c\n")
  with pytest.raises(zc.ConfigError) as info:
    zc.load_config(str(path))
  message = str(info.value)
  assert f"config key {key}" in message and text in message, message


def test_good_data_configs_load(tmp_path):
  for overrides in (["data.name=tokens", "data.path=a.bin", "data.dtype=uint32"],
                    ["data.name=text", "data.path=a.jsonl", "data.tokenizer=t.json",
                     "data.eos_id=2"]):
    c = zc.load_config(BASE, overrides)
    assert c.data.name == overrides[0].split("=")[1]


def test_a_directory_is_called_a_directory(tmp_path, tokenizer_path):
  with pytest.raises(DataError, match="is a directory, not a file") as info:
    data.load_tokens(data_config(name="tokens", path=str(tmp_path)), 100, 16)
  assert str(tmp_path) in str(info.value) and "data.path" in str(info.value)
  with pytest.raises(DataError, match="is a directory, not a file"):
    data.load_tokens(data_config(name="text", path=write(tmp_path / "a.txt", "the cat"),
                                 tokenizer=str(tmp_path)), 100, 1)


def test_a_token_file_changed_under_its_memory_map_is_an_error(tmp_path):
  path = write(tmp_path / "ids.bin", np.arange(4096, dtype=np.uint16) % 100)
  train, held_out = data.load_tokens(data_config(name="tokens", path=path), 100, 16)
  data.batch_at(train, 0, 4, 16, 0)
  # Replaced by a rename: the map keeps the old pages, training may go on.
  write(tmp_path / "new.bin", np.zeros(10, np.uint16))
  os.replace(tmp_path / "new.bin", path)
  data.batch_at(train, 1, 4, 16, 0)
  # Rewritten in place, same size (so no SIGBUS, but other tokens than were checked).
  path = write(tmp_path / "other.bin", np.arange(4096, dtype=np.uint16) % 100)
  train, _ = data.load_tokens(data_config(name="tokens", path=path), 100, 16)
  time.sleep(0.05)  # File times tick at the kernel's coarse clock (up to 10 ms).
  with open(path, "r+b") as f:
    f.write(b"\xff\xff")
  with pytest.raises(DataError, match="rewritten in place, same size"):
    data.batch_at(train, 2, 4, 16, 0)
  # Truncated: the next read past the new end would be a SIGBUS.
  path = write(tmp_path / "third.npy", np.arange(4096, dtype=np.uint32) % 100)
  train, held_out = data.load_tokens(data_config(name="tokens", path=path), 100, 16)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.truncate(1024)
  for tokens in (train, held_out):
    with pytest.raises(DataError) as info:
      data.batch_at(tokens, 3, 4, 16, 0)
    assert (f"{path} (data.path): changed while training (size {size} -> 1024 bytes)"
            in str(info.value))
