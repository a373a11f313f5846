"""One kernel implementation as the registry records it (its op, devices, precision policy, why it
cannot run), the priorities, and `register_kernel`, which the implementation modules
(builtin.py) call as they are imported; registry.py imports them to look them up.
"""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from dr_scale.kernels.policy import PrecisionPolicy, dtype_name

CUDA, TRITON, APEX, TORCH = 40, 30, 20, 10  # priorities: higher wins


@dataclass
class Kernel:
    op: str
    name: str
    fn: Callable
    priority: int
    devices: Tuple[str, ...]
    policy: PrecisionPolicy
    available: Callable[[], Optional[str]]            # None, or why it cannot run here
    supports: Callable[..., Optional[str]]            # None, or why it cannot take this shape
    auto_devices: Tuple[str, ...]                     # where `auto` may pick it

    def why_not(self, device_type: str, dtype=None, **shape) -> Optional[str]:
        if device_type not in self.devices:
            return f"runs on {'/'.join(self.devices)}, not {device_type}"
        if dtype is not None and dtype not in self.policy.inputs:
            return f"its precision policy excludes {dtype_name(dtype)}"
        return self.available() or self.supports(**shape)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


KERNELS: Dict[str, Dict[str, Kernel]] = {}


def register_kernel(op, name, *, priority, devices, policy, available=None, supports=None,
                    auto_devices=None):
    def deco(fn):
        KERNELS.setdefault(op, {})[name] = Kernel(
            op, name, fn, priority, tuple(devices), policy, available or (lambda: None),
            supports or (lambda **_: None), tuple(auto_devices or devices))
        return fn
    return deco
