"""The pipeline runtime: the engine and its step, the one interpreter, stages, precision, clipping,
optimizers, and the single-process reference every result is compared with.
"""
