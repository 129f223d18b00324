"""Schedules as data: actions, generators, text and file forms, lowering, validation,
simulation and plots.

Nothing here imports torch.distributed: a schedule is plain data that every other layer reads.
"""
