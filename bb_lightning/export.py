"""``bb_lightning.export.export_hf`` as users import it; it lives in
:mod:`bb_lightning.hf.export`."""

from __future__ import annotations

from bb_lightning.hf.export import export_hf

__all__ = ["export_hf"]
