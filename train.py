"""Trains a language model with ZeRO: the checkout's entry to `zerojax/train.py`.

    python train.py                                     # configs/tiny.py on CPU, under 8 minutes
    python train.py --config configs/tiny.py --config.zero.stage=2 --workdir runs/x
    python train.py --config configs/70b_bf16.py --dry_run --fake_devices 64

The trainer lives in the package so that an installed zerojax runs it too
(`zerojax-train --config my_config.py`, the same flags). Read it in `zerojax/train.py`,
top-down: `setup` (config, data, the compiled step and its memory), `restore_or_init`,
`train_loop` (the steps: batch, step, log, evaluate, checkpoint, stop), `main`. Every
flag: `python train.py --help`; every exit status: `zerojax/runtime/exits.py`.
"""

import sys

from zerojax.train import main

if __name__ == "__main__":
  sys.exit(main())
