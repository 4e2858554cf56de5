"""`python -m commgemm ...`: the CLI (`commgemm.cli`)."""

import sys

from commgemm.cli import main

sys.exit(main())
