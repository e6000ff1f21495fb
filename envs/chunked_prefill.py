"""``chunkgym/ChunkedPrefill-v*``: choose each iteration's token budget and prefill allocation.

One class, :class:`ChunkedPrefillEnv`; each registered version is a row of
:data:`VERSIONS` (features, action spec, reward, step granularity, default workloads),
as Gymnasium keeps the versions of one env as registration arguments of one class.
A version never changes behaviour once released: a change is a new version.

## Description

A simulated continuous-batching server replays windows of a real trace.  At each step
the agent picks the next engine iteration's token budget and the rule that allocates
it among waiting prompts (chunked prefill, as in Sarathi-Serve).

## Action Space

``MultiDiscrete([9, n_rules])``: (budget level, allocation rule).  Budget levels are
64, 128, ..., 16384 tokens per iteration, decodes included (Sarathi-Serve's and vLLM's
meaning); rules are 0 = FCFS fill (partial prefills first, then arrival order),
1 = shortest remaining prompt first, 2 = least TTFT slack first, and from v1
3 = least TTFT slack first among prompts that can still meet TTFT, the ones already
past it last.  From v2 the planner admits new prompts as Sarathi-Serve and vLLM V1 do (the
first that cannot start ends admission; v0 and v1 skip ahead to later prompts that fit), so every
fixed-budget Sarathi-Serve (``sarathi_B``) is the constant action ``(level, 0)``; in v0 and
v1 that action is ``sarathi_B`` with ``admission: skip`` (``sarathi_512_skip``).

From v3, ``MultiDiscrete([17, 8])``: (mode, allocation).  Modes 0-8 are the budget levels;
modes 9-16 are latency targets, 0.25, 0.5, 1 and 2 x the SLO's TPOT bound, then the same with
``spend_slack``, each turned into the largest budget level whose plan the cost model predicts
within it (``baselines.Adaptive``'s planner).  Allocations 0-3 are the four rules with ``stop``
admission, 4-7 the same with ``skip``.  So every ``sarathi_B`` is ``(level, 0)``, ``adaptive``
``(11, 4)`` and ``adaptive_srpf`` ``(11, 5)``: each heuristic of ``conf/policy`` that mixes decodes
and prefill is a constant action (:class:`envs.actions.TargetActionSpec`).

**Masks**: one valid action per distinct plan (see :mod:`envs.actions`), a flat bool
array of length ``sum(nvec)`` (budget levels, then rules), from ``env.action_masks()``
(through ``gym.make``'s wrappers too) and in ``info["action_mask"]`` of ``reset()`` and
every ``step()``.  An unmasked invalid action is mapped to the valid action with the
same plan, so ignoring masks is safe.

## Observation Space

``Box(-1, 1, (n_features,), float32)``: the features of :mod:`envs.features`
(``FEATURES_V0``: 16, ``FEATURES_V1``: 26, ``FEATURES_V3``: 30 with the SLO's bounds,
``FEATURES_V4``: 33 with the recent traffic's prompt and output lengths, ``FEATURES_V6``: 41 with
who waits, per SLO class and per tenant; each documented there).

## Rewards

v0: +1 when a request finishes within its SLO, -1 the moment a request is known to
miss it (TTFT bound passed while queued, a token gap over the stall bound, TPOT over
bound at finish, or rejection).  v1: +1 as soon as a request's first token meets its
TTFT bound, -2 if it later misses TPOT or stall (-1 if it never met TTFT).  Both times
``reward_scale``.  Every request of the window nets exactly +1 or -1, so the episode
return is ``(good - bad) * scale = (2 * goodput * span - requests) * scale``: an affine
function of the window's goodput.  v6: v1's reward with each request counted its SLO class's
weight ``w`` times (``interactive`` 3, ``standard`` 2, ``batch`` 1; 1 without a class), judged
by its class's bounds, so the return is ``(2 * weighted goodput * span - sum of w) * scale``:
affine in ``weighted_goodput_rps``.

## Starting State

Each reset draws a workload from ``workloads``, a window of ``split`` and a load from
``load_scale`` (each workload's own 1x; ``workload_loads`` may give a workload its own range), from the
env's seeded generator, or, with
``input_seed`` set, from ``(input_seed, episode index)``: then the k-th episode of every
env with that seed replays the same inputs (common random numbers across parallel envs).

## Episode End

No terminal state (the server runs on), so ``terminated`` is always False.  The episode
is **truncated** when every request of the window is decided, when the trace runs out,
or after ``max_steps`` steps (default 200,000; far above any window's length).  Episodes
end by themselves, so the ids are registered without ``max_episode_steps``.

## Arguments

``gym.make("chunkgym/ChunkedPrefill-v4", workloads=[...], load_scale=(1.0, 3.0), ...)``;
see :class:`ChunkedPrefillEnv`.

## info

``reset()``: ``requests``, ``load_scale``, ``workload``, ``now``, ``action_mask``.
``step()``: ``now``, ``latency``, ``decode_tokens``, ``prefill_tokens``, ``good``,
``bad``, ``requests``, ``action_mask``; at the end also ``serving`` (the window's
serving metrics, :func:`envs.serving.metrics.request_summary`).  ``info["episode"]`` is
left to Gymnasium's ``RecordEpisodeStatistics`` and SB3's ``Monitor``.

## Rendering

``render_mode="ansi"``: one line of text on the last iteration; ``"rgb_array"``: the
batch timeline of the last iterations (:mod:`envs.render`).

## Version History

* v6: v4 for many tenants and SLO classes (docs/tenants.md): 8 more features (``FEATURES_V6``: per
  class, the share of the lookahead waiting and its least TTFT slack; the number of tenants waiting
  and the largest one's share), the class-weighted first-token reward, the mix workloads
  ``mix_chat_batch`` and ``mix_agent`` by default (``mix_flood`` held out); actions and steps as v4.
  Without tenants or classes it steps and pays as v4 (its first 33 features are v4's; of the
  eight new ones only the tenant features move, saying whether prompts wait).

* v4: v3 with the lengths of recent traffic as three more features (``FEATURES_V4``: the
  mean and spread of recent arrivals' log prompt lengths, the mean log output length of recently
  finished requests), so one policy can tell workloads apart; actions, rewards and steps as v3.
* v3: v2 with the latency-target action space (modes: budget levels and latency targets;
  allocations: rule x admission, see above), latency targets valid whenever a prompt waits;
  the 30 features of ``FEATURES_V3`` (v1's plus the SLO bounds); rewards and steps as v2.
* v2: v1 with Sarathi-Serve's and vLLM V1's admission (``Admission.STOP``): a waiting
  prompt that cannot start ends admission for the iteration; observations, rewards and the
  action space as v1.
* (v0 and v1) end-of-episode metrics moved from ``info["episode"]`` to
  ``info["serving"]``; ``info["action_mask"]``, render modes; observations and rewards
  unchanged.
* v1: steps are decisions: iterations whose only valid action is forced (no prompt
  waiting: every action just steps the decodes) run without asking the agent, their
  rewards accruing to the next step; rule 3; 26 features; the first-token reward;
  the four training workloads by default.
* v0: one step per engine iteration, 3 rules, 16 features, reward at finish.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import load_env_creator
from gymnasium.utils import RecordConstructorArgs

from envs.actions import ACTIONS_V0, ACTIONS_V1, ACTIONS_V2, ACTIONS_V3, ActionSpace
from envs.episodes import draw_window, episode_rng
from envs.features import (
    FEATURE_NAMES_V0,
    FEATURE_NAMES_V1,
    FEATURE_NAMES_V3,
    FEATURE_NAMES_V4,
    FEATURE_NAMES_V6,
    features_v0,
    features_v1,
    features_v3,
    features_v4,
    features_v6,
)
from envs.lookahead import Lookahead, scan_lookahead
from envs.render import ansi_line, timeline_image
from envs.serving.core import ServingCore
from envs.serving.loop import StepDecodes
from envs.serving.metrics import SLOSpec, load_slo
from envs.serving.scheduling import ServingView
from envs.serving.setup import DEFAULT_HARDWARE, DEFAULT_MODEL, ServingSetup
from envs.serving.simulator import Simulator
from envs.serving.specs import HardwareSpec, ModelSpec, load_hardware, load_model
from envs.serving.workload import Workload, load_workload
from envs.serving.workloads.trace import Trace

TRAIN_WORKLOADS = ("azure_conv", "azure_code", "mooncake_conv", "sharegpt_poisson")
MIX_WORKLOADS = ("mix_chat_batch", "mix_agent")
"""v6's training mixes; ``mix_flood`` is held out (docs/tenants.md)."""


