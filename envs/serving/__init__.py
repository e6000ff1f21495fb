"""The serving model; its scheduling interface is importable from here.

``from envs.serving import Policy, Plan, ServingView, plan_budget`` is all a new policy needs
(see :mod:`envs.serving.scheduling`).
"""

from envs.serving.scheduling import Plan, Policy, Rule, ServingView, plan_budget

__all__ = ["Plan", "Policy", "Rule", "ServingView", "plan_budget"]
