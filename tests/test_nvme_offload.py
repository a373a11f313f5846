"""ZeRO-Infinity's NVMe offload (ds_configs/zero3_nvme.json): the swap folder and pinned memory
filled by device and run folder, and the launcher's one line where DeepSpeed's async_io op cannot
be built. Training with it is measured by benchmarks/memory_scaling.py --ds_config zero3
zero3_nvme: the op's first build takes minutes, more than this suite can spend."""
import json
import os
import sys

from tests.conftest import PRETRAIN, run_group

from dr_scale.config import ds_config as dsc
from dr_scale.config import load_config


def test_nvme_path_and_pinning_are_filled_by_run_folder_and_device(tmp_path):
    cfg = load_config()
    raw = dsc.read_json(dsc.resolve_path("zero3_nvme"))
    cpu = dsc.fill(raw, cfg, 2, device_type="cpu", run_dir=tmp_path)["zero_optimization"]
    gpu = dsc.fill(raw, cfg, 2, device_type="cuda", run_dir=tmp_path)["zero_optimization"]
    assert cpu["offload_optimizer"] == dict(device="nvme", nvme_path=str(tmp_path / "offload"),
                                            pin_memory=False, buffer_count=4)
    assert gpu["offload_optimizer"]["pin_memory"] is True
    # sub-groups bound DeepSpeed's swap buffers (buffer_count of the largest sub-group, fp32):
    # its default 1e9 would buffer a 1B model's whole optimizer partition in memory
    assert cpu["sub_group_size"] == 20_000_000
    mine = json.loads(json.dumps(raw))
    mine["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/local_nvme"
    kept = dsc.fill(mine, cfg, 2, run_dir=tmp_path)["zero_optimization"]["offload_optimizer"]
    assert kept["nvme_path"] == "/local_nvme"

    # a run: the plan keeps "auto", the engine's copy has the run folder's offload/
    from dr_scale.models import resolve_shape
    from dr_scale.parallel.topology import Topology
    from dr_scale.plan import deepspeed_view

    view = deepspeed_view("zero3_nvme", cfg, Topology(2), resolve_shape(cfg.model), "cpu")
    assert view.filled["zero_optimization"]["offload_optimizer"]["nvme_path"] == "auto"
    engine = view.for_run(tmp_path)["zero_optimization"]
    assert engine["offload_optimizer"]["nvme_path"] == str(tmp_path / "offload")
    assert view.filled["zero_optimization"]["offload_optimizer"]["nvme_path"] == "auto"


def test_without_async_io_the_launcher_stops_in_one_line(tmp_path, cache_dir):
    """DeepSpeed decides whether it can build async_io by compiling and linking a program
    against libaio; with no working compiler (CC=false) it cannot, as on a machine without
    libaio's headers. The run folder is never made."""
    run = tmp_path / "run"
    env = dict(os.environ, CC="false", DR_SCALE_CACHE=str(cache_dir))
    code, out, err = run_group([sys.executable, str(PRETRAIN), "--ds_config",
                                "zero3_nvme", "--run_dir", str(run), "model.preset=tiny"], env, 120)
    lines = [line for line in err.splitlines() if "dr_scale: error:" in line]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert lines == [f"dr_scale: error: {dsc.resolve_path('zero3_nvme')}: "
                     "zero_optimization.offload_optimizer.device=nvme needs DeepSpeed's async_io "
                     "op, which cannot be built here: it needs libaio (Debian/Ubuntu: apt-get "
                     "install libaio-dev; RHEL/Rocky: dnf install libaio-devel; elsewhere set "
                     "CFLAGS/LDFLAGS to its headers and library); or use --ds_config "
                     "zero3_offload (host memory)"]
    assert not run.exists()


def test_an_unwritable_swap_folder_is_one_line(tmp_path):
    import pytest

    from dr_scale.runtime import nvme_offload
    from dr_scale.errors import DrScaleError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ds = {"zero_optimization": {"offload_optimizer": {"device": "nvme",
                                                      "nvme_path": str(blocker / "swap")}}}
    with pytest.raises(DrScaleError, match=r"^zero3_nvme.json: zero_optimization.\*.nvme_path="
                       rf"{blocker}/swap: cannot write there \(Not a directory\); give a "
                       "writable local NVMe folder$"):
        nvme_offload.prepare_dirs(ds, "zero3_nvme.json")
    assert blocker.read_text() == "not a folder"


def test_parameter_swapper_assertions_become_one_line(tmp_path, monkeypatch):
    """DeepSpeed's parameter swapper (offload_param to NVMe) asserts deep in the build or a
    forward when its buffers are too small or too few; its own methods raise them here (the
    async_io op is not needed to reach them) and the launcher's line names the key to change.
    Seen end to end on a machine with the op built: tiny widened to 1,024, max_in_cpu 0,
    buffer_size 4e6 (a 4,194,304-element partition) and then buffer_count 2."""
    from types import SimpleNamespace

    import pytest
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
        AsyncPartitionedParameterSwapper, PartitionedParamStatus)

    from dr_scale.runtime.nvme_offload import swapper_error

    swapper = AsyncPartitionedParameterSwapper.__new__(AsyncPartitionedParameterSwapper)
    swapper.__dict__.update(available_buffer_ids=[0], elements_per_buffer=4_000_000, id_to_path={},
                            swap_folder=str(tmp_path), inflight_params=[],
                            inflight_swap_in_buffers=[], inflight_numel=0, available_params=set(),
                            available_numel=0, param_id_to_numel={})
    param = SimpleNamespace(ds_id=7, ds_tensor=SimpleNamespace(
        status=PartitionedParamStatus.NOT_AVAILABLE))
    with pytest.raises(AssertionError) as too_small:
        swapper.get_buffer(param, 4_194_304)
    assert swapper_error(too_small.value, "p.json") == (
        "p.json: zero_optimization.offload_param.buffer_size=4000000: a parameter's partition "
        "has 4194304 elements; buffer_size must hold the largest one")
    swapper.available_buffer_ids = []
    # its diagnostic prints ask the process group for a rank; there is none in this process
    monkeypatch.setattr(pps, "print_rank_0", lambda *a, **k: None)
    with pytest.raises(AssertionError) as too_few:
        swapper.swap_in([param], async_op=False)
    line = swapper_error(too_few.value, "p.json")
    assert line.startswith("p.json: zero_optimization.offload_param.buffer_count: DeepSpeed ran "
                           "out of parameter swap buffers (Not enough buffers 0 for swapping 1)")
    assert "\n" not in line
    assert swapper_error(AssertionError("param 18 already assigned swap buffer id 17"),
                         "p.json").startswith("p.json: zero_optimization.offload_param.max_in_cpu: "
                                              "DeepSpeed ")
    assert swapper_error(AssertionError("something else"), "p.json") is None
    assert swapper_error(RuntimeError("Not enough buffers 0 for swapping 1"), "p.json") is None


