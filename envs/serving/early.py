"""Early decisions for capacity probes: stop a run the moment its pass/fail cannot change.

``attain90`` passes iff (requests meeting their SLO) / N >= 0.9 at the end of the run.  The
core counts requests known good (``n_good``: finished within every bound) and known bad
(``n_bad``: rejected, or past a bound) the moment they are; both only grow, and at the end
``n_good + n_bad == N``.  So the final attainment lies in ``[good / N, (N - bad) / N]``, and
floating-point division by a fixed N is monotone: ``good / N >= 0.9`` proves a pass,
``(N - bad) / N < 0.9`` proves a fail.  The same expressions as :func:`metrics.attain90`'s,
so the early answer is the end-of-run answer bit for bit (tested over generated cases).

``tbt`` (P99 of every token gap, median scheduling delay over finished requests) has no
such proof here: its probes run to the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.serving.core import ServingCore
from envs.serving.loop import CountStop
from envs.serving.metrics import ATTAIN90_TARGET


@dataclass(frozen=True)
class Attain90Stop:
    """The proof of ``attain90``'s outcome for a window of ``requests`` requests: ``good``/``bad``,
    the fewest known-good requests that prove a pass and known-bad ones that prove a fail;
    :meth:`watching` a core, the stop predicate for :meth:`Simulator.run`, true once it is known.
    """

    requests: int
    good: int
    bad: int

    @classmethod
    def for_requests(cls, n: int) -> Attain90Stop:
        if n <= 0:  # attainment is NaN: a fail, known before the run starts
            return cls(n, 1, 0)
        good = next(g for g in range(n + 1) if g / n >= ATTAIN90_TARGET)
        bad = next(b for b in range(n + 1) if (n - b) / n < ATTAIN90_TARGET)
        return cls(n, good, bad)

    def watching(self, core: ServingCore) -> CountStop:
        """This proof as :meth:`~envs.serving.loop.ServingLoop.run_until`'s ``stop`` on ``core``."""
        return CountStop(core, self.good, self.bad)

    def passed(self, core: ServingCore) -> bool:
        """The proven outcome once :meth:`watching`'s predicate holds."""
        return core.n_good >= self.good
