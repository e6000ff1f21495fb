"""The advice as data (advice.json), as a page (advice.md) and as the last stdout line.

The recommendation is the candidate of highest capacity; ties go to the one closest to the
current settings (:meth:`advisor.engines.Candidate.distance`), then to the smaller budget. No
candidate meeting the SLO at any probed rate leaves ``recommended`` null and names the closest one:
the candidate whose worst target is least exceeded at today's rate.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from advisor.diagnosis import Diagnosis
from advisor.engines import PD_PROXY, Candidate, disaggregated_flags, serve_command
from advisor.search import Found
from advisor.targets import Target, percentile_ms, samples
from advisor.topology import STRICT_WIN, Topology
from advisor.topology import name as split_name
from advisor.traffic import Traffic
from envs.serving.fleet import ONE_SERVER, FleetSpec
from envs.serving.loop import SimResult
from envs.serving.metrics import BUCKET_EDGES, BUCKET_LABELS, RequestOutcomes

REPORTED = (("ttft", 50), ("ttft", 99), ("itl", 50), ("itl", 99), ("tpot", 50), ("tpot", 99))
TOO_LARGE_MARGIN = 0.05
"""A budget whose P99 ITL is within this share of chunked prefill off's is "no better than without chunking"."""


def latency_table(out: RequestOutcomes) -> dict[str, dict[str, float | None]]:
    """Per prompt-length bucket (and ``all``): TTFT, ITL and TPOT at P50/P99 in ms, and the request count."""
    edges = (*BUCKET_EDGES, np.inf)
    masks = {"all": np.ones(len(out.prompt_len), dtype=bool)}
    for label, lo, hi in zip(BUCKET_LABELS, edges[:-1], edges[1:], strict=True):
        masks[label] = (out.prompt_len >= lo) & (out.prompt_len < hi)
    table: dict[str, dict[str, float | None]] = {}
    for label, mask in masks.items():
        if not mask.any():
            continue
        sub = out.subset(mask)
        row: dict[str, float | None] = {"requests": float(mask.sum())}
        for metric, p in REPORTED:
            row[f"{metric}_ms_p{p}"] = _json(percentile_ms(samples(sub, metric), p))
        table[label] = row
    return table


def worst_ratio(out: RequestOutcomes, targets: tuple[Target, ...]) -> float:
    """The largest measured percentile over its target (inf past a rejected request)."""
    return max(
        (percentile_ms(samples(out, t.metric), t.percentile) / t.ms for t in targets), default=math.nan
    )


def rejected(out: RequestOutcomes) -> dict[str, int]:
    """Requests the engine refuses at any rate, by reason; each counts above every request-level target."""
    kinds = (
        "prompt + output longer than max_model_len"
        if "max_model_len" in why
        else "more KV than the whole cache"
        for why in out.reject_reason
        if why
    )
    return dict(Counter(kinds))


def pick(found: list[Found]) -> Found | None:
    """The highest capacity, ties by closeness to the current settings, then the smaller budget."""
    current = found[0].candidate
    best = max((f.scale for f in found), default=0.0)
    if best <= 0:
        return None
    tied = [f for f in found if f.scale == best]
    return min(tied, key=lambda f: f.candidate.distance(current))


