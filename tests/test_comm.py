"""Collectives correct by construction: dr_scale.runtime.comm places each tensor on a device the group
serves, and nothing in dr_scale calls torch.distributed's collectives around it."""
import ast
import json

from tests.conftest import ROOT, run_rank_script

COLLECTIVES = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "reduce",
               "gather", "scatter", "all_to_all", "all_gather_object", "broadcast_object_list",
               "gather_object", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "send", "recv", "isend", "irecv"}


def direct_collectives(path):
    """(line, call) of every `dist.X(...)` / `torch.distributed.X(...)` collective in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append((node.lineno, f"{owner}.{node.func.attr}"))
    return found


def test_no_collective_bypasses_comm():
    files = [p for d in ("dr_scale", "kernels", "benchmarks", "launchers")
             for p in (ROOT / d).rglob("*.py") if p != ROOT / "dr_scale" / "runtime" / "comm.py"]
    assert len(files) > 50
    bypass = [f"{p.relative_to(ROOT)}:{line} {call}" for p in files
              for line, call in direct_collectives(p)]
    assert bypass == []
    # the scan does find what it looks for
    assert len(direct_collectives(ROOT / "dr_scale" / "runtime" / "comm.py")) >= 6


def test_placement_under_a_group_that_serves_only_cuda(tmp_path):
    """A world group that serves CUDA tensors only (as NCCL's does) refuses a host tensor; comm
    sends such tensors to CUDA there, and on a host group reduces, gathers and scatters in place
    with the right values."""
    out = tmp_path / "result"
    run_rank_script("comm_groups.py", out, timeout=120)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"result.{rank}").read_text())
        assert r["raw"] == "No backend type associated with device type cpu"
        assert r["placed"] == "cuda" and r["cpu_group_placed"] == "cpu"
        assert r["same_object"] is True  # already on a served device: reduced in place
        assert r["sum"] == 3.0 and r["max"] == 2.0
        assert r["gathered"] == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
        assert r["scattered"] == ([3.0, 3.0] if rank == 0 else [21.0, 21.0])
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["broadcast"] == "from 0"
