"""The serving engine's scheduling knobs, its defaults per GPU, the candidates searched and their flags.

Only vLLM V1 (0.32) is modelled: its knobs are simulated by :class:`baselines.VllmV1`, which
plans each step as vLLM's own scheduler does; ``max_num_seqs`` is the serving core's batch-slot
count. The defaults are those ``vllm serve`` picks (``EngineArgs.get_batch_defaults`` in vLLM
0.32): 16384 tokens and 1024 sequences on GPUs of 160 GiB or more, 8192 and 1024 on other GPUs of
70 GiB or more except the A100, 2048 and 256 below that and on A100s, and 2048 x TP and 128 x TP on
CPUs. SGLang's scheduler is not modelled, so ``engine=sglang`` is refused rather than approximated.
A prefill-decode deployment (``topology=auto``) runs each instance with a candidate's flags and
vLLM's NIXL KV connector (:data:`KV_TRANSFER_CONFIG`) behind a proxy vLLM's flags do not make.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from baselines import VllmV1
from envs.serving.scheduling import Policy
from envs.serving.specs import HardwareSpec
from policies.registry import make_policy

ENGINES = ("vllm",)
PLUGIN_SCHEDULER = "engine.vllm_backend.scheduler.ChunkgymScheduler"
PLUGIN_POLICIES = ("adaptive_srpf", "learned")
"""chunkgym's policies offered through the scheduler plug-in, beside vLLM's own knobs."""
PLUGIN_BUDGET = 16384
"""``--max-num-batched-tokens`` for a plug-in policy: its largest budget level, so vLLM's buffers never cut a plan."""
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
"""vLLM's ``--kv-transfer-config`` for prefill-decode disaggregation: NIXL moves a prompt's KV from a
prefill instance to a decode instance; with ``kv_both`` every instance takes either role and the
proxy in front of them (not vLLM's flags: docs/advise.md, "Topology") picks which one prefills."""
PD_PROXY = (
    "a proxy sends each request to a prefill instance with max_tokens=1, then to a decode instance "
    "with the kv_transfer_params the prefill returned (vLLM's disaggregated-serving proxy example); "
    "each instance needs its own port and VLLM_NIXL_SIDE_CHANNEL_PORT"
)
"""What the operator adds to the instances' flags for a prefill-decode deployment."""
BUDGETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
THRESHOLDS = (256, 512, 1024, 2048)
ADAPTIVE_THRESHOLDS = (512, 1024)
SEQS = (64, 128, 256, 512, 1024)
LONG_BUDGET = 8192
"""The budget the long-prefill thresholds are also tried under besides the current one (twice it
when the current one is this)."""


