"""`python -m zerojax.generate`: see `zerojax.generate.cli`."""

import sys

from zerojax.generate.cli import main

sys.exit(main())
