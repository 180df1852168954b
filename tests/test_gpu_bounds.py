"""Custom GPU fields in the wrong unit are refused by name with the value they likely meant
(nereus.spec.gpu_bounds); every preset lies inside the bounds."""

import json

import pytest

from nereus.spec.gpu_bounds import BOUNDS, check_plausible
from nereus.spec.hardware import GPU_PRESETS, GPUSpec, get_gpu

L40 = {"name": "l40", "peak_flops": 181e12, "memory_bytes": 48e9, "hbm_bandwidth": 864e9,
       "scaleup_bandwidth": 32e9, "scaleout_bandwidth": 25e9}


def test_every_preset_is_plausible():
    for g in GPU_PRESETS.values():
        check_plausible(g.to_dict())


def test_memory_in_gib_is_refused_with_the_bytes_it_meant(tmp_path):
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps(L40 | {"memory_bytes": 80}))
    # 80 GiB = 80 * 1024**3 = 85899345920 bytes
    with pytest.raises(ValueError, match=r"'memory_bytes' = 80 bytes is below.*1 GiB.*did you mean 80 GiB = "
                                         r"85899345920 bytes\?"):
        get_gpu(str(f))


@pytest.mark.parametrize("field,value,meant", [("peak_flops", 181, "181000000000000 FLOP/s"),
                                               ("hbm_bandwidth", 864, "864000000000 bytes/s"),
                                               ("scaleout_bandwidth", 25, "25000000000 bytes/s"),
                                               ("scaleup_latency", 5, "5e-06 seconds")])
def test_other_fields_in_the_wrong_unit(field, value, meant):
    with pytest.raises(ValueError, match=rf"GPU field '{field}' = {value} .*did you mean {value} .* = {meant}\?"):
        GPUSpec.from_dict(L40 | {field: value})


def test_far_out_of_range_without_a_hint_and_fp8_zero_allowed():
    with pytest.raises(ValueError, match=r"'memory_bytes' = 48000000000000000 bytes is above") as e:
        GPUSpec.from_dict(L40 | {"memory_bytes": 48e15})
    assert "did you mean" not in str(e.value)  # 48e15 GiB is no nearer
    assert GPUSpec.from_dict(L40 | {"peak_flops_fp8": 0}).peak_flops_fp8 == 0
    assert GPUSpec.from_dict(L40).memory_bytes == 48 * 10**9
    assert set(BOUNDS) <= set(GPUSpec.__dataclass_fields__)
