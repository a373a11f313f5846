"""bf16 by hardware: `"bf16": {"enabled": "auto"}` in the bundled DeepSpeed configs becomes bf16
where the device computes it natively and fp32 where it would be emulated; an explicit value is
obeyed, with a one-line warning where bf16 would be emulated."""
import json

import pytest

from dr_scale.config import ds_config as dsc
from dr_scale.config import load_config
from dr_scale.errors import DrScaleError
from dr_scale.runtime.hardware import cpu_bf16_support, cpu_flags

# The flags lines of the three CPUs these machines have shown (shortened to what matters).
AMX_XEON = "fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
AVX512_XEON = "fpu avx2 avx512f avx512bw avx512_vnni"
ZEN5_EPYC = "fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16"


def cpuinfo(tmp_path, flags):
    p = tmp_path / "cpuinfo"
    p.write_text(f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
                 f"flags\t\t: {flags}\n")
    return cpu_flags(str(p))


@pytest.mark.parametrize("flags, native, why", [
    (AMX_XEON, True, "CPU has amx_bf16 and avx512_bf16"),
    (ZEN5_EPYC, True, "CPU has avx512_bf16"),
    (AVX512_XEON, False, "CPU without avx512_bf16 or amx_bf16: bf16 is emulated"),
])
def test_cpu_flags_decide(tmp_path, flags, native, why):
    support = cpu_bf16_support(cpuinfo(tmp_path, flags), env={})
    assert (support.native, support.why) == (native, why)


def test_onednn_cap_below_bf16_counts_as_emulated(tmp_path):
    flags = cpuinfo(tmp_path, AMX_XEON)
    capped = cpu_bf16_support(flags, env={"ONEDNN_MAX_CPU_ISA": "avx512_core"})
    assert not capped.native and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in capped.why
    assert cpu_bf16_support(flags, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}).native


def test_unreadable_cpuinfo_assumes_emulated(tmp_path):
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert not cpu_bf16_support(frozenset(), env={}).native


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
@pytest.mark.parametrize("native", [True, False])
def test_bundled_configs_follow_the_hardware(name, native):
    raw = dsc.read_json(dsc.resolve_path(name))
    assert raw["bf16"]["enabled"] == "auto"
    ds = dsc.fill(raw, load_config(), 1, source=name, bf16_native=native)
    assert ds["bf16"]["enabled"] is native
    assert dsc.precision(ds) == ("bf16" if native else "fp32")


def test_fp16_config_is_left_alone():
    ds = dsc.fill(dsc.read_json(dsc.resolve_path("zero2_fp16")), load_config(), 1,
                  bf16_native=True)
    assert dsc.precision(ds) == "fp16"


def test_explicit_values_are_obeyed_and_emulation_is_warned(tmp_path):
    emulated = cpu_bf16_support(cpuinfo(tmp_path, AVX512_XEON), env={})
    native = cpu_bf16_support(cpuinfo(tmp_path, ZEN5_EPYC), env={})
    on, off = {"bf16": {"enabled": True}}, {"bf16": {"enabled": False}}
    assert dsc.precision(dsc.fill(on, load_config(), 1, bf16_native=False)) == "bf16"
    assert dsc.precision(dsc.fill(off, load_config(), 1, bf16_native=True)) == "fp32"
    why, warning = dsc.bf16_choice(on, emulated, "my.json")
    assert why == "" and warning == (
        "warning: my.json: bf16.enabled=true where CPU without avx512_bf16 or amx_bf16: bf16 is "
        "emulated, slower than fp32; \"auto\" would pick fp32 here")
    assert dsc.bf16_choice(on, native, "my.json") == ("", None)
    assert dsc.bf16_choice(off, emulated, "my.json") == ("", None)
    assert dsc.bf16_choice({"bf16": {"enabled": "auto"}}, emulated, "my.json") == (
        "bf16 \"auto\": CPU without avx512_bf16 or amx_bf16: bf16 is emulated", None)


def test_bad_bf16_value_is_one_line(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"bf16": {"enabled": "yes"}}))
    with pytest.raises(DrScaleError, match=r"ds\.json: bf16\.enabled: expected true, false or "
                                           r"\"auto\", got 'yes'$"):
        dsc.load(str(p), load_config(), dp_size=1)


def test_a_rank_takes_its_local_rank_among_the_devices_it_sees():
    """Eight local ranks over eight visible GPUs: one each; a cluster binding one GPU per task
    (each rank sees one device) puts every rank on its device 0, not on a device it cannot see."""
    from dr_scale.runtime.process_group import device_index

    assert [device_index(r, 8) for r in range(8)] == list(range(8))
    assert [device_index(r, 1) for r in range(8)] == [0] * 8
    assert [device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]


def test_threads_per_rank_respect_the_environment(monkeypatch):
    """OMP_NUM_THREADS (set by the user, or torchrun's default of 1) is obeyed; cores / ranks
    only when it is unset; DR_SCALE_THREADS_PER_RANK overrides both."""
    import os

    from dr_scale.runtime.process_group import threads_per_rank

    def cpu_threads(n):
        return threads_per_rank(n)[0]

    def threads_note(n):
        return threads_per_rank(n)[1]

    monkeypatch.delenv("DR_SCALE_THREADS_PER_RANK", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count()
    assert cpu_threads(1) == cores and cpu_threads(2 * cores) == 1
    assert threads_note(2) == f"{cores} cores / 2 rank(s) on this node"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3 and threads_note(2) == "OMP_NUM_THREADS=3"
    monkeypatch.setenv("DR_SCALE_THREADS_PER_RANK", "5")
    assert cpu_threads(2) == 5 and threads_note(2) == "DR_SCALE_THREADS_PER_RANK=5"
    monkeypatch.setenv("DR_SCALE_THREADS_PER_RANK", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "garbage")  # not a count: cores / ranks
    assert cpu_threads(1) == cores
