"""Fuzz every input surface of ``bb-lightning`` with hypothesis and count what breaks.

    .venv/bin/python bench/fuzz.py --examples 2000          # inputs per surface
    .venv/bin/python bench/fuzz.py --minutes 15             # shared out across the surfaces
    .venv/bin/python bench/fuzz.py --surface store --examples 300 --json out.json

For each surface of :data:`fuzz_targets.SURFACES` (and the prompts and recipe surfaces of
:mod:`fuzz_text`) it mutates copies of a valid seed (:mod:`fuzz_mutate`) and runs the entry
points on each (:func:`fuzz_targets.run_case`). A crash is any breach of the contract: an
exception other than a one-line ``ValueError`` / ``OSError`` / ``NvmeError`` naming the
input, a hang, a changed input. Crashes are counted distinct by (exception type, the
innermost frame of ours); the campaign keeps going after each. Prints per surface the inputs
tried and the distinct crashes with one example each, and writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import fuzz_targets as targets  # neighbours: the script's folder is on sys.path
import fuzz_text
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

ALL = {**targets.SURFACES, **fuzz_text.SURFACES}


@dataclass
class Tally:
    """What one surface's campaign found."""

    tried: int = 0
    """Inputs run."""
    crashes: dict[str, str] = field(default_factory=dict)
    """``type at file:line`` -> the first example's detail."""


def campaign(
    surface: targets.Surface, work: Path, examples: int, seconds: float, seed: int
) -> Tally:
    """Run up to ``examples`` inputs (or until ``seconds`` pass) on ``surface``, in rounds of
    :data:`ROUND` inputs, each its own hypothesis run with its own seed (a run cut short by
    the clock would draw differently from hypothesis' record of it)."""
    tally = Tally()
    stop = time.monotonic() + seconds

    def one(data: st.DataObject) -> None:
        tally.tried += 1
        try:
            targets.run_case(surface, data, work)
        except targets.Crash as crash:
            key = f"{crash.key[0]} at {crash.key[1]}"
            tally.crashes.setdefault(key, str(crash)[:400])
        except Exception as exc:  # the harness's own fault: counted and shown
            key = f"harness {type(exc).__name__} at {targets._where(exc)}"
            tally.crashes.setdefault(key, repr(exc)[:400])

    rounds = 0
    while tally.tried < examples and time.monotonic() < stop:
        run = settings(
            max_examples=min(ROUND, examples - tally.tried),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate],
        )(hypothesis_seed(seed * 100_003 + rounds)(given(st.data())(one)))
        run()
        rounds += 1
    return tally


ROUND = 20
"""Inputs per hypothesis run of a campaign."""


def main() -> int:
    """Parse the options, run each surface's campaign, print and write the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="inputs per surface")
    parser.add_argument("--minutes", type=float, help="total time, shared out equally")
    parser.add_argument("--surface", action="append", choices=sorted(ALL), help="repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="fuzz-summary.json", help="summary file")
    args = parser.parse_args()
    names = args.surface or list(ALL)
    per = args.minutes * 60 / len(names) if args.minutes else float("inf")
    examples = 10**9 if args.minutes else args.examples
    summary: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bb-fuzz-") as tmp:
        for name in names:
            start = time.monotonic()
            tally = campaign(ALL[name], Path(tmp) / name, examples, per, args.seed)
            took = time.monotonic() - start
            summary[name] = {
                "inputs": tally.tried,
                "crashes": len(tally.crashes),
                "seconds": round(took, 1),
                "found": tally.crashes,
            }
            print(
                f"{name:14s} inputs {tally.tried:6d}  crashes {len(tally.crashes):3d}  "
                f"({took:.0f} s)",
                flush=True,
            )
            for key, detail in tally.crashes.items():
                print(f"    {key}: {detail}", flush=True)
    Path(args.json).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    total = sum(int(str(s["crashes"])) for s in summary.values())
    print(f"total crashes {total}; summary in {args.json}")
    return 1 if total else 0


if __name__ == "__main__":
    raise SystemExit(main())
