"""`python -m replicator.cli`: the `replicator` command without its console script."""

import sys

from replicator.cli import main

sys.exit(main())
