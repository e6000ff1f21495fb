"""The advice's three pictures: capacity by knob, the top three's per-bucket tails, the current stalls."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from advisor.diagnosis import Gaps  # noqa: E402
from advisor.search import Found  # noqa: E402
from envs.serving.loop import SimResult  # noqa: E402

FAMILIES = (
    ("max_num_batched_tokens", "max_num_batched_tokens", lambda f: f.candidate.knobs.max_num_batched_tokens),
    ("long_prefill_token_threshold", "long_prefill_token_threshold", lambda f: f.candidate.knobs.long_prefill_token_threshold),
    ("max_num_seqs", "max_num_seqs", lambda f: f.candidate.knobs.max_num_seqs),
)  # fmt: skip
PLAIN = matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}")


def capacity_by_knob(found: list[Found], recommended: Found | None, path: Path) -> Path:
    """One panel per knob family: capacity against the knob's value, current and recommended marked."""
    current = found[0]
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(5 * len(FAMILIES), 3.8), sharey=True)
    plain = (
        not current.candidate.knobs.long_prefill_token_threshold
        and current.candidate.knobs.enable_chunked_prefill
    )
    for ax, (family, label, value) in zip(axes, FAMILIES, strict=True):
        members = [f for f in found if f.candidate.family == family]
        if family != "long_prefill_token_threshold" and plain:  # the current settings sit on this line
            members.append(current)
        groups: dict[str, list[Found]] = {}
        for f in members:
            key = (
                f"budget {f.candidate.knobs.max_num_batched_tokens}"
                if family == "long_prefill_token_threshold"
                else ""
            )
            groups.setdefault(key, []).append(f)
        for key, group in groups.items():
            group.sort(key=value)
            ax.plot(
                [value(f) for f in group], [f.rps for f in group], "o-", label=key or "vLLM's own scheduler"
            )
        ax.axhline(current.rps, color="grey", ls="--", label=f"current settings: {current.rps:.3g} req/s")
        if family == "max_num_batched_tokens":  # chunkgym's policies pick their own budget: a level each
            plugins = [f for f in found if f.candidate.family == "plugin"]
            for f, color in zip(plugins, ("tab:green", "tab:purple", "tab:brown"), strict=False):
                mark = " (recommended)" if f is recommended else ""
                ax.axhline(f.rps, ls=":", color=color, label=f"{f.candidate.name}{mark}: {f.rps:.3g} req/s")
        if current in members:
            ax.plot(value(current), current.rps, "D", ms=8, color="black", label="current")
        if recommended is not None and recommended.candidate.family == family:
            ax.plot(value(recommended), recommended.rps, "*", ms=16, color="crimson", label="recommended")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(PLAIN)
        ax.set_xlabel(label)
        ax.set_title(family.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("capacity (req/s within the SLO)")
    rec = (
        f"recommended: {recommended.candidate.name}, {recommended.rps:.3g} req/s"
        if recommended
        else "no candidate meets the SLO"
    )
    fig.suptitle(f"Capacity of each setting; {rec}")
    return _save(fig, path)


def bucket_tails(found: list[Found], tables: list[dict], targets_ms: dict[str, float], path: Path) -> Path:
    """TTFT and ITL P99 per prompt-length bucket at today's rate, for the three highest capacities."""
    top = sorted(range(len(found)), key=lambda i: -found[i].rps)[:3]
    buckets = [b for b in tables[top[0]] if b != "all"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(top)
    for ax, metric in zip(axes, ("ttft_ms_p99", "itl_ms_p99"), strict=True):
        for k, i in enumerate(top):
            values = [tables[i].get(b, {}).get(metric) or np.nan for b in buckets]
            ax.bar(np.arange(len(buckets)) + k * width, values, width, label=found[i].candidate.name)
        if metric in targets_ms:
            ax.axhline(
                targets_ms[metric], color="crimson", ls="--", label=f"target {targets_ms[metric]:g} ms"
            )
        ax.set_xticks(np.arange(len(buckets)) + width * (len(top) - 1) / 2, buckets)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(metric.split("_")[0].upper() + " P99 (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Tail latency per prompt length at today's rate, the three highest capacities")
    return _save(fig, path)


def worst_stalls(run: SimResult, window: tuple[float, float], target_ms: float, path: Path) -> Path:
    """The current settings' worst minute: every token gap, and the prefill tokens of each iteration beneath."""
    gaps = Gaps.of(run)
    lo, hi = window
    inside = (gaps.end >= lo) & (gaps.end <= hi)
    it = run.iterations
    ends = it["start"] + it["latency"]
    during = (ends >= lo) & (ends <= hi)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5), sharex=True, height_ratios=(2, 1))
    over = inside & (gaps.length * 1000 > target_ms)
    top.scatter(
        gaps.end[inside & ~over] - lo, gaps.length[inside & ~over] * 1000, s=4, alpha=0.5, label="token gaps"
    )
    top.scatter(gaps.end[over] - lo, gaps.length[over] * 1000, s=10, color="crimson", label="over the target")
    top.axhline(target_ms, color="crimson", ls="--", label=f"gap target {target_ms:g} ms")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(PLAIN)
    top.set_ylabel("token gap (ms)")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.vlines(ends[during] - lo, 0, it["prefill_tokens"][during], lw=0.8, color="tab:orange")
    bottom.set_ylabel("prefill tokens\nper iteration")
    bottom.set_xlabel(f"seconds from t = {lo:.0f} s")
    bottom.grid(alpha=0.3)
    fig.suptitle(
        "Current settings: the minute with the most token gaps over target, and the prefills beneath"
    )
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