def test_a_parameter_listed_twice_is_swapped_in_once(tmp_path, monkeypatch):
    """DeepSpeed's NVMe prefetch lists a parameter that two modules share (tied embeddings) twice
    in one swap_in: its own swapper asserts on the second buffer assignment (the failure at a
    run's second step); after swap_in_each_parameter_once the parameter takes one buffer and its
    partition is read from its swap file. Seen end to end: tiny widened to 1,024, tied
    embeddings, parameters wholly on NVMe, one rank: stopped at step 2 before, and after it
    trained 4 steps with losses bit for bit those of plain ZeRO-3. The swapper's bookkeeping is
    DeepSpeed's; the file read stands in for its async_io op (built only on first use)."""
    from types import SimpleNamespace

    import numpy as np
    import pytest
    import torch
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (
        AsyncPartitionedParameterSwapper as Swapper, PartitionedParamStatus)

    from dr_scale.runtime.nvme_offload import swap_in_each_parameter_once

    numel = 4096
    saved = torch.arange(numel, dtype=torch.float32)
    (tmp_path / "7_param.tensor.swp").write_bytes(saved.numpy().tobytes())

    class FileReads:  # async_pread/wait as DeepSpeed's handle: bytes of the file into the buffer
        def __init__(self):
            self.queued = 0

        def async_pread(self, buffer, path, offset):
            buffer.numpy()[:] = np.fromfile(path, dtype=np.float32, count=buffer.numel())
            self.queued += 1
            return 0

        def wait(self):
            done, self.queued = self.queued, 0
            return done

    def fresh():
        swapper = Swapper.__new__(Swapper)
        swapper.__dict__.update(
            available_buffer_ids=[0, 1, 2], param_id_to_buffer_id={}, param_id_to_swap_buffer={},
            param_id_to_numel={7: numel}, id_to_path={}, swap_folder=str(tmp_path),
            buffers=torch.zeros(3 * numel), aligned_elements_per_buffer=numel,
            numel_alignment=256, inflight_params=[], inflight_swap_in_buffers=[],
            inflight_numel=0, pending_reads=0, available_params=set(), available_numel=0,
            aio_read_handle=FileReads())
        part = torch.empty(0)
        part.status = PartitionedParamStatus.NOT_AVAILABLE
        return swapper, SimpleNamespace(ds_id=7, ds_tensor=part)

    monkeypatch.setattr(Swapper, "swap_in", Swapper.swap_in)  # put back after the test
    # its diagnostic prints ask the process group for a rank; there is none in this process
    monkeypatch.setattr(pps, "print_rank_0", lambda *a, **k: None)
    swapper, param = fresh()
    with pytest.raises(AssertionError, match="param 7 already assigned swap buffer id"):
        swapper.swap_in([param, param], async_op=False)
    swap_in_each_parameter_once()
    swap_in_each_parameter_once()  # once is enough: a second call does not wrap again
    swapper, param = fresh()
    swapper.swap_in([param, param], async_op=False)
    assert swapper.available_buffer_ids == [0, 1] and swapper.param_id_to_buffer_id == {7: 2}
    assert param.ds_tensor.status == PartitionedParamStatus.AVAILABLE
    assert torch.equal(param.ds_tensor, saved)