@dataclass(frozen=True)
class VllmKnobs:
    """vLLM V1's scheduling knobs (``vllm/config/scheduler.py``), under their own names."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True

    def check(self, max_model_len: int, source: str = "current") -> VllmKnobs:
        """This, or ValueError naming the knob and value that vLLM would refuse (``SchedulerConfig``)."""
        for key in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}.{key}={value!r}: an integer >= 1")
        if self.max_num_active_seqs is not None and not 1 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise ValueError(
                f"{source}.max_num_active_seqs={self.max_num_active_seqs!r}: null or an integer in "
                f"[1, max_num_seqs={self.max_num_seqs}]"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"{source}.long_prefill_token_threshold={self.long_prefill_token_threshold!r}: >= 0"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{source}.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                f"max_num_seqs={self.max_num_seqs}, which vLLM refuses"
            )
        if self.long_prefill_token_threshold > max_model_len:
            raise ValueError(
                f"{source}.long_prefill_token_threshold={self.long_prefill_token_threshold} exceeds "
                f"max_model_len={max_model_len}, which vLLM refuses"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"{source}.enable_chunked_prefill=false needs max_num_batched_tokens >= max_model_len "
                f"({max_model_len}), got {self.max_num_batched_tokens}; vLLM refuses it"
            )
        return self

    def flags(self) -> dict[str, Any]:
        """Every knob as a ``vllm serve`` flag and value (booleans as their flag forms)."""
        flags: dict[str, Any] = {
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--max-num-seqs": self.max_num_seqs,
        }
        if self.max_num_active_seqs is not None:
            flags["--max-num-active-seqs"] = self.max_num_active_seqs
        if self.long_prefill_token_threshold:
            flags["--long-prefill-token-threshold"] = self.long_prefill_token_threshold
        if self.long_prefill_token_threshold_adaptive:
            flags["--long-prefill-token-threshold-adaptive"] = True
        flags[
            "--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill"
        ] = True
        return flags


def serve_command(model: str, flags: dict[str, Any]) -> str:
    """``vllm serve model`` with ``flags`` (a switch set to True as the bare flag)."""
    parts = ["vllm", "serve", model]
    for flag, value in flags.items():
        parts += [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def disaggregated_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """One instance of a prefill-decode deployment: ``flags`` and vLLM's KV connector
    (:data:`KV_TRANSFER_CONFIG`), the same on prefill and decode instances."""
    return {**flags, "--kv-transfer-config": json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))}


def vllm_defaults(hardware: HardwareSpec, tp: int) -> VllmKnobs:
    """What ``vllm serve`` sets when the operator sets nothing (see the module docstring)."""
    if hardware.name == "cpu":
        return VllmKnobs(2048 * tp, 128 * tp)
    if hardware.memory_gib >= 160:
        return VllmKnobs(16384, 1024)
    if hardware.memory_gib >= 70 and "a100" not in hardware.name:
        return VllmKnobs(8192, 1024)
    return VllmKnobs(2048, 256)


@dataclass(frozen=True)
class Candidate:
    """One setting to search: vLLM's own scheduler under ``knobs``, or a chunkgym ``policy`` through the plug-in."""

    name: str
    family: str
    knobs: VllmKnobs
    policy: str | None = None

    def build_policy(self) -> Policy:
        if self.policy is not None:
            return make_policy(self.policy)
        k = self.knobs
        return VllmV1(
            max_num_batched_tokens=k.max_num_batched_tokens,
            long_prefill_token_threshold=k.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=k.long_prefill_token_threshold_adaptive,
            enable_chunked_prefill=k.enable_chunked_prefill,
            max_num_active_seqs=k.max_num_active_seqs,
        )

    def flags(self, slo_preset: str, cost: str) -> dict[str, Any]:
        flags = self.knobs.flags()
        if self.policy is not None:
            config = {"chunkgym": {"policy": self.policy, "slo": slo_preset, "cost": cost}}
            flags["--scheduler-cls"] = PLUGIN_SCHEDULER
            flags["--additional-config"] = json.dumps(config, separators=(",", ":"))
        return flags

    def command(self, model: str, slo_preset: str, cost: str) -> str:
        """The ``vllm serve`` line to paste."""
        return serve_command(model, self.flags(slo_preset, cost))

    def distance(self, current: Candidate) -> tuple[int, float, int]:
        """The tie-break order: knobs (and policy) that differ from ``current``, then how far the
        budget moved (in doublings), then the budget itself."""
        ours, theirs = asdict(self.knobs), asdict(current.knobs)
        changed = sum(ours[k] != theirs[k] for k in ours) + (self.policy != current.policy)
        budget = self.knobs.max_num_batched_tokens
        moved = abs(math.log2(budget / current.knobs.max_num_batched_tokens))
        return changed, moved, budget


def candidates(current: VllmKnobs, max_model_len: int) -> list[Candidate]:
    """The current settings first, then each knob family around them, each setting once."""
    found = [Candidate("current", "current", current)]
    seen: set[tuple[VllmKnobs, str | None]] = {(current, None)}

    def add(family: str, name: str, knobs: VllmKnobs, policy: str | None = None) -> None:
        # vLLM refuses a budget below max_num_seqs: an operator lowering the budget lowers both
        seqs = min(knobs.max_num_seqs, knobs.max_num_batched_tokens)
        active = knobs.max_num_active_seqs
        knobs = replace(
            knobs, max_num_seqs=seqs, max_num_active_seqs=None if active is None else min(active, seqs)
        )
        if (knobs, policy) not in seen:
            seen.add((knobs, policy))
            found.append(Candidate(name, family, knobs, policy))

    plain = replace(current, long_prefill_token_threshold=0, long_prefill_token_threshold_adaptive=False)
    plain = replace(plain, enable_chunked_prefill=True)
    for b in BUDGETS:
        add("max_num_batched_tokens", f"budget {b}", replace(plain, max_num_batched_tokens=b))
    for b in _unique([current.max_num_batched_tokens, LONG_BUDGET, 2 * LONG_BUDGET])[:2]:
        for t in (t for t in THRESHOLDS if t < b):
            knobs = replace(plain, max_num_batched_tokens=b, long_prefill_token_threshold=t)
            add("long_prefill_token_threshold", f"budget {b}, threshold {t}", knobs)
    for t in ADAPTIVE_THRESHOLDS:
        knobs = replace(plain, max_num_batched_tokens=LONG_BUDGET, long_prefill_token_threshold=t)
        knobs = replace(knobs, long_prefill_token_threshold_adaptive=True)
        add("adaptive_threshold", f"budget {LONG_BUDGET}, adaptive threshold {t}", knobs)
    for s in SEQS:
        add("max_num_seqs", f"max_num_seqs {s}", replace(current, max_num_seqs=s, max_num_active_seqs=None))
    whole = replace(
        plain,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_model_len, current.max_num_batched_tokens),
    )
    add("no_chunking", "chunked prefill off", whole)
    for name in PLUGIN_POLICIES:
        knobs = replace(plain, max_num_batched_tokens=max(PLUGIN_BUDGET, current.max_num_seqs))
        add("plugin", f"chunkgym {name}", knobs, name)
    return found


def _unique(values: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(values))
