"""`python -m zerojax.memory` (and `zerojax-memory`): the planner's CLI, `zerojax.memory.report`."""

import sys

from zerojax.memory.report import main

sys.exit(main())
