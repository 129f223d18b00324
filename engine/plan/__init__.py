"""Planning a layout: measured per-stage costs for the simulator."""
