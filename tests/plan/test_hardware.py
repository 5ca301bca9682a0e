"""Hardware profiles: built-ins load with their datasheet numbers; user files; clear errors."""

import pytest

from moetrain.errors import UserError
from moetrain.plan.hardware import PROFILE_DIR, list_builtin, load_hardware

BUILTIN = ["a100-80gb-sxm", "b200", "h100-sxm", "h200-sxm", "mi300x", "mi355x"]


def test_builtins_listed_and_loaded():
    assert list_builtin() == BUILTIN
    peaks = {n: load_hardware(n).peak("bf16") for n in BUILTIN}
    assert peaks == {"a100-80gb-sxm": 312.0, "b200": 2250.0, "h100-sxm": 989.4, "h200-sxm": 989.4,
                     "mi300x": 1307.4, "mi355x": 2516.6}


def test_every_number_has_a_source_comment():
    for path in PROFILE_DIR.glob("*.yaml"):
        for line in path.read_text().splitlines():
            body = line.split("#")[0].strip()
            if body and ":" in body and body.split(":", 1)[1].strip() not in ("",) and \
                    any(ch.isdigit() for ch in body.split(":", 1)[1]):
                assert "#" in line or body.startswith(("name", "description")), f"{path.name}: {line}"


def test_h200_measured_ceilings_and_derived_rates():
    hw = load_hardware("h200")  # alias
    assert hw.name == "h200-sxm" and hw.hbm_gib == 139.8 and hw.gpus_per_node == 8
    assert hw.measured["gemm_bf16_tflops"] == 790 and hw.measured["copy_tbps"] == 4.25
    assert hw.mem_bw == pytest.approx(4.8e12 * 0.885)
    assert hw.gemm_flops("bf16") == pytest.approx(989.4e12 * 0.80)


def test_user_yaml(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("name: mygpu\npeak_tflops: {bf16: 100}\nhbm_gib: 24\nhbm_tbps: 1\ngpus_per_node: 4\n"
                 "intra_node_gbps: 50\ninter_node_gbps: 10\n")
    hw = load_hardware(str(f))
    assert (hw.name, hw.peak("bf16"), hw.hbm_gib, hw.gpus_per_node) == ("mygpu", 100, 24, 4)


def test_errors_are_one_line_and_helpful(tmp_path):
    with pytest.raises(UserError) as err:
        load_hardware("v100")
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in BUILTIN)
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\npeak_tflops: {bf16: 1}\n")
    with pytest.raises(UserError, match="lacks hbm_gib"):
        load_hardware(str(f))
    f.write_text("name: x\npeak_tflops: {bf16: 1}\nhbm_gib: 1\nhbm_tbps: 1\ngpus_per_node: 1\n"
                 "intra_node_gbps: 1\ninter_node_gbps: 1\nbogus: 3\n")
    with pytest.raises(UserError, match="unknown hardware key"):
        load_hardware(str(f))
    with pytest.raises(UserError, match="no peak for fp8"):
        load_hardware("a100").peak("fp8")


def test_trainer_mfu_peaks_agree_with_the_planner_profiles():
    """The trainer's device-name peak table and the planner's profiles must not drift apart."""
    from moetrain.plan.hardware import list_builtin, load_hardware
    from moetrain.train.throughput import peak_tflops

    for name in list_builtin():
        hw = load_hardware(name)
        # the profile's description is what torch.cuda.get_device_name() would contain
        assert peak_tflops(hw.description, "bf16") == pytest.approx(hw.peak("bf16"), rel=2e-3), name


def test_every_builtin_profile_says_where_each_number_comes_from():
    from moetrain.plan.hardware import REQUIRED, TIMING_KEYS, list_builtin
    from moetrain.plan.provenance import inputs

    for name in list_builtin():
        hw = load_hardware(name)
        assert set(hw.sources) == set(REQUIRED + TIMING_KEYS), name
        assert set(hw.sources.values()) <= {"measured", "datasheet", "reference design", "assumption"}, name
    h200 = load_hardware("h200-sxm").inputs()
    assert {"hbm_gib", "launch_overhead_us", "gemm_efficiency", "measured.copy_tbps"} <= set(h200["measured"])
    assert "peak_tflops" in h200["datasheet"] and "inter_node_latency_us" in h200["assumption"]
    mi = inputs(load_hardware("mi355x"))
    assert "gemm_efficiency" in mi["hardware"]["assumption"] and "never measured" in mi["compute"]
    h200_compute = inputs(load_hardware("h200"))["compute"]
    assert "H200" in h200_compute and "never" not in h200_compute
