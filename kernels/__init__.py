"""Kernels, installed as `dr_scale.kernels`.

reference.py holds the pure-torch definition of every op: it is what runs on CPU and what every
faster implementation is tested against.
"""
from dr_scale.kernels import reference  # noqa: F401
