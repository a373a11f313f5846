"""What the machine and the process group provide, below everything else: the process group and
its collectives, the device's bf16 support, DeepSpeed's op builds, NVMe offload's system side,
the per-machine measurement cache."""
