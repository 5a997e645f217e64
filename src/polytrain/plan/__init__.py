"""The planner: predicted step times of every strategy for a job and cluster, and a choice.

Example::

    plan = plan_job(Job(model="mlp", workers=4, nodes=4, servers=2, bandwidth="1gbit"))
    print(plan.describe())        # every strategy, fastest first; plan.recommended
"""

from .cost import Candidate, Compute, Constants, Network, Prediction, nic_traffic, predict
from .planner import AUTO, CONSTANTS, HOSTS, Job, Plan, auto_record, chosen, plan_job

__all__ = ["Candidate", "Compute", "Constants", "Network", "Prediction", "nic_traffic",
           "predict", "AUTO", "CONSTANTS", "HOSTS", "Job", "Plan", "auto_record", "chosen",
           "plan_job"]
