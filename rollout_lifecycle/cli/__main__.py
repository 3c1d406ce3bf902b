"""``python -m rollout_lifecycle.cli``: the ``rollout-lifecycle`` command."""

import sys

from rollout_lifecycle.cli import main

sys.exit(main())
