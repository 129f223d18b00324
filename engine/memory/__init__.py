"""`meshpipe memory`: per-stage memory of a layout, from a replay of the real stage code on
fake tensors.
"""
