"""bench/pd_study.py: the win rule, the splits it searches, one cell end to end, bad input in one line."""

from __future__ import annotations

import json

import pytest

from advisor.topology import splits
from bench.pd_study import (
    COLOCATED_POLICIES,
    DISAGGREGATED_POLICIES,
    Options,
    candidates,
    main,
    winner,
)
from chunkgym.cli import InputExit
from envs.serving.fleet import FleetSpec

ONE_CELL = [
    "workloads=[azure_conv]",
    "slos=[tpot_tight]",
    "models=[llama3_8b]",
    "links=[nvlink]",
    "gpus=[2]",
    "window_s=60",
    "rel_tol=0.1",
    "parallel=1",
]


@pytest.mark.parametrize(
    ("agg", "pd", "won"),
    [
        (1.0, 1.02, "tie"),  # exactly 2% more is not beyond 2%
        (1.0, 1.021, "pd"),
        (1.021, 1.0, "agg"),
        (1.0, 0.99, "tie"),
        (0.0, 0.0, "tie"),
        (0.0, 0.001, "pd"),
        (0.5, 0.0, "agg"),
    ],
)
def test_a_win_is_strict_beyond_two_percent_and_ties_count_for_neither(agg, pd, won):
    assert winner(agg, pd) == won


def test_every_xpyd_split_of_the_gpus_is_searched_on_every_link_and_colocated_once():
    def split(gpus: int, tp: int) -> list[tuple[int, int]]:
        return [(f.prefill, f.decode) for f in splits("auto", FleetSpec(replicas=gpus // tp))]

    assert split(8, 1) == [(x, 8 - x) for x in range(1, 8)]
    assert split(8, 2) == [(1, 3), (2, 2), (3, 1)] and split(4, 2) == [(1, 1)]
    opts = Options(workloads=["azure_code"], slos=["ttft_tight"], models=["llama3_8b", "llama2_70b"])
    todo = candidates(opts, [2, 4, 8])
    for model, gpus, tp in [("llama3_8b", 2, 1), ("llama3_8b", 4, 1), ("llama3_8b", 8, 1), ("llama2_70b", 4, 2), ("llama2_70b", 8, 2)]:  # fmt: skip
        cell = [c for c in todo if (c.model, c.gpus) == (model, gpus)]
        colocated = [c for c in cell if not c.fleet.disaggregated]
        assert [(c.fleet.replicas, c.policy) for c in colocated] == [
            (gpus // tp, p) for p in COLOCATED_POLICIES
        ]
        for link in opts.links:
            tried = {(c.fleet.prefill, c.fleet.decode, c.policy) for c in cell if c.link == link}
            assert tried == {
                (x, y, p)
                for x in range(1, gpus // tp)
                for y in [gpus // tp - x]
                for p in DISAGGREGATED_POLICIES
            }
            assert all(c.fleet.link == link for c in cell if c.link == link)
    assert not [c for c in todo if c.model == "llama2_70b" and c.gpus == 2]  # tp 2 leaves no split of 2 GPUs


def test_one_cell_end_to_end_writes_the_keys_the_plot_and_a_consistent_winner(tmp_path):
    main([*ONE_CELL, f"out={tmp_path}"])
    out = json.loads((tmp_path / "pd_study.json").read_text())
    assert {"cells", "agg_wins", "pd_wins", "ties", "settings", "wall_s", "load_avg"} <= set(out)
    (cell,) = out["cells"]
    assert (cell["workload"], cell["slo"], cell["model"], cell["link"], cell["gpus"]) == (
        "azure_conv", "tpot_tight", "llama3_8b", "nvlink", 2,
    )  # fmt: skip
    agg, pd = cell["colocated"], cell["disaggregated"]
    assert agg["config"].startswith("2x tp1 ") and pd["config"].startswith("1P1D tp1 ")
    assert agg["capacity_per_gpu_rps"] > 0 and pd["capacity_per_gpu_rps"] > 0
    assert set(pd["searched"]) == {f"1P1D tp1 {p}" for p in DISAGGREGATED_POLICIES}
    assert set(agg["searched"]) == {f"2x tp1 {p}" for p in COLOCATED_POLICIES}
    for side in (agg, pd):
        assert (
            max(side["searched"].values()) == side["capacity_per_gpu_rps"] == side["searched"][side["config"]]
        )
    assert cell["winner"] == winner(agg["capacity_per_gpu_rps"], pd["capacity_per_gpu_rps"])
    assert (out["agg_wins"], out["pd_wins"], out["ties"]) == tuple(
        int(cell["winner"] == w) for w in ("agg", "pd", "tie")
    )
    assert "kv_transfer_s_mean" in pd["at_capacity"] and "kv_transfer_s_mean" not in agg["at_capacity"]
    assert pd["at_capacity"]["slo_attainment"] >= 0.9  # at its capacity the fleet meets attain90
    assert (tmp_path / "pd_study.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "gpu=[2]",
            "pd_study.py: error: Could not override 'gpu'. To append to your config use +gpu=[2]: Key 'gpu' not",
        ),
        ("links=[wifi]", "pd_study.py: error: links=['wifi']: must be a non-empty list of links (nvlink,"),
        ("slos=[tight]", "pd_study.py: error: slos=['tight']: must be a non-empty list of conf/slo names ("),
        ("rel_tol=0", "pd_study.py: error: rel_tol=0.0: must be a capacity rel_tol in [1e-06, 1)"),
        ("models=[llama2_70b]", "pd_study.py: error: models=['llama2_70b'] gpus=[2]: no cell;"),
        ("full=true", "pd_study.py: error: full=true with gpus=[2]: full runs gpus=[2, 4, 8]"),
    ],
)
def test_bad_input_is_one_line_naming_it_before_any_work(override, line, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/pd_study.py"])
    base = ["gpus=[2]"] if override.startswith(("models", "full")) else []
    with pytest.raises(InputExit) as info:
        main([*base, override, f"out={tmp_path / 'out'}"])
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
