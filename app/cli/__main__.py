"""``python -m app.cli``: the same as the ``kv-valet`` command."""

import sys

from app.cli import main

sys.exit(main())
