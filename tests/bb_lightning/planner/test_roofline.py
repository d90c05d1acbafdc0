"""The roofline plot's data (``bb-lightning plan --plot``): the chosen point at the plan's
predicted tokens/s, a bound for every phase busy during the step, and curves through the
same job re-planned at other tokens per pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from bb_lightning.cli import main
from bb_lightning.planner import FitJob, PredictJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.planner.plan import LINK_FIELDS, LINKS, PlanOverrides
from bb_lightning.planner.roofline import roofline_data
from bb_lightning.probe import model_profile_from_config
from storage.tiers import Link

UNCHUNKED = PlanOverrides(chunked=False)


@pytest.fixture(scope="module")
def rtx4090_30b() -> object:
    """llama-30b fine-tuned on the rtx4090 preset (optimizer state and gradients on NVMe),
    every micro-batch in one piece: a step the NVMe's writes bound."""
    model = model_profile_from_config(builtin_config("llama-30b"))
    job = FitJob(seq_len=2048, global_batch_seqs=512)
    return make_plan(model, preset("rtx4090"), job, overrides=UNCHUNKED)


def test_the_chosen_point_is_the_plans_throughput_and_every_busy_link_bounds_it(
    rtx4090_30b: object,
) -> None:
    plan = rtx4090_30b
    data = roofline_data(plan)  # type: ignore[arg-type]
    p = plan.predicted  # type: ignore[attr-defined]
    chosen = data.chosen
    assert (chosen.tokens_per_pass, chosen.tokens_per_s) == (
        plan.tokens_per_pass,  # type: ignore[attr-defined]
        plan.tokens_per_s,  # type: ignore[attr-defined]
    )
    # each phase busy in the step with its busy seconds: the NVMe write-back of gradients
    # and optimizer state (which bounds this step), the reads, both PCIe links, AdamW
    want = {LINK_FIELDS[link]: p.on(link) for link in LINKS} | {
        "compute": p.compute,
        "optimizer": p.optimizer,
    }
    assert chosen.busy == {k: v for k, v in want.items() if v > 0}
    assert {"nvme_write", "nvme_read", "optimizer", "compute"} <= set(chosen.busy)
    bounds = chosen.bounds
    tokens_per_step = plan.job.tokens_per_step  # type: ignore[attr-defined]
    assert bounds["nvme_write"] == pytest.approx(tokens_per_step / p.nvme_write, rel=1e-9)
    # the step is slower than its compute alone allows, bound by the disk's writes: the
    # chosen point lies under every bound and within 5 % of the tightest
    assert chosen.tokens_per_s < 0.5 * bounds["compute"]
    assert min(bounds, key=lambda k: bounds[k]) == "nvme_write"
    assert chosen.tokens_per_s <= min(bounds.values())
    assert chosen.tokens_per_s >= 0.95 * min(bounds.values())


def test_the_curves_are_the_job_replanned_at_each_size_that_fits(rtx4090_30b: object) -> None:
    plan = rtx4090_30b
    data = roofline_data(plan)  # type: ignore[arg-type]
    xs = [pt.tokens_per_pass for pt in data.curve]
    assert xs == sorted(xs) and data.chosen in data.curve
    model, hw, job = plan.model, plan.hardware, plan.job  # type: ignore[attr-defined]
    for pt in data.curve:
        again = make_plan(
            model,
            hw,
            job,
            overrides=PlanOverrides(micro_batch=pt.tokens_per_pass // 2048, chunked=False),
        )
        assert pt.tokens_per_s == again.tokens_per_s
    # 8 sequences of 2048 tokens do not fit the 24 GiB card: the sweep stops there
    assert min(data.unplanned) == 8 * 2048 and max(xs) < min(data.unplanned)


def test_a_predict_plan_has_its_point_at_its_generated_tokens_per_s() -> None:
    model = model_profile_from_config(builtin_config("llama-1.5b"))
    job = PredictJob(prompt_len=256, new_tokens=32, num_prompts=64)
    plan = make_plan(model, preset("t4"), job)
    data = roofline_data(plan)
    assert data.chosen.tokens_per_s == plan.tokens_per_s
    assert data.chosen.tokens_per_pass == plan.tokens_per_pass
    assert data.chosen.busy["compute"] == plan.predicted.compute
    assert data.chosen.busy.get("h2d", 0.0) == plan.predicted.on(Link.HOST_TO_DEVICE)


def test_plan_plot_writes_the_picture(tmp_path: Path) -> None:
    out = tmp_path / "roof.png"
    argv = ["plan", "--model", "llama-1.5b", "--hardware", "t4", "--plot", str(out)]
    assert main(argv) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
