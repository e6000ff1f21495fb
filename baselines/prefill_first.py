"""Prefill-first schedulers: whenever a prompt can run, it runs and the decodes wait."""

from __future__ import annotations

from envs.serving.scheduling import Admission, Plan, Policy, ServingView, blocks_needed, plan_budget


class PrefillFirst(Policy):
    """Prefill iterations take priority over decode iterations; the two never mix.

    * ``whole_prompts=True`` (``fcfs``): vLLM's original scheduler without chunked
      prefill: whole prompts, in arrival order, packed up to ``max_batched_tokens`` (the
      model's context length by default); a prompt that does not fit in free KV blocks
      blocks the queue (head-of-line), and then the decodes run.  Every streaming user
      stalls for the whole prefill: the problem chunked prefill solves.
    * ``whole_prompts=False`` (``sglang``): SGLang's default (chunked prefill, mixed
      chunks off): prompts cut into chunks of ``max_batched_tokens``, still ahead of decodes.

    Both stop admitting at the first waiting prompt that does not fit, as the two systems do
    (vLLM's ``break``; SGLang's ``get_new_batch_prefill`` breaks on ``AddReqResult.NO_TOKEN``).
    """

    def __init__(self, max_batched_tokens: int = 0, whole_prompts: bool = True) -> None:
        self.max_batched_tokens = max_batched_tokens
        self.whole_prompts = whole_prompts
        self._limit = max_batched_tokens

    def reset(self, view: ServingView) -> None:
        self._limit = self.max_batched_tokens or view.max_model_len

    def plan(self, view: ServingView) -> Plan:
        if view.queue:
            plan = (
                self._whole(view)
                if self.whole_prompts
                else plan_budget(view, self._limit, with_decodes=False, admission=Admission.STOP)
            )
            if plan.chunks:
                return plan
        return Plan(decode=True)

    def _whole(self, view: ServingView) -> Plan:
        plan = Plan(decode=False)
        bs, free, slots, tokens = view.block_size, view.free_blocks, view.free_slots, 0
        for req in view.lookahead:
            n = req.target - req.computed
            need = blocks_needed(bs, req, n)
            if (plan.chunks and tokens + n > self._limit) or need > free or (not req.running and slots <= 0):
                break
            plan.chunks.append((req, n))
            tokens += n
            free -= need
            slots -= not req.running
        return plan
