import sys

from commgemm.cli import main

sys.exit(main())
