"""Planning a layout: the search over meshes, schedules, micro-batching, ZeRO and recompute
(`search`), its plan file (`write_plan`, `read_plan`), its picture, and measured costs."""

from engine.plan.figure import plan_figure, plot_plan
from engine.plan.hardware import ACCELERATORS, Accelerator, Hardware, accelerator
from engine.plan.link import Link, fitted_link, measured_link
from engine.plan.plan_file import (
    PLAN_VERSION,
    apply_plan,
    merge_plan,
    plan_fields,
    read_plan,
    write_plan,
)
from engine.plan.profile import (
    available_cores,
    measured_device_flops,
    measured_forward,
    measured_input_shares,
    measured_memory_bandwidth,
    measured_split_forward,
    profile_stage_costs,
)
from engine.plan.request import LOSSES, PlanRequest, PlanResult, Prediction, Progress
from engine.plan.screen import DOUBLINGS, fewest_devices
from engine.plan.search import predict, search, step_with_costs

__all__ = [
    "ACCELERATORS",
    "DOUBLINGS",
    "LOSSES",
    "PLAN_VERSION",
    "Accelerator",
    "Hardware",
    "Link",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "Progress",
    "accelerator",
    "apply_plan",
    "available_cores",
    "fewest_devices",
    "fitted_link",
    "measured_device_flops",
    "measured_forward",
    "measured_input_shares",
    "measured_link",
    "measured_memory_bandwidth",
    "measured_split_forward",
    "merge_plan",
    "plan_fields",
    "plan_figure",
    "plot_plan",
    "predict",
    "profile_stage_costs",
    "read_plan",
    "search",
    "step_with_costs",
    "write_plan",
]
