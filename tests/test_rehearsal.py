"""benchmarks/rehearsal.py at N = 8: eight CPU ranks under a real one-node SLURM, the shipped
sbatch script, through a time limit, a damaged latest checkpoint with a rank SIGKILLed, a
SIGSTOPped rank, a full disk during a save, a preemption and a requeue on four ranks; one scripted job checked many ways.
The run ends as the uninterrupted eight-rank job (fp32: bitwise before the layout change,
within 1e-5 after), each step once, each sample position once."""
import sys

from tests.conftest import ROOT, module_folder
from tests.slurm_cluster import one_node_slurm

sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_week_of_faults_at_eight_ranks(request, cache_dir, tmp_path_factory):
    import rehearsal

    folder = module_folder(request, tmp_path_factory, "rehearsal")
    with one_node_slurm(folder / "slurm", cpus=8) as env:
        week = rehearsal.rehearse(8, folder / "n8", cache_dir, env, timeout=600)
    faults = {f["fault"]: f for f in week["faults"]}
    print(week)
    assert week["steps_once"] and week["ledger_ok"], week
    assert week["bitwise_before_change"] and week["max_diff_after_change"] <= 1e-5, week
    # a time limit's stop loses nothing; its resume starts at the step it stopped after
    assert faults["time limit (USR1)"]["lost_steps"] == 0
    # the damaged latest: named in one line, the resume takes the one before it
    damaged = faults["latest checkpoint damaged, then a rank SIGKILLed"]
    assert any(damaged["damaged"].split("/")[0] in w and "CRC-32" in w
               for w in week["warnings"]), week["warnings"]
    # the hang: named by the step deadline (15 s here) with its host and pid, well inside 2 min
    hang = faults["rank 1 SIGSTOPped (a hang)"]
    assert hang["named_silent_rank"] and hang["detect_s"] < 15 + 2 * 5 + 20, hang
    # the full disk: each rank names its file and the free space; the save before it stands
    assert faults["a full disk during a save"]["named_full_disk"]
    # four failures, each requeued (the time limits spend none of the budget)
    assert len(week["failures_file"]) == 4, week["failures_file"]
    assert faults["requeued on 4 ranks (universal form)"]["lost_steps"] == 0
