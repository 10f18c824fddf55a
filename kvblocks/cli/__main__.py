"""`python -m kvblocks.cli`."""

import sys

from kvblocks.cli.commands import main

sys.exit(main())