@dataclass(frozen=True)
class Advice:
    """Everything the report writes, gathered once."""

    traffic: Traffic
    targets: tuple[Target, ...]
    preset: str
    attainment: float
    model: str
    cost: str
    found: list[Found]
    at_rate: list[SimResult]
    diagnosis_current: Diagnosis
    diagnosis_recommended: Diagnosis | None
    sentence: str
    advice_dir: str
    fleet: FleetSpec = ONE_SERVER  # each candidate's servers (capacities are this fleet's)
    topology: Topology | None = None  # topology=auto: colocated against every xPyD split

    @property
    def recommended(self) -> Found | None:
        return pick(self.found)

    def flags(self, c: Candidate) -> dict[str, Any]:
        return c.flags(self.preset, self.cost)

    def failure_modes(self) -> list[str]:
        """The article's two failure modes, where the budget family meets them: a budget below the
        family's best that serves less with a worse TTFT tail (too small), and one above it whose
        P99 ITL is no better than chunked prefill off (too large)."""
        family = [(f, r) for f, r in zip(self.found, self.at_rate, strict=True)
                  if f.candidate.family in ("max_num_batched_tokens", "current")
                  and f.candidate.policy is None and f.candidate.knobs.enable_chunked_prefill
                  and not f.candidate.knobs.long_prefill_token_threshold]  # fmt: skip
        if not family:
            return []
        best, best_run = max(family, key=lambda x: x[0].scale)
        best_ttft = percentile_ms(samples(best_run.outcomes, "ttft"), 99)
        notes = []
        for f, run in family:
            budget = f.candidate.knobs.max_num_batched_tokens
            ttft = percentile_ms(samples(run.outcomes, "ttft"), 99)
            if budget < best.candidate.knobs.max_num_batched_tokens and f.rps < best.rps and ttft > best_ttft:
                notes.append(
                    f"budget {budget} is too small: capacity {f.rps:.3g} req/s against {best.rps:.3g} at "
                    f"budget {best.candidate.knobs.max_num_batched_tokens}, TTFT P99 {_ms(ttft)} against {_ms(best_ttft)} ms"
                )
        whole = [
            (f, r)
            for f, r in zip(self.found, self.at_rate, strict=True)
            if f.candidate.family == "no_chunking"
        ]
        if whole:
            off = percentile_ms(samples(whole[0][1].outcomes, "itl"), 99)
            for f, run in family:
                if f.candidate.knobs.max_num_batched_tokens <= best.candidate.knobs.max_num_batched_tokens:
                    continue
                itl = percentile_ms(samples(run.outcomes, "itl"), 99)
                if math.isfinite(off) and itl >= off * (1 - TOO_LARGE_MARGIN):
                    notes.append(
                        f"budget {f.candidate.knobs.max_num_batched_tokens} is too large: P99 ITL {_ms(itl)} ms, "
                        f"no better than chunked prefill off ({_ms(off)} ms)"
                    )
        return notes

    def to_json(self) -> dict[str, Any]:
        rec = self.recommended
        current = self.found[0]
        today = self.traffic.trace_at(1.0)
        rate = len(today) / today.span_s
        candidates = [
            {
                "name": f.candidate.name,
                "family": f.candidate.family,
                "flags": self.flags(f.candidate),
                "capacity_rps": f.rps,
                "capacity_scale": f.scale,
                "bracket": [f.result.bracket[0], _json(f.result.bracket[1])],
                "at_current_rate": latency_table(r.outcomes),
            }
            for f, r in zip(self.found, self.at_rate, strict=True)
        ]
        closest = None
        if rec is None:
            ratios = [worst_ratio(r.outcomes, self.targets) if self.targets else 1 - r.outcomes.good.mean()
                      for r in self.at_rate]  # fmt: skip
            i = int(np.nanargmin(ratios)) if not np.all(np.isnan(ratios)) else 0
            closest = {"name": self.found[i].candidate.name, "worst_ratio_at_current_rate": _json(ratios[i]),
                       "at_current_rate": candidates[i]["at_current_rate"]}  # fmt: skip
        return {
            "recommended": self.flags(rec.candidate) if rec else None,
            "recommended_name": rec.candidate.name if rec else None,
            "recommended_command": rec.candidate.command(self.model, self.preset, self.cost) if rec else None,
            "recommended_capacity_rps": rec.rps if rec else 0.0,
            "current_capacity_rps": current.rps,
            "gain_over_current": rec.rps / current.rps if rec and current.rps > 0 else None,
            "headroom_at_current_rate": rate / rec.rps if rec else None,
            "current_rate_rps": rate,
            "hol_share_current": self.diagnosis_current.hol_share,
            "hol_share_recommended": self.diagnosis_recommended.hol_share
            if self.diagnosis_recommended
            else None,
            "diagnosis": self.sentence,
            "diagnosis_current": _diagnosis(self.diagnosis_current),
            "diagnosis_recommended": _diagnosis(self.diagnosis_recommended)
            if self.diagnosis_recommended
            else None,
            "failure_modes": self.failure_modes(),
            "closest": closest,
            "traffic": {
                "source": self.traffic.label,
                "requests": len(today),
                "rejected": rejected(self.at_rate[0].outcomes),
                "fields_used": list(self.traffic.fields_used),
                "assumptions": list(self.traffic.assumptions),
            },
            "slo": {t.key: t.ms for t in self.targets}
            or {"preset": self.preset, "attainment": self.attainment},
            "fleet": {
                "replicas": self.fleet.replicas,
                "router": self.fleet.router if self.fleet.servers > 1 else None,
            },
            "candidates": candidates,
            **(
                {"topology": topology_json(self.topology, self.model, self.preset, self.cost)}
                if self.topology is not None
                else {}
            ),
            "advice_dir": self.advice_dir,
        }

    def summary(self, advice: dict[str, Any]) -> dict[str, Any]:
        """The last stdout line."""
        keys = ("recommended", "recommended_capacity_rps", "current_capacity_rps", "gain_over_current",
                "hol_share_current", "hol_share_recommended", "advice_dir")  # fmt: skip
        topology = {"topology": advice["topology"]["recommended"]} if "topology" in advice else {}
        return {**{k: advice[k] for k in keys}, "candidates": len(advice["candidates"]), **topology}


