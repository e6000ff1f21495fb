"""Running statistics of the traffic a server has seen: what a real scheduler can observe of its workload.

The simulator's core (:class:`~envs.serving.core.ServingCore`) and the vLLM view
(:class:`~engine.vllm_backend.view.VllmView`) each keep one :class:`TrafficStats`, fed at the same
points (a request's arrival, its prefix-cache hit, its end), so features computed from it are the same
numbers on both.  Nothing here knows the future: prompt lengths are read at arrival, output lengths only
once a request has finished.

The length statistics tell workloads apart that the queue's state alone does not: arXiv's long prompts of
one size and short answers, ServeGen's short prompts and long reasoning outputs, Mooncake's mixed
lengths.  They are running means for the first ``1 / LENGTH_EWMA_ALPHA`` samples and exponentially
weighted after, so the first requests of an episode are not biased towards zero.
"""

from __future__ import annotations

import math

RATE_TAU_S = 10.0  # time constant of the arrival-rate estimate, s
PREFIX_EWMA_ALPHA = 0.05  # weight of a new arrival in the prefix-hit EWMA
LENGTH_EWMA_ALPHA = 0.02  # weight of a new sample in the length statistics (~50 requests)


class TrafficStats:
    """Arrival rate, prefix hits, prompt and output lengths of recent requests (see the module docstring)."""

    __slots__ = (
        "_rate",
        "_rate_t",
        "prefix_hit_ewma",
        "prompt_log_mean",
        "prompt_log_var",
        "output_log_mean",
        "arrivals",
        "finishes",
    )

    def __init__(self) -> None:
        self._rate = 0.0  # decayed arrival count / RATE_TAU_S at time _rate_t
        self._rate_t = 0.0
        self.prefix_hit_ewma = 0.0  # fraction of recent arrivals' prompts served from the prefix cache
        self.prompt_log_mean = 0.0  # of log1p(prompt tokens) at arrival
        self.prompt_log_var = 0.0
        self.output_log_mean = 0.0  # of log1p(tokens generated) by finished requests
        self.arrivals = 0
        self.finishes = 0

    def arrive(self, t: float, prompt_len: int) -> None:
        """A request of ``prompt_len`` tokens arrived at ``t`` (in any order: vLLM adds requests as they
        reach the engine, not always in arrival order)."""
        if t >= self._rate_t:
            self._rate = self._rate * math.exp((self._rate_t - t) / RATE_TAU_S) + 1.0 / RATE_TAU_S
            self._rate_t = t
        else:
            self._rate += math.exp((t - self._rate_t) / RATE_TAU_S) / RATE_TAU_S
        self.arrivals += 1
        alpha = max(LENGTH_EWMA_ALPHA, 1.0 / self.arrivals)
        delta = math.log1p(prompt_len) - self.prompt_log_mean
        self.prompt_log_mean += alpha * delta
        self.prompt_log_var = (1.0 - alpha) * (self.prompt_log_var + alpha * delta * delta)

    def prefix_hit(self, fraction: float) -> None:
        """An admitted request found ``fraction`` of its prompt in the prefix cache."""
        self.prefix_hit_ewma += PREFIX_EWMA_ALPHA * (fraction - self.prefix_hit_ewma)

    def finish(self, generated: int) -> None:
        """A request ended after generating ``generated`` tokens."""
        self.finishes += 1
        alpha = max(LENGTH_EWMA_ALPHA, 1.0 / self.finishes)
        self.output_log_mean += alpha * (math.log1p(generated) - self.output_log_mean)

    def rate(self, now: float) -> float:
        """Arrivals per second at ``now``, exponentially weighted over the last ~RATE_TAU_S seconds."""
        return self._rate * math.exp((self._rate_t - now) / RATE_TAU_S)

    @property
    def prompt_log_std(self) -> float:
        """The spread of recent prompts' log lengths (0 when they are all of one size)."""
        return math.sqrt(self.prompt_log_var)
