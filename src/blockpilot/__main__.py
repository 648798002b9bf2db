"""`python -m blockpilot`: the same as the `blockpilot` command."""

import sys

from blockpilot.cli import main

sys.exit(main())
