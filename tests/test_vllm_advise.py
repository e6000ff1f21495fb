"""``bench/advise_vllm.py``, the advisor checked against vLLM, inside the pinned vLLM
(``pip install -e '.[dev,vllm]'``; skipped without it): the served candidates are chosen as its
docstring says, the traffic file is the replay's slice, and a plumbing run (a 3-second window, a
quarter of the profile grid, two candidates on vLLM) prints its JSON with the SLO it says it set.
"""

from __future__ import annotations

import json
import math
import statistics
from itertools import combinations

import numpy as np
import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: pip install -e '.[dev,vllm]', then uninstall torchvision torchaudio torchcodec",
)

from bench.advise_vllm import choose, main, write_traffic  # noqa: E402
from engine.replay import replay_trace  # noqa: E402
from engine.vllm_backend import llm  # noqa: E402
from engine.vllm_backend.replay import load_config  # noqa: E402

SLICE = ["workload=azure_code", "seed=1", "load_scale=120", "window_s=30"]
"""15 requests over 3 s of the bursty code trace."""


def _apart(scores: list[float], apart: float) -> bool:
    return all(max(a, b) >= (1 + apart) * min(a, b) for a, b in combinations(scores, 2))


def test_choose_starts_with_the_recommendation_and_keeps_scores_apart():
    scores = [0.68, 0.70, 0.73, 0.85, 1.12, 1.29, 3.38, 3.39, 6.94, 6.94, math.inf, math.nan]
    chosen = choose(scores, 1, 5, 0.15)
    assert chosen[0] == 1 and len(chosen) == 5 and len(set(chosen)) == 5
    assert _apart([scores[i] for i in chosen], 0.15)
    assert 8 in chosen and 9 not in chosen  # the top of the range; its tie goes to the earlier one
    assert not {10, 11} & set(chosen)  # no finite score, no rank
    assert choose([1.0, 1.05, 1.1], 0, 3, 0.15) == [0]  # none far enough: the recommendation alone
    with pytest.raises(ValueError, match="predicted score"):
        choose([math.inf, 1.0], 0, 2, 0.15)


def test_traffic_file_is_the_replay_slice(tmp_path):
    trace = replay_trace(load_config(SLICE))
    traffic = write_traffic(trace, tmp_path / "traffic.csv")
    back = traffic.trace_at(1.0)
    assert len(back) == len(trace) > 0
    np.testing.assert_array_equal(back.prompt_len, trace.prompt_len)
    np.testing.assert_array_equal(back.output_len, trace.output_len)
    np.testing.assert_allclose(back.arrival_s, trace.arrival_s - trace.arrival_s[0], atol=1e-9)


@pytest.mark.slow
def test_plumbing_run_serves_the_recommendation_and_prints_its_json(tmp_path, capsys):
    main(
        [
            *SLICE,
            "served=2",
            "grid_stride=4",
            "repeats=1",
            "warmup=0",
            f"out={tmp_path / 'out'}",
            f"report={tmp_path / 'report' / 'advise_vllm'}",
            f"checkpoints={tmp_path / 'checkpoints'}",
        ]
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["vllm_version"] == llm.VERSION and isinstance(summary["load_avg"], float)
    assert summary["advise_vllm_err_max"] >= 0
    tau = summary["advise_vllm_tau"]
    assert math.isnan(tau) or -1 <= tau <= 1  # NaN: the two scorings tie every pair
    served = summary["served"]
    assert [r["name"] for r in served] == summary["candidates_served"]
    assert served[0]["name"] == summary["recommended"] and len(served) == 2
    assert _apart([r["worst_ratio_predicted"] for r in served], 0.15)
    requests = summary["traffic"]["requests"]
    assert all(r["finished_measured"] == requests for r in served)
    advice = json.loads((tmp_path / "out" / "advice.json").read_text())
    assert len(advice["candidates"]) == summary["candidates"] >= 20
    for metric in ("ttft", "itl"):  # the SLO is the median of the candidates' simulated P99s
        p99 = [c["at_offered_rate"]["all"][f"{metric}_ms_p99"] for c in advice["candidates"]]
        assert summary["slo"][f"{metric}_ms_p99"] == pytest.approx(statistics.median(p99), rel=5e-3)
    for name in (
        "traffic.csv",
        "iterations.csv",
        "summary.json",
        "advise_vllm.md",
        "cpu__vllm_small__tp1.yaml",
    ):
        assert (tmp_path / "out" / name).is_file()
    assert json.loads((tmp_path / "report" / "advise_vllm.json").read_text())["served"] == served


def test_bad_option_fails_in_one_line():
    with pytest.raises(SystemExit, match="served"):
        main(["served=1"])
    with pytest.raises(SystemExit, match="no_such_key"):
        main(["no_such_key=1"])
