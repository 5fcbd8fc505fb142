"""Every key at its default: the starting point to copy for a config of your own.

The schema (each key's default, type, choices, range and a line of help) lives in the
package, `zerojax/config/schema.py`; `python -m zerojax.config --keys` prints it. A config file
is any Python file with a `get_config()` that starts from `base_config()` and changes
values; a key the schema does not define is an error.

    python train.py --config configs/base.py --config.zero.stage=2
"""

import ml_collections

from zerojax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  return base_config()
