"""Where the model's parallelisable pieces are chosen, and how processes are set up."""

from .env import DistEnv, init_distributed
from .grad_sync import GradSync
from .plan import ParallelPlan, SingleDevicePlan, build_plan

__all__ = ["DistEnv", "GradSync", "ParallelPlan", "SingleDevicePlan", "build_plan", "init_distributed"]