def score_at_finish(core: ServingCore) -> int:
    """v0's cumulative reward (unscaled): requests known good minus requests known bad."""
    return core.n_good - core.n_bad


def score_at_first_token(core: ServingCore) -> int:
    """v1's: +1 per request credited at its first token, -1 per request known bad, -1 more if it was credited."""
    return core.n_credited - core.n_uncredited - core.n_bad


def weighted_score_at_first_token(core: ServingCore) -> float:
    """v6's: v1's, each request counted its SLO class's weight times (1 without a class)."""
    book = core.book
    return book.w_credited - book.w_uncredited - book.w_bad


class Features(Protocol):
    """A feature set of :mod:`envs.features`: the observation of a state, from its lookahead scan
    when the caller has one (the env scans once per step, for the features and the mask)."""

    __name__: str

    def __call__(self, view: ServingView, look: Lookahead | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class EnvVersion:
    """What one registered version fixes; everything else is an argument of the env."""

    number: int
    features: Features
    feature_names: tuple[str, ...]
    actions: ActionSpace  # ActionSpec (v0-v2) or TargetActionSpec (v3, v4)
    score: Callable[[ServingCore], float]  # cumulative unscaled reward; a step pays its increase
    decision_steps: bool  # True: iterations with a forced action run without asking the agent
    workloads: tuple[str, ...]  # the default of the ``workloads`` argument
    disaggregated: bool = False  # True: the agent plans a disaggregated fleet's prefill servers

    def observe(self, view: ServingView) -> tuple[np.ndarray, Any, np.ndarray]:
        """The observation, valid actions and mask of ``view``'s state, from one lookahead scan: how
        the env and an exported policy (:class:`policies.exported.ExportedPolicy`) both see a state."""
        look = scan_lookahead(view)
        valid = self.actions.valid(view, look)
        return self.features(view, look), valid, self.actions.mask(view, valid)


VERSIONS: dict[int, EnvVersion] = {
    0: EnvVersion(0, features_v0, FEATURE_NAMES_V0, ACTIONS_V0, score_at_finish, False, ("azure_conv",)),
    1: EnvVersion(1, features_v1, FEATURE_NAMES_V1, ACTIONS_V1, score_at_first_token, True, TRAIN_WORKLOADS),
    2: EnvVersion(2, features_v1, FEATURE_NAMES_V1, ACTIONS_V2, score_at_first_token, True, TRAIN_WORKLOADS),
    3: EnvVersion(3, features_v3, FEATURE_NAMES_V3, ACTIONS_V3, score_at_first_token, True, TRAIN_WORKLOADS),
    4: EnvVersion(4, features_v4, FEATURE_NAMES_V4, ACTIONS_V3, score_at_first_token, True, TRAIN_WORKLOADS),
    # 5 is the routing env, another class (envs.fleet_routing).
    6: EnvVersion(
        6, features_v6, FEATURE_NAMES_V6, ACTIONS_V3, weighted_score_at_first_token, True, MIX_WORKLOADS
    ),
    # 7 plans a disaggregated fleet's prefill pool with v4's observation, actions and reward, so one
    # policy runs on either route (envs.disaggregated_prefill).
    7: EnvVersion(
        7, features_v4, FEATURE_NAMES_V4, ACTIONS_V3, score_at_first_token, True, TRAIN_WORKLOADS, True
    ),
}
DEFAULT_VERSION = 4
"""The version of :data:`~chunkgym.registration.ENV_ID` (train.py's, the leaderboard's); v6 is the
tenants' version, for mix workloads."""
FORCED = StepDecodes()  # the policy of forced iterations (stateless)


class ChunkedPrefillEnv(gym.Env[np.ndarray, np.ndarray]):
    """Token-budget and chunk-allocation control of a simulated LLM server; see the module docstring.

    Args:
        version: a key of :data:`VERSIONS` (the registered id sets it).
        workloads: names in ``conf/workload`` or ``file:PATH``, or loaded :class:`Workload` s,
            to draw episodes from (default: the version's).
        workload: one workload, v0's spelling of ``workloads=[workload]``.
        split: ``train`` (default), ``val``, ``test`` or ``all``.
        model, hardware, tp: names in ``conf/model`` and ``conf/hardware`` (or specs); tensor parallelism.
        slo: a name in ``conf/slo`` (or an :class:`~envs.serving.metrics.SLOSpec`).
        cost_model: ``calibrated``, ``roofline`` or a coefficient-file path.
        load_scale: a float, or a (low, high) pair sampled uniformly per episode.
        workload_loads: per workload name, its own ``load_scale`` (a float or a pair) in place of
            ``load_scale``: so that each workload's episodes can sit around its own capacity.
        window_s: trace-seconds per episode (default: ``window_scale`` x the workload's ``window_s``).
        window_scale: see ``window_s``.
        input_seed: if set, episode inputs come from ``(input_seed, episode index)``.
        max_steps: hard cap on steps per episode.
        reward_scale: multiplies the per-request rewards.
        serving: overrides of :class:`~envs.serving.core.ServingConfig` fields.
        data_root: where the traces live (default ``chunkgym.data_root()``).
        render_mode: ``None``, ``"ansi"`` or ``"rgb_array"``.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 30}
    drives_fleet = False
    """Whether this class serves the versions whose :attr:`EnvVersion.disaggregated` is set."""

    def __init__(
        self,
        version: int = DEFAULT_VERSION,
        workloads: Sequence[str | Workload] | str | Workload | None = None,
        split: str = "train",
        model: str | ModelSpec = DEFAULT_MODEL,
        hardware: str | HardwareSpec = DEFAULT_HARDWARE,
        tp: int = 1,
        slo: str | SLOSpec = "strict",
        cost_model: str = "calibrated",
        load_scale: float | Sequence[float] = 1.0,
        workload_loads: Mapping[str, float | Sequence[float]] | None = None,
        window_s: float | None = None,
        window_scale: float = 1.0,
        input_seed: int | None = None,
        max_steps: int = 200_000,
        reward_scale: float = 1.0,
        serving: dict[str, Any] | None = None,
        data_root: str | None = None,
        render_mode: str | None = None,
        workload: str | Workload | None = None,
    ) -> None:
        versions = sorted(v for v, data in VERSIONS.items() if data.disaggregated == self.drives_fleet)
        if version not in versions:
            fleet = version in VERSIONS and VERSIONS[version].disaggregated
            raise ValueError(
                f"version must be one of {versions}, got {version!r}"
                + (
                    f" (it plans a disaggregated fleet: gym.make('chunkgym/ChunkedPrefill-v{version}', fleet=...))"
                    if fleet
                    else ""
                )
            )
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}"
            )
        if workload is not None:
            if workloads is not None:
                raise ValueError("give workloads or workload, not both")
            workloads = [workload]
        self.version = version_data = VERSIONS[version]
        if workloads is None:
            workloads = version_data.workloads
        elif isinstance(workloads, str | Workload):
            workloads = [workloads]
        if not workloads:
            raise ValueError("workloads must name at least one workload")
        self.workloads = [w if isinstance(w, Workload) else load_workload(w, data_root) for w in workloads]
        self.split = split
        self.setup = ServingSetup.from_specs(
            load_model(model) if isinstance(model, str) else model,
            load_hardware(hardware) if isinstance(hardware, str) else hardware,
            tp,
            load_slo(slo) if isinstance(slo, str) else slo,
            cost_model,
            serving,
        )
        default = _load_range("load_scale", load_scale)
        names = [w.spec.name for w in self.workloads]
        own = {
            name: _load_range(f"workload_loads[{name}]", load)
            for name, load in (workload_loads or {}).items()
        }
        unknown = sorted(set(own) - set(names))
        if unknown:
            raise ValueError(
                f"workload_loads names {unknown}, which are not among this env's workloads {names}"
            )
        self.load_ranges = {name: own.get(name, default) for name in names}  # each workload's load range
        if window_scale <= 0:
            raise ValueError(f"window_scale must be > 0, got {window_scale}")
        self.window_s = window_s
        self.window_scale = window_scale
        self.input_seed = input_seed
        self.max_steps = max_steps
        self.reward_scale = reward_scale
        self.render_mode = render_mode
        self.actions = version_data.actions  # the planner and masks policies act through
        self.action_space = spaces.MultiDiscrete(list(self.actions.nvec))
        self.observation_space = spaces.Box(-1.0, 1.0, (len(version_data.feature_names),), np.float32)
        self.sim: Simulator | None = None
        self._mask = np.zeros(sum(self.actions.nvec), dtype=bool)
        self._valid = (0, False)  # self.actions.valid of the state the agent sees
        self._steps = 0
        self._score: float = 0
        self._episodes = 0

    # ---- gymnasium API -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        trace = self._draw_trace()
        self.sim = self._serve(trace)
        self._advance()
        self._steps = 0
        self._score = 0
        obs = self._observe()
        info = {
            "requests": len(trace),
            "load_scale": self.load,
            "workload": self.workload.spec.name,
            "now": self.sim.core.now,
            "action_mask": self._mask,
        }
        return obs, info

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        sim = self.sim
        if sim is None:
            raise RuntimeError("call reset() before step()")
        core = sim.core
        latency = sim.step(self.actions.plan(core, int(action[0]), int(action[1]), self._valid))
        more = self._advance()
        self._steps += 1
        score = self.version.score(core)
        reward = (score - self._score) * self.reward_scale
        self._score = score
        n = len(core.requests)
        truncated = (core.n_good + core.n_bad == n) or not more or self._steps >= self.max_steps
        columns = sim.log.cols
        obs = self._observe()
        info: dict[str, Any] = {
            "now": core.now,
            "latency": latency,
            "decode_tokens": columns["decode_tokens"][-1],
            "prefill_tokens": columns["prefill_tokens"][-1],
            "good": core.n_good,
            "bad": core.n_bad,
            "requests": n,
            "action_mask": self._mask,
        }
        if truncated:
            info["serving"] = sim.result().metrics
        return obs, float(reward), False, truncated, info

    def action_masks(self) -> np.ndarray:
        """Valid actions for sb3-contrib's MaskablePPO: budget levels, then rules (``info["action_mask"]``)."""
        return self._mask

    def render(self) -> str | np.ndarray | None:
        """``ansi``: a line on the last iteration; ``rgb_array``: the batch timeline; ``None``: nothing."""
        if self.render_mode is None:
            gym.logger.warn(
                "render() without a render_mode: pass render_mode='ansi' or 'rgb_array' to gym.make"
            )
            return None
        if self.sim is None:
            raise RuntimeError("call reset() before render()")
        if self.render_mode == "ansi":
            return ansi_line(self.sim)
        return timeline_image(self.sim.log)

    # ---- episodes ------------------------------------------------------------------------
    def _draw_trace(self) -> Trace:
        """The next episode's window (see Starting State); sets :attr:`workload` and :attr:`load`."""
        self._episodes += 1
        rng = episode_rng(self.np_random, self.input_seed, self._episodes)
        workload, load, trace = draw_window(
            rng, self.workloads, self.load_ranges, self.split, self.window_s, self.window_scale
        )
        self.workload, self.load = workload, load
        return trace

    def _serve(self, trace: Trace) -> Simulator:
        """Start serving ``trace``; the server whose iterations the agent plans: a fresh one."""
        return self.setup.simulator(trace)

    # ---- stepping ------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Run the server to the agent's next step; False once the trace is done."""
        assert self.sim is not None, "only called after reset()"
        if self.version.decision_steps:
            return self._advance_to_decision()
        return self.sim.advance_to_work()

    def _advance_to_decision(self) -> bool:
        """Run forced iterations (no prompt waiting) until a decision matters or all requests are decided.

        Most steps run none (a prompt still waits after the agent's iteration), so that is checked
        once before the loop is entered (which admits and checks again, finding nothing to do)."""
        sim = self.sim
        assert sim is not None, "only called after reset()"
        if not sim.advance_to_work():
            return False
        return self._decision_due() or sim.run_until(FORCED, stop=self._decision_due)

    def _decision_due(self) -> bool:
        assert self.sim is not None, "only called after reset()"
        core = self.sim.core
        return bool(core.queue) or core.n_good + core.n_bad == len(core.requests)

    def _observe(self) -> np.ndarray:
        """The observation of the state the agent now sees; sets the valid actions and the mask of that
        state (a fresh array, shared by ``info`` and :meth:`action_masks`) from the same lookahead scan."""
        assert self.sim is not None, "only called after reset()"
        obs, self._valid, self._mask = self.version.observe(self.sim.view)
        return obs


def _load_range(name: str, load: float | Sequence[float]) -> tuple[float, float]:
    """A load scale, or a (low, high) pair, as the pair episodes sample uniformly from."""
    pair = (float(load), float(load)) if isinstance(load, int | float) else (float(load[0]), float(load[-1]))
    if not 0 < pair[0] <= pair[1]:
        raise ValueError(f"{name} must be positive and ordered, got {load}")
    return pair


class ActionMasks(gym.Wrapper, RecordConstructorArgs):
    """Exposes ``action_masks()`` on top of ``gym.make``'s wrappers (Gymnasium 1.x wrappers
    forward no attributes); registered as each id's additional wrapper."""

    def __init__(self, env: gym.Env) -> None:
        RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)

    def action_masks(self) -> np.ndarray:
        # Registered only as the wrapper of chunkgym's own ids, so the innermost env is ours.
        return cast(ChunkedPrefillEnv, self.env.unwrapped).action_masks()


def version_of(env_id: Any) -> EnvVersion:
    """The version data (features, actions, ...) of the chunkgym env registered as ``env_id``."""
    if not isinstance(env_id, str) or not env_id.startswith("chunkgym/") or env_id not in gym.registry:
        known = sorted(k for k in gym.registry if k.startswith("chunkgym/"))
        raise ValueError(f"env {env_id!r} is not registered; chunkgym envs: {known}")
    spec = gym.registry[env_id]
    cls = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    if not (isinstance(cls, type) and issubclass(cls, ChunkedPrefillEnv)):
        raise ValueError(f"env {env_id!r} is not a ChunkedPrefill env: {cls!r}")
    return VERSIONS[spec.kwargs.get("version", DEFAULT_VERSION)]
