"""What the machine, the scheduler and the process group provide, below everything else: the
process group and its collectives, this rank's place, the device's bf16 support, DeepSpeed's op
builds, NVMe offload's system side, the per-machine measurement cache, and what a running job
meets: hangs named (hangs.py), stop signals agreed (preemption.py), SLURM's signal lead
(slurm_lead.py), glibc's handling of freed host memory (host_memory.py)."""
