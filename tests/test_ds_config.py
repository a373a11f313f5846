"""ds_configs/: name resolution, "auto" filling, and one-line errors where configs disagree."""
import json

import pytest

from dr_scale.config import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.errors import DrScaleError


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload",
                                  "zero3_nvme", "zero2_fp16"])
def test_every_shipped_config_fills(name):
    cfg = load_config(overrides=["train.micro_batch_size=4", "train.global_batch_size=32"])
    ds = dsc.load(f"{name}.json", cfg, dp_size=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["train_batch_size"]) == (4, 4, 32)
    assert ds["optimizer"]["params"]["lr"] == 3e-3
    assert ds["optimizer"]["params"]["weight_decay"] == 0.1
    assert ds["gradient_clipping"] == 1.0
    assert dsc.zero_stage(ds) == int(name[4])
    # every "auto" filled but the NVMe swap folder's, which waits for the run folder
    # (DeepSpeedView.for_run, tests/test_nvme_offload.py)
    assert "auto" not in json.dumps(ds).replace('"nvme_path": "auto"', "")


def test_bare_name_without_extension_resolves():
    assert dsc.resolve_path("zero3") == dsc.DS_CONFIG_DIR / "zero3.json"
    assert dsc.resolve_path("zero3.json") == dsc.DS_CONFIG_DIR / "zero3.json"


def test_unknown_name_lists_shipped_configs():
    with pytest.raises(DrScaleError, match=r"--ds_config zero9\.json: file not found .*zero3\.json"):
        dsc.resolve_path("zero9.json")


def write(tmp_path, obj):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return p


def test_explicit_batch_size_that_disagrees_names_the_numbers(tmp_path):
    cfg = load_config(overrides=["train.micro_batch_size=4"])
    p = write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                         "gradient_accumulation_steps": "auto"})
    with pytest.raises(DrScaleError, match=r"ds\.json: train_batch_size=16 disagrees with "
                                           r"train\.micro_batch_size x accumulation x "
                                           r"data-parallel = 4 x 1 x 2"):
        dsc.load(str(p), cfg, dp_size=2)


def test_explicit_lr_that_disagrees(tmp_path):
    p = write(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    with pytest.raises(DrScaleError, match=r"optimizer\.params\.lr=0\.0001 disagrees with train\.lr=0\.003"):
        dsc.load(str(p), load_config(), dp_size=1)


def test_explicit_values_that_agree_are_kept(tmp_path):
    p = write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                         "gradient_accumulation_steps": 1, "gradient_clipping": 1.0})
    ds = dsc.load(str(p), load_config(), dp_size=2)
    assert ds["train_batch_size"] == 16


def test_global_batch_not_divisible():
    cfg = load_config(overrides=["train.micro_batch_size=3", "train.global_batch_size=16"])
    with pytest.raises(DrScaleError, match=r"train\.global_batch_size=16 is not a multiple of "
                                           r"train\.micro_batch_size=3 x data-parallel size 2 = 6"):
        dsc.batch_sizes(cfg.train, 2)


def test_auto_without_a_source_is_named(tmp_path):
    p = write(tmp_path, {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}})
    with pytest.raises(DrScaleError, match=r"ds\.json: zero_optimization\.sub_group_size: "
                                           r"\"auto\" has no value"):
        dsc.load(str(p), load_config(), dp_size=1)


def test_scheduler_steps_filled_from_experiment(tmp_path):
    p = write(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": "auto", "total_num_steps": "auto", "cos_min_ratio": "auto",
        "warmup_min_ratio": "auto", "warmup_type": "linear"}}})
    cfg = load_config(overrides=["train.max_steps=123", "train.warmup_steps=7"])
    params = dsc.load(str(p), cfg, dp_size=1)["scheduler"]["params"]
    assert (params["warmup_num_steps"], params["total_num_steps"]) == (7, 123)
    assert params["cos_min_ratio"] == pytest.approx(0.1)


@pytest.mark.parametrize("text, pattern", [
    ('{"train_batch_size": 4,\n "zero_optimization": {"stage": 2,}}', r"JSON syntax error at line 2"),
    ('[1, 2]', r"expected a JSON object"),
    ('{"zero_optimization": {"stage": 5}}', r"zero_optimization\.stage: expected 0, 1, 2 or 3, got 5"),
    ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}', r"both true"),
])
def test_bad_files_one_line(tmp_path, text, pattern):
    p = write(tmp_path, text)
    with pytest.raises(DrScaleError, match=pattern) as e:
        dsc.load(str(p), load_config(), dp_size=1)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload", "zero3_nvme"])
def test_zero_communication_is_tuned_per_device(name, tmp_path):
    """The bundled configs leave ZeRO's overlap and buckets to the device: CPU keeps the values
    measured here (no overlap, 5e7 buckets), a GPU gets DeepSpeed's (overlap, 5e8 reduction
    buckets); an explicit value is kept on either."""
    cfg = load_config()
    raw = dsc.read_json(dsc.resolve_path(name))
    cpu = dsc.fill(raw, cfg, 2, device_type="cpu")["zero_optimization"]
    gpu = dsc.fill(raw, cfg, 2, device_type="cuda")["zero_optimization"]
    assert (cpu["overlap_comm"], cpu["reduce_bucket_size"]) == (False, 50_000_000)
    assert (gpu["overlap_comm"], gpu["reduce_bucket_size"]) == (True, 500_000_000)
    if dsc.zero_stage(raw) == 3:
        assert cpu["stage3_prefetch_bucket_size"] == gpu["stage3_prefetch_bucket_size"] == 5e7
    mine = json.loads(json.dumps(raw))
    mine["zero_optimization"].update(overlap_comm=False, reduce_bucket_size=12345)
    kept = dsc.fill(mine, cfg, 2, device_type="cuda")["zero_optimization"]
    assert (kept["overlap_comm"], kept["reduce_bucket_size"]) == (False, 12345)


def test_reduction_dtype_is_stated():
    assert dsc.reduction_dtype({"bf16": {"enabled": True}}).startswith(
        "bf16 (the training precision; communication_data_type \"fp32\" reduces in fp32)")
    assert dsc.reduction_dtype({"bf16": {"enabled": True}, "communication_data_type": "fp32"}) \
        == "fp32 (communication_data_type)"
    assert dsc.reduction_dtype({}) == "fp32"


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offloaded_optimizer_without_an_optimizer_section_is_one_line(device):
    """DeepSpeed's CPU Adam is built from the "optimizer" section; without one it would end in
    its ZeRORuntimeException traceback after the process group started."""
    cfg = load_config(None, [])
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": device}}}
    with pytest.raises(DrScaleError) as e:
        dsc.fill(ds, cfg, 1, source="off.json")
    assert str(e.value).startswith(f"off.json: zero_optimization.offload_optimizer (device "
                                   f"{device}) needs an \"optimizer\" section")
    dsc.fill(dict(ds, optimizer={"type": "AdamW", "params": {"lr": "auto"}}), cfg, 1)
