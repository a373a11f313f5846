"""What the rank scripts here share: each rank writes its result as JSON to `<out>.<rank>`, for
the test to read, then leaves its process group."""
import json


def write_and_leave(out, rank: int, result):
    import torch.distributed as dist

    from dr_scale.launch import leave

    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    leave(0)  # see dr_scale.launch.leave
