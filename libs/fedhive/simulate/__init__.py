"""`fedhive simulate`: run a job on simulated sites in one process (`run`), the sites and apps
it runs with (`plan`)."""

from fedhive.simulate.plan import Plan, plan
from fedhive.simulate.run import ENV_NUM_SITES, Options, Simulated, simulate

__all__ = ["ENV_NUM_SITES", "Options", "Plan", "Simulated", "plan", "simulate"]
