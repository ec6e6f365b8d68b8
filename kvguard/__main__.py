"""``python -m kvguard``: the ``kvguard`` command (:mod:`kvguard.cli`)."""

from __future__ import annotations

import sys

from kvguard.cli import main

if __name__ == "__main__":
    sys.exit(main())
