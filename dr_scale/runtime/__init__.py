"""What the machine, the scheduler and the process group provide, below everything else: the
process group and its collectives, this rank's place, the device's bf16 support, DeepSpeed's op
builds, NVMe offload's system side, the per-machine measurement cache, and what a running job
meets: hangs named (hangs.py; the heartbeat and step deadline: watchdog.py), suspect nodes
noted for the next attempt (suspects.py), stop signals agreed (preemption.py), SLURM's signal
lead and GraceTime (slurm_lead.py), glibc's handling of freed host memory (host_memory.py), the
node's memory figure shared by its ranks (node_memory.py)."""
