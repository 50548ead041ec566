"""Where the model's parallelisable pieces are chosen, and how processes are set up."""

from .env import DistEnv, init_distributed, wrap_model
from .plan import ExpertParallelPlan, SingleDevicePlan, build_plan

__all__ = ["DistEnv", "ExpertParallelPlan", "SingleDevicePlan", "build_plan", "init_distributed", "wrap_model"]
