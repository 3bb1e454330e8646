"""``python -m harness VERB``: the same verbs as the `wiiide-lab` command (harness.cli)."""

import sys

from harness.cli import main

sys.exit(main())
