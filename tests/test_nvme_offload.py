"""ZeRO-Infinity's NVMe offload (ds_configs/zero3_nvme.json): the swap folder and pinned memory
filled by device and run folder, and the launcher's one line where DeepSpeed's async_io op cannot
be built. Training with it is measured by benchmarks/memory_scaling.py --ds_config zero3
zero3_nvme: the op's first build takes minutes, more than this suite can spend."""
import json
import os
import sys

from tests.conftest import PRETRAIN, run_group

from dr_scale import ds_config as dsc
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

    from dr_scale import nvme_offload
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
