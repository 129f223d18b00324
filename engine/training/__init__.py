"""The training loop and what surrounds it: configuration, data and batches, metrics, traces,
preflight and resume checks, DeepSpeed configs, text generation.
"""
