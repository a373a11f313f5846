"""runtime/watchdog.silent_ranks: whom a rank past its step deadline names, from every rank's
heartbeat (the end-to-end case, a SIGSTOPped rank named with its host and pid, is in
tests/test_crash_resume.py)."""
import json

from dr_scale.runtime.watchdog import Watchdog, silent_ranks


def beat(step, phase, t, host="n1", pid=100):
    return json.dumps({"host": host, "pid": pid, "phase": phase, "step": step,
                       "collective": "all_reduce sum during step 3", "t": t}).encode()


def test_a_stopped_heartbeat_is_named_first():
    beats = [beat(7, "step 7", 100.0), beat(7, "step 7", 80.0, host="n2", pid=7), b""]
    line = silent_ranks(beats, my_step=7, interval_s=5.0, now=101.0)
    assert line == ("silent: rank 1 on n2 pid 7 at step 7 in 'step 7', last collective "
                    "'all_reduce sum during step 3', no heartbeat for 21 s; rank 2 (never beat)")


def test_then_the_ranks_behind_then_those_in_another_phase():
    beats = [beat(7, "step 7 backward", 100.0), beat(6, "step 6 data", 99.0),
             beat(7, "step 7 backward", 100.0)]
    assert silent_ranks(beats, 7, 5.0, now=101.0).startswith("behind: rank 1 on n1 pid 100 at "
                                                               "step 6 in 'step 6 data'")
    beats[1] = beat(7, "step 7 forward", 99.0)
    assert silent_ranks(beats, 7, 5.0, now=101.0).startswith(
        "elsewhere (the others in 'step 7 backward'): rank 1 on n1 pid 100 at step 7 in "
        "'step 7 forward'")


def test_the_deadline_follows_the_median_step_and_the_first_steps_are_not_timed():
    dog = Watchdog(rank=0, world=2, factor=10.0, min_s=60.0)
    assert dog.deadline_s() == 60.0
    dog.durations = [1.0, 9.0, 8.0]
    assert dog.deadline_s() == 80.0  # 10 x the median, 8 s
    dog.begin(4, "step 4", timed=False)
    dog.end()
    assert dog.durations == [1.0, 9.0, 8.0]  # an untimed phase adds no duration


def test_nccl_flight_recorder_is_set_where_the_user_has_not():
    from dr_scale.runtime.process_group import flight_recorder_env

    added = flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "100"})
    assert added == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                     "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/dr_scale_nccl_trace_rank_"}
