"""``moetune plan``: how many GPUs a fine-tuning run needs and with which settings, before it starts.

    from moetune.plan import PlanRequest, make_plan, format_plan
    plan = make_plan(PlanRequest(model="qwen3_30b_a3b", gpus_per_node=8, nodes=1, gpu="h100"))
    print(format_plan(plan))

See moetune/plan/README.md for the files and docs/planning.md for the model and its validation.
"""

from moetune.plan.report import format_plan, plan_to_dict
from moetune.plan.search import Candidate, Plan, make_plan
from moetune.plan.setting import PlanRequest, Setting

__all__ = ["Candidate", "Plan", "PlanRequest", "Setting", "format_plan", "make_plan", "plan_to_dict"]
