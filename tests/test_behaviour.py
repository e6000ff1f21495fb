"""Scheduling behaviour on a real trace: the stall FCFS causes and the budget trade-off.

Named window: Azure conv, test split, window seed 2 (60 trace-seconds), at 3x load,
Llama-2-7B on one H100 with the calibrated cost model.
"""

import numpy as np
import pytest

from envs.serving.setup import ServingSetup
from envs.serving.workload import load_workload
from policies.registry import make_policy

pytestmark = pytest.mark.needs_data("azure_llm_2023")


@pytest.fixture(scope="module")
def runs():
    setup = ServingSetup.from_names("llama2_7b", "h100_80gb", 1, "strict", "calibrated")
    trace = load_workload("azure_conv").window("test", 2, 3.0, 60.0)
    policies = ("fcfs", "sarathi_256", "sarathi_512", "sarathi_2048")
    return setup, trace, {p: setup.simulator(trace).run(make_policy(p)) for p in policies}


def _max_gap_unpreempted(result) -> float:
    o = result.outcomes
    return float(np.nanmax(o.stall[o.finished & (o.preemptions == 0)]))


def test_fcfs_stalls_decodes_behind_whole_prefills_and_sarathi_does_not(runs):
    setup, trace, res = runs
    admitted = trace.prompt_len + trace.output_len <= setup.model.max_context
    longest_prefill = setup.cost_model.prefill_time_alone(int(trace.prompt_len[admitted].max()))
    # Preemption gaps (recompute) are another story: compare requests never preempted.
    assert _max_gap_unpreempted(res["fcfs"]) >= longest_prefill
    assert _max_gap_unpreempted(res["sarathi_512"]) < longest_prefill
    assert res["sarathi_512"].metrics["tbt_p99_s"] < res["fcfs"].metrics["tbt_p99_s"]


def test_larger_budgets_trade_tbt_for_ttft(runs):
    _, _, res = runs
    ttft = [res[f"sarathi_{b}"].metrics["ttft_p50_s"] for b in (256, 512, 2048)]
    tbt = [res[f"sarathi_{b}"].metrics["tbt_p99_s"] for b in (256, 512, 2048)]
    assert ttft[0] > ttft[1] > ttft[2]
    assert tbt[0] < tbt[1] < tbt[2]


def test_same_config_and_seed_give_identical_per_request_metrics(runs):
    setup, trace, res = runs
    again = setup.simulator(trace).run(make_policy("sarathi_512")).outcomes
    first = res["sarathi_512"].outcomes
    for field in ("ttft", "tpot", "stall", "sched_delay", "good"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
