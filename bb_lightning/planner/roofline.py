"""Roofline plot of a Plan: tokens per pass (log) against predicted tokens/s (log)."""

from __future__ import annotations

import os

import numpy as np

from bb_lightning.planner.plan import Plan
from storage.tiers import Link

__all__ = ["plot_roofline"]

_LINK_LABELS = {Link.NVME_TO_HOST: "NVMe read"}
"""Legend names other than the link's own (``host->device``)."""


def plot_roofline(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Draw the compute bound, each link's bound, the predicted curve and the chosen point.

    A link bound is ``tokens_per_pass * bandwidth / bytes_per_pass`` tokens/s (the
    bytes a pass moves over that link, weights plus per-token KV traffic); the
    compute bound is ``device FLOP/s / FLOPs per token``. The optimizer is left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = plan.roofline
    chosen = float(plan.tokens_per_pass)
    x = np.logspace(0, max(np.log10(chosen) + 2.0, 4.0), 200)
    compute_bound = roof.device_flops / roof.flops_per_token
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, np.full_like(x, compute_bound), "k-", label="compute bound")
    for link, bw in roof.bandwidth.items():
        per_pass = roof.bytes_per_pass.get(link, 0.0)
        per_tok = roof.bytes_per_token.get(link, 0.0)
        if per_pass <= 0 and per_tok <= 0:
            continue
        bound = x * bw / (per_pass + per_tok * x)
        ax.plot(x, bound, "--", label=f"{_LINK_LABELS.get(link, link)} bound")
    curve = np.array([roof.tokens_per_s(float(t)) for t in x])
    ax.plot(x, curve, "b-", linewidth=2, label="predicted")
    ax.plot([chosen], [roof.tokens_per_s(chosen)], "ro", markersize=8, label="chosen")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(compute_bound * 1e-3, compute_bound * 3)
    ax.set_xlabel("tokens per pass")
    ax.set_ylabel("tokens/s (one pass, optimizer aside)")
    ax.set_title(f"{plan.task} {plan.model.name} on {plan.hardware.name}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
