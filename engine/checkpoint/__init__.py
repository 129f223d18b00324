"""Checkpoints: collective save and load, on-disk files and indexes, atomic writes, RNG states,
and Hugging Face names and folders.
"""
