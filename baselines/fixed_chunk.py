"""Chunked prefill without piggybacking: chunk iterations alternate with decode iterations."""

from __future__ import annotations

from envs.serving.scheduling import Plan, Policy, ServingView, plan_budget


class FixedChunk(Policy):
    """Prompts are cut into ``chunk``-token pieces; a prefill-only chunk iteration and a
    decode-only iteration take turns while both kinds of work wait.

    Decodes never wait more than one chunk's time, but each runs in a batch of its own,
    so the GPU sees small decode batches and small prefill batches: the inefficiency
    Sarathi-Serve's mixed batches remove.
    """

    def __init__(self, chunk: int = 512) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 token, got {chunk}")
        self.chunk = chunk
        self.name = f"fixed_chunk_{chunk}"
        self._last_was_chunk = False

    def reset(self, view: ServingView) -> None:
        self._last_was_chunk = False

    def plan(self, view: ServingView) -> Plan:
        if view.queue and not (self._last_was_chunk and view.num_decode):
            plan = plan_budget(view, self.chunk, with_decodes=False)
            if plan.chunks:
                self._last_was_chunk = True
                return plan
        self._last_was_chunk = False
        return Plan(decode=True)
