"""``python -m bb_lightning.cli``: the ``bb-lightning`` command without its console script."""

from __future__ import annotations

from bb_lightning.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
