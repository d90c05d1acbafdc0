"""Which blocks a training engine recomputes in backward, when a plan has decided it.

A plan prices its recompute for the device it was planned for
(:meth:`~bb_lightning.planner.plan.Plan.recomputed_blocks`): a GPU preset copies
HOST-home blocks to the device, so it recomputes them, while on a CPU device the
engine could use the same blocks in place. The engine runs what the plan priced:
:func:`planned_autograd_blocks` keeps activations (ordinary autograd) for exactly the
blocks the plan does not recompute, and refuses a plan that keeps bound a block this
device can only copy in (a CPU plan run on a GPU).
"""

from __future__ import annotations

from collections.abc import Collection

from bb_lightning.placement import Placement
from storage.tiers import Tier

__all__ = ["planned_autograd_blocks"]


def planned_autograd_blocks(placement: Placement, in_place: Collection[Tier]) -> frozenset[int]:
    """Blocks run with ordinary autograd: those ``placement.recomputed`` and
    ``placement.swapped`` leave out.

    Args:
        placement: a placement carrying a plan's ``recomputed`` blocks.
        in_place: weight homes this device uses without a copy (DEVICE; HOST on a CPU).

    Raises ``ValueError`` when the plan keeps bound a block whose home this device
    copies in (a copied block is always recomputed).
    """
    assert placement.recomputed is not None, "only for a placement a plan decided"
    recomputed = set(placement.recomputed) | set(placement.swapped or ())
    bound = frozenset(i for i in range(len(placement.weights)) if i not in recomputed)
    copied = sorted(i for i in bound if placement.weights[i] not in in_place)
    if copied:
        tiers = sorted({placement.weights[i].value for i in copied})
        raise ValueError(
            f"the plan keeps the activations of blocks {copied} (homed on {tiers}), but this "
            f"device copies those blocks in and must recompute them: plan with a hardware "
            "profile of the device the job runs on (e.g. hardware='measure')"
        )
    return bound