def markdown(advice: dict[str, Any], images: list[str]) -> str:
    """advice.md: the recommendation, the diagnosis, every candidate, the traffic and its assumptions."""
    lines = ["# Advice", ""]
    if advice["recommended"] is not None:
        gain = advice["gain_over_current"]
        lines += [
            f"**Set**: `{advice['recommended_command']}`",
            "",
            f"Capacity {advice['recommended_capacity_rps']:.3g} req/s ({advice['recommended_name']}) against "
            f"{advice['current_capacity_rps']:.3g} req/s for the current settings"
            + (f" ({gain:.2f}x)" if gain is not None else "")
            + f"; today's {advice['current_rate_rps']:.3g} req/s is "
            f"{advice['headroom_at_current_rate']:.0%} of it.",
        ]
    else:
        c = advice["closest"]
        ratio = c["worst_ratio_at_current_rate"]
        lines += [
            "**No candidate meets the SLO at any probed rate.** Closest: "
            f"{c['name']}, whose worst target is exceeded "
            + (f"{ratio:.2f}x" if ratio is not None else "without bound (rejected requests)")
            + " at today's rate."
        ]
    fleet = advice["fleet"]
    if fleet["replicas"] > 1:
        lines += [
            "",
            f"Fleet: {fleet['replicas']} servers behind the {fleet['router']} router, each with the "
            "candidate's settings; every capacity and rate here is the whole fleet's.",
        ]
    if "topology" in advice:
        lines += topology_lines(advice["topology"])
    d = advice["diagnosis_current"]
    lines += ["", "## Diagnosis", "", advice["diagnosis"] + ".", ""]
    lines += [
        f"Short requests (prompts under 1k tokens), current settings: P99 token gap "
        f"{_cell(d['short_itl_p99_ms_while_long_prefills'])} ms while a prompt of 4k+ tokens prefills, "
        f"{_cell(d['short_itl_p99_ms_otherwise'])} ms otherwise.",
        "",
    ]
    lines += [f"* {m}" for m in advice["failure_modes"]] or [
        "* neither a too-small nor a too-large budget among the candidates"
    ]
    lines += [
        "",
        "## Candidates",
        "",
        "| candidate | capacity (req/s) | TTFT P99 (ms) | ITL P99 (ms) | TPOT P99 (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in sorted(advice["candidates"], key=lambda c: -c["capacity_rps"]):
        row = c["at_current_rate"].get("all", {})
        lines.append(f"| {c['name']} | {c['capacity_rps']:.3g} | {_cell(row.get('ttft_ms_p99'))} | "
                     f"{_cell(row.get('itl_ms_p99'))} | {_cell(row.get('tpot_ms_p99'))} |")  # fmt: skip
    lines += ["", "Latencies at today's rate; per prompt-length bucket in advice.json.", ""]
    t = advice["traffic"]
    lines += ["## Traffic and SLO", "", f"* source: {t['source']}, {t['requests']} requests"]
    lines += [f"* never served under any setting: {n} request(s), {why}" for why, n in t["rejected"].items()]
    lines += [f"* used: {f}" for f in t["fields_used"]] + [f"* assumed: {a}" for a in t["assumptions"]]
    lines += [
        f"* SLO: {', '.join(f'{k} = {v:g}' for k, v in advice['slo'].items() if isinstance(v, int | float))}"
    ]
    lines += ["", *[f"![{name}]({name})" for name in images]]
    return "\n".join(lines) + "\n"


def topology_json(t: Topology, model: str, preset: str, cost: str) -> dict[str, Any]:
    """advice.json's ``topology`` block: both sides, every split tried, the recommended one's flags
    (``model`` served with the flags ``preset`` and ``cost`` make, as :meth:`Advice.flags`)."""
    co, dis, split = t.colocated, t.disaggregated, t.split
    metrics = t.at_capacity.metrics
    colocated_rps = co.rps if co else 0.0
    return {
        "gpus": t.gpus,
        "tp": t.tp,
        "strict_win": STRICT_WIN,
        "colocated": {
            "name": co.candidate.name if co else None,
            "replicas": t.fleet.replicas,
            "router": t.fleet.router,
            "flags": co.candidate.flags(preset, cost) if co else None,
            "capacity_rps": colocated_rps,
            "capacity_rps_per_gpu": colocated_rps / t.gpus,
        },
        "disaggregated": {
            "split": split_name(split),
            "prefill": split.prefill,
            "decode": split.decode,
            "link": split.link,
            "router": split.router,
            "decode_router": split.decode_router,
            "name": dis.candidate.name,
            "max_num_batched_tokens": dis.candidate.knobs.max_num_batched_tokens,
            "flags": disaggregated_flags(dis.candidate.flags(preset, cost)),
            "capacity_rps": dis.rps,
            "capacity_rps_per_gpu": dis.rps / t.gpus,
            "capacity_scale": dis.scale,
            "first_decode_gap_transfer_share": _json(metrics["first_decode_gap_transfer_share"]),
            "kv_transfer_ms_mean": _json(metrics["kv_transfer_s_mean"] * 1000.0),
        },
        "recommended": t.recommended,
        "engine": _topology_engine(t, model, preset, cost),
        "tried": [
            {
                "split": split_name(f),
                "name": found.candidate.name,
                "max_num_batched_tokens": found.candidate.knobs.max_num_batched_tokens,
                "capacity_rps": found.rps,
                "capacity_scale": found.scale,
                "bracket": [found.result.bracket[0], _json(found.result.bracket[1])],
            }
            for (f, _), found in zip(t.pairs, t.found, strict=True)
        ],
    }


def _topology_engine(t: Topology, model: str, preset: str, cost: str) -> dict[str, Any] | None:
    """The recommended topology's instances and their flags (None: colocated, and no candidate
    meets the SLO)."""
    if t.recommended == "colocated":
        if t.colocated is None:
            return None
        flags = t.colocated.candidate.flags(preset, cost)
        return {
            "instances": t.fleet.replicas,
            "flags": flags,
            "command": serve_command(model, flags),
        }
    flags = disaggregated_flags(t.disaggregated.candidate.flags(preset, cost))
    command = serve_command(model, flags)
    return {
        "prefill": {"instances": t.split.prefill, "flags": flags, "command": command},
        "decode": {"instances": t.split.decode, "flags": flags, "command": command},
        "proxy": PD_PROXY,
    }


def topology_lines(t: dict[str, Any]) -> list[str]:
    """advice.md's topology section: both sides, the answer and the instances' flags."""
    co, dis, engine = t["colocated"], t["disaggregated"], t["engine"]
    share = dis["first_decode_gap_transfer_share"]
    lines = [
        "",
        f"## Topology: {t['gpus']} GPUs",
        "",
        f"* colocated, {co['replicas']} servers ({co['name'] or 'no setting meets the SLO'}): "
        f"{co['capacity_rps']:.3g} req/s, {co['capacity_rps_per_gpu']:.3g} per GPU",
        f"* disaggregated, best of {len({r['split'] for r in t['tried']})} split(s): {dis['split']} over "
        f"{dis['link']}, {dis['name']}: {dis['capacity_rps']:.3g} req/s, {dis['capacity_rps_per_gpu']:.3g} "
        "per GPU; the KV transfer is "
        + (f"{share:.0%}" if share is not None else "-")
        + " of the first decode gap at that rate",
        f"* **{t['recommended']}** (disaggregation only beyond {t['strict_win']:.0%} more capacity)",
    ]
    if engine is None:
        return lines
    if t["recommended"] == "colocated":
        return [*lines, "", f"{engine['instances']} instances of `{engine['command']}`"]
    return [
        *lines,
        "",
        f"{engine['prefill']['instances']} prefill and {engine['decode']['instances']} decode instances of "
        f"`{engine['prefill']['command']}`; {engine['proxy']}.",
    ]


def _diagnosis(d: Diagnosis) -> dict[str, Any]:
    return {
        "gap_target_ms": d.gap_target_ms,
        "gaps_over_target": d.gaps_over,
        "hol_share": d.hol_share,
        "itl_p99_ms": _json(d.itl_p99_ms),
        "short_itl_p99_ms_while_long_prefills": _json(d.short_itl_p99_during_long_ms),
        "short_itl_p99_ms_otherwise": _json(d.short_itl_p99_otherwise_ms),
        "worst_window_s": list(d.worst_window_s),
    }


def _cell(x: float | None) -> str:
    return "-" if x is None else _ms(x)


def _ms(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def _json(x: float) -> float | None:
    return x if math.isfinite(x) else None
