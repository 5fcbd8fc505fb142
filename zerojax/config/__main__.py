"""`python -m zerojax.config --config FILE [--config.a.b=value ...]`: the resolved config."""

import sys

from zerojax.config import main

sys.exit(main())
