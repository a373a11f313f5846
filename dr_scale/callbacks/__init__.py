"""Callbacks: EMA, per-layer clipping, gradient-norm monitor, profilers, memory, NaN guard.

`base` holds the Callback class and the trainer protocol; `build` switches the built-in ones on
from `callbacks.<name>` in the experiment config. Nothing here imports the trainer.
"""
