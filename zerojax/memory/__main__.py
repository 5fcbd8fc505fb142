"""`python -m zerojax.memory`: the planner's CLI, which lives with its tables in
`zerojax.memory_report` (this package, the planner, imports neither)."""

import sys

from zerojax.memory_report import main

sys.exit(main())
