"""Planning a layout: measured per-stage costs for the simulator."""

from engine.plan.profile import profile_stage_costs

__all__ = ["profile_stage_costs"]
