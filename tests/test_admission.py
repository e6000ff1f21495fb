"""The admission rule: a waiting prompt that does not fit blocks the ones behind it (vLLM V1,
Sarathi-Serve: ``stop``) or is passed over (``skip``); the named baselines use their system's rule
and preempt the newest running request, as vLLM does."""

import numpy as np
import pytest

from baselines import Sarathi
from envs.serving.scheduling import Admission, Rule, admission_named, plan_budget
from policies import registry
from policies.registry import make_policy
from tests.simtools import make_sim, make_trace


def _blocked_head_sim():
    """r0 decodes in a 20-block cache; at 0.5 s r1 (200 tokens, 13 blocks) does not fit, r2 (32) does."""
    trace = make_trace([0.0, 0.5, 0.5], [160, 200, 32], [150, 5, 5])
    return make_sim(trace, num_blocks=20)


def test_a_prompt_that_does_not_fit_blocks_the_ones_behind_it_under_stop_only():
    sim = _blocked_head_sim()
    sim.run_until(Sarathi(512), until_s=0.5)
    sim.advance_to_work()
    view = sim.view
    assert [r.rid for r in view.queue] == [1, 2] and view.num_decode == 1
    skip, stop = (plan_budget(view, 512, Rule.FCFS, admission=a) for a in (Admission.SKIP, Admission.STOP))
    assert [r.rid for r, _ in skip.chunks] == [2]
    assert stop.chunks == [] and stop.decode


@pytest.mark.parametrize("admission", ["skip", "stop"])
def test_under_stop_no_prompt_starts_before_the_blocked_one_ahead_of_it(admission):
    sim = _blocked_head_sim()
    res = sim.run(Sarathi(512, admission=admission))
    assert res.metrics["finished"] == 3
    first = {r.rid: r.first_scheduled for r in sim.core.requests}
    assert (first[2] < first[1]) == (admission == "skip")


def test_stop_ends_admission_but_running_prefills_go_on():
    """Shortest-first puts the new 32-token prompt (no batch slot left) ahead of the running prefill:
    it ends admission, and the running prefill still gets its chunk."""
    trace = make_trace([0.0, 0.0, 0.01], [32, 3000, 32], [400, 5, 5])
    sim = make_sim(trace, max_num_seqs=2)
    sim.run_until(Sarathi(128), until_s=0.02)  # r0 decodes, r1 is mid-prefill, r2 waits for a slot
    view = sim.view
    assert view.free_slots == 0 and [(r.rid, r.running) for r in view.queue] == [(1, True), (2, False)]
    plan = plan_budget(view, 512, Rule.SHORTEST_FIRST, admission=Admission.STOP)
    assert [r.rid for r, _ in plan.chunks] == [1] and plan.decode


def test_a_head_waiting_only_on_prefixes_pinned_behind_it_does_not_stall_the_engine():
    """Nothing runs; the head (11 blocks) does not fit beside the 4 blocks of cached prefix the prompt
    behind it pins. vLLM would evict those; chunkgym keeps them, so the planner lets the next prompt
    that fits start instead of planning nothing (which the core rejects)."""
    unit = 32
    trace = make_trace(
        [0.0, 10.0, 10.0],
        [64, 170, 96],
        [1, 1, 1],
        hashes=[[1, 2], [7, 8, 9, 10, 11, 12], [1, 2, 3]],
        unit=unit,
    )
    sim = make_sim(trace, num_blocks=12)
    res = sim.run(Sarathi(512))
    assert res.metrics["finished"] == 3 and res.outcomes.prefix_hit.tolist() == [0, 0, 2 * unit]
    first = {r.rid: r.first_scheduled for r in sim.core.requests}
    assert first[2] < first[1]
    sim.core.kv.check()


@pytest.mark.parametrize("name", ["sglang_8192", "fcfs"])
def test_prefill_first_engines_stop_at_the_blocked_prompt_too(name):
    """SGLang's ``get_new_batch_prefill`` breaks on the first request it cannot add, as vLLM does."""
    sim = _blocked_head_sim()
    res = sim.run(make_policy(name))
    assert res.metrics["finished"] == 3
    first = {r.rid: r.first_scheduled for r in sim.core.requests}
    assert first[2] >= first[1]  # under skip, r2 would start at 0.5 s while r1 waits


def test_named_baselines_use_their_systems_admission(tmp_path, monkeypatch):
    assert make_policy("sarathi_512").admission is Admission.STOP
    assert make_policy("vllm_v1_8192").admission is Admission.STOP
    assert make_policy("sarathi_512_skip").admission is Admission.SKIP
    with pytest.raises(ValueError, match=r"admission must be one of skip, stop, got 'vllm'"):
        admission_named("vllm")
    monkeypatch.setattr(registry, "POLICY_DIR", tmp_path)
    (tmp_path / "bad.yaml").write_text("_target_: baselines.Sarathi\nadmission: lookahead\n")
    with pytest.raises(
        ValueError,
        match=r"^\S*bad.yaml: baselines.Sarathi: admission must be one of skip, stop, got 'lookahead'$",
    ):
        make_policy("bad")


@pytest.mark.parametrize("name", ["vllm_v1_8192", "sarathi_512", "fcfs"])
def test_kv_pressure_preempts_the_newest_running_request(name):
    """Two streams outgrow a 20-block cache: the one started last is preempted (vLLM's
    ``self.running.pop()``), the older one never is."""
    trace = make_trace([0.0, 0.05], [100, 100], [200, 200])
    sim = make_sim(trace, num_blocks=20)
    res = sim.run(make_policy(name))
    assert res.outcomes.preemptions.tolist()[0] == 0 and res.outcomes.preemptions.tolist()[1] >= 1
    times = res.token_times
    assert times[0][-1] < times[1][-1] and all(len(times[i]) == 200 for i in (0, 1))
    assert np.all(np.diff(times[1]) > 0)
