"""Starts the test suite's training ranks by forking one process that has imported torch and
DeepSpeed once (tests/conftest.py `RankStarter` talks to it), instead of a fresh interpreter
per rank.

Why: a rank's own work in the suite's tiny runs is about a second; its imports are the rest.
torch, DeepSpeed, and the torch._dynamo and inductor modules that torch's Optimizer.__init__
and DeepSpeed's ZeRO optimizer check import at first use cost ~3.6 s of a core per rank on these
2-core machines: a 1-rank run took 4.8 s from a fresh interpreter and 1.0 s forked from here,
with the same losses. The launchers themselves (deepspeed, torchrun, the installed module, SLURM)
keep tests of their own with fresh interpreters.

Only third-party modules are imported here, none of dr_scale's: a dr_scale module that reads
the environment at import time reads the rank's. A forked rank gets the requested argv, working
directory, environment and output files, its own process group (or the one named, so a launch's
ranks are killed together), and runs the script as `python -u script args` would, interpreter
exit handlers included.

Protocol, one JSON object a line: requests on stdin {"id", "argv", "cwd", "env", "out", "err",
"group"}; replies on stdout {"started": id, "pid": pid} and, when the rank ends,
{"exited": id, "code": its exit status as subprocess reports it (-N: killed by signal N)}.
"""
import json
import os
import sys
import threading
import time

CHANNEL = os.fdopen(os.dup(1), "w", buffering=1)  # replies; fd 1 itself goes to stderr
os.dup2(2, 1)


def preload():
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it)
    import torch._inductor.compile_fx  # noqa: F401  (torch.compile at DeepSpeed's Muon import)
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (ZeRO's optimizer check)


def run_rank(request) -> int:
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        try:
            os.setpgid(0, request["group"])
        except OSError:  # the parent has done it already (both do, whichever comes first)
            pass
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["out"]), (2, request["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught one
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main():
    preload()
    lock = threading.Lock()
    request_of = {}  # pid -> request id

    def send(message):
        with lock:
            CHANNEL.write(json.dumps(message) + "\n")

    def reap():
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:  # none running
                time.sleep(0.02)
                continue
            with lock:
                ident = request_of.pop(pid)
            send({"exited": ident, "code": os.waitstatus_to_exitcode(status)})

    threading.Thread(target=reap, daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        with lock:  # no reply half-written in the child's copy of the channel
            pid = os.fork()
            if pid == 0:
                os._exit(run_rank(request))
            request_of[pid] = request["id"]
        try:  # its process group, before the next rank asks to join it
            os.setpgid(pid, request["group"] or pid)
        except OSError:
            pass
        send({"started": request["id"], "pid": pid})


if __name__ == "__main__":
    main()
