"""The ``bb-lightning`` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``bb-lightning``."""
    args = sys.argv[1:] if argv is None else argv
    print(f"bb-lightning: no subcommand handles {args!r} yet", file=sys.stderr)
    return 2
