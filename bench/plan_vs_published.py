"""Sanity check of the cost model: OPT-30B bulk generation, planned vs published figures.

Job: 4096 prompts of 512 tokens, 32 new tokens each (the FlexGen setting), on the
T4-16GB preset with 208 GB of host memory (the FlexGen machine), beside the
throughputs published in Sheng et al. 2023, "FlexGen", Table 2 (OPT-30B, T4,
generation throughput in tokens/s), planned twice: as the planner chooses (there, the KV
cache on the host and decode attention on the host's cores, two groups of sequences in
flight) and with attention kept on the device (``PlanOverrides(decode_attention=
Tier.DEVICE)``, ``--decode-attention device``). Then OPT-30B on the ZeRO-Inference 2023 release's
RTX A6000 machine (the ``a6000`` preset: 48 GB, PCIe Gen4, 252 GB DRAM) beside its published
21.84 tokens/s and FlexGen's 13.40 there, and the same job planned for this machine's
measured profile. This compares a prediction with other systems' measurements on
other hardware: a sanity check of the cost model, not a claim.

Run: ``.venv/bin/python bench/plan_vs_published.py [--num-prompts N] [--no-measure]``
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _common

from bb_lightning.planner import Plan, PlanError, PlanOverrides, PredictJob, make_plan, preset
from bb_lightning.planner.models import builtin_config
from bb_lightning.probe import measure, model_profile_from_config
from storage.tiers import Tier

PUBLISHED = {  # tokens/s, FlexGen paper Table 2, OPT-30B on one T4 (16 GB), 208 GB DRAM
    "FlexGen": 7.32,
    "DeepSpeed ZeRO-Inference": 0.60,
    "Hugging Face Accelerate": 0.62,
}
PUBLISHED_A6000 = {  # tokens/s, OPT-30B on one RTX A6000 (48 GB), 252 GB DRAM
    "DeepSpeed ZeRO-Inference (2023 release)": 21.84,
    "FlexGen (as measured there)": 13.40,
}
DEVICE_ATTENTION = PlanOverrides(decode_attention=Tier.DEVICE)


def _table(planned: dict[str, float], published: dict[str, float]) -> None:
    """Each planned throughput, then each published one with planned / published."""
    print(f"\n{'system':<54}{'tokens/s':>10}   planned / system")
    for name, tps in planned.items():
        print(f"{name:<54}{tps:>10.2f}")
    for name, tps in published.items():
        ratios = " · ".join(f"{p / tps:.2f}" for p in planned.values())
        print(f"{name + ' (published)':<54}{tps:>10.2f}   {ratios}")


def _where(plan: Plan) -> str:
    """Where the plan's KV cache lives and its decode attention runs, in words."""
    attention = plan.placement.decode_attention or Tier.DEVICE
    return f"KV cache on {(plan.kv_cache or Tier.DEVICE).value}, attention on {attention.value}"


def main() -> None:
    """Print the planned throughput beside the published ones, with ratios."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=4096)
    ap.add_argument("--no-measure", action="store_true", help="skip this machine's profile")
    args = ap.parse_args()
    print(_common.machine(Path(tempfile.gettempdir())))  # where the NVMe probe runs
    print("NOTE: a sanity check of the cost model against published measurements on other")
    print("      hardware and software, not a claim about this library's speed.")
    model = model_profile_from_config(builtin_config("opt-30b"))
    model = model.__class__(**{**model.to_dict(), "name": "opt-30b"})
    job = PredictJob(prompt_len=512, new_tokens=32, num_prompts=args.num_prompts)
    hw = preset("t4").replace(host_memory=208 * 10**9)
    plan = make_plan(model, hw, job)
    device = make_plan(model, hw, job, overrides=DEVICE_ATTENTION)
    print(
        f"\nOPT-30B, {job.num_prompts} prompts x 512 tokens, 32 new tokens, {hw.name}, 208 GB host:"
    )
    print(plan.explain())
    print("\nthe same with decode attention kept on the device (--decode-attention device):")
    print(device.explain())
    _table(
        {
            f"this planner ({_where(plan)})": plan.tokens_per_s,
            "this planner, attention on device (forced)": device.tokens_per_s,
        },
        PUBLISHED,
    )
    a6000 = make_plan(model, preset("a6000"), job)
    print(f"\nOPT-30B, same job, {a6000.hardware.name}:")
    print(a6000.explain())
    _table({f"this planner ({_where(a6000)})": a6000.tokens_per_s}, PUBLISHED_A6000)
    if args.no_measure:
        return
    with tempfile.TemporaryDirectory(prefix="bb-nvme-") as nvme_dir:
        local = measure(nvme_path=nvme_dir)
    print(f"\nsame job planned for this machine ({local.name}):")
    try:
        lp = make_plan(model, local, job)
    except PlanError as err:
        print(f"  no plan: {err}")
        return
    print(lp.explain())
    print(f"this machine / T4 preset (both predicted): {lp.tokens_per_s / plan.tokens_per_s:.3f}")


if __name__ == "__main__":
    main()
