"""GPU presets users run on (issue 28), each with its datasheet source, and custom GPUs from the CLI."""

import json

import pytest

from nereus.cli import main
from nereus.spec.hardware import GPU_PRESETS, GPUSpec, get_gpu

MIB = 2**20

# (preset, dense bf16 TFLOP/s, memory MiB or bytes, HBM TB/s, scale-up GB/s per direction) from the datasheets
DATASHEET = [
    ("a100-40gb", 312, 40536 * MIB, 1.555, 300),
    ("a800", 312, 81920 * MIB, 2.039, 200),
    ("h800", 989.4, 81559 * MIB, 3.35, 200),
    ("h20", 148, 97871 * MIB, 4.0, 450),
    ("l20", 119.5, 46068 * MIB, 0.864, 32),
    ("l40s", 362.05, 46068 * MIB, 0.864, 32),
    ("h100-pcie", 756, 81559 * MIB, 2.0, 64),
    ("h100-nvl", 835, 95830 * MIB, 3.9, 64),
    ("mi300x", 1307.4, 205822885888, 5.3, 448),
    ("b200", 2250, 183359 * MIB, 8.0, 900),
]


@pytest.mark.parametrize("name,tflops,mem,hbm,up", DATASHEET)
def test_presets_match_their_datasheets(name, tflops, mem, hbm, up):
    g = get_gpu(name)
    assert g.peak_flops == pytest.approx(tflops * 1e12)
    assert g.memory_bytes == mem
    assert g.hbm_bandwidth == pytest.approx(hbm * 1e12)
    assert g.scaleup_bandwidth == pytest.approx(up * 1e9)
    assert "datasheet" in g.source or "product brief" in g.source
    assert get_gpu(name.upper()) is g


def test_custom_gpu_from_a_file_and_inline(tmp_path):
    d = {"name": "mygpu", "peak_flops": 4e14, "memory_bytes": 64 * 2**30, "hbm_bandwidth": 2e12,
         "scaleup_bandwidth": 2e11, "scaleout_bandwidth": 2.5e10}
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps(d))
    assert get_gpu(str(f)) == GPUSpec.from_dict(d)
    assert get_gpu(json.dumps(d)).peak_flops == 4e14
    with pytest.raises(ValueError, match="missing field"):
        get_gpu(json.dumps({"name": "x", "peak_flops": 1e12}))
    with pytest.raises(ValueError, match="does not exist"):
        get_gpu(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="unknown GPU 'h900'"):
        get_gpu("h900")


def test_cli_plans_on_a_custom_gpu(tmp_path, capsys):
    d = GPU_PRESETS["h100"].to_dict() | {"name": "h100-half", "memory_bytes": 40 * 2**30}
    f = tmp_path / "gpu.json"
    f.write_text(json.dumps(d))
    rc = main(["plan", "--gpu", str(f), "--model", "qwen2.5-0.5b", "--nodes", "1", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    gpu = json.loads(out)["job"]["cluster"]["gpu"]  # a custom GPU travels whole with the job
    assert GPUSpec.from_dict(gpu) == get_gpu(str(f))


def test_cli_refuses_lengths_past_the_context(capsys):
    # qwen2.5-0.5b: max_position_embeddings 32768; 1024 + 40000 tokens do not fit
    rc = main(["plan", "--model", "qwen2.5-0.5b", "--response-len", "40000"])
    err = capsys.readouterr().err
    assert rc == 2 and "41024 tokens exceeds" in err and "max_position_embeddings=32768" in err


def test_gemma2_is_refused_by_name(tmp_path):
    from nereus.spec.presets import get_model

    d = tmp_path / "gemma2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
        "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}))
    with pytest.raises(ValueError, match="'gemma2' is not supported .*sliding-window"):
        get_model(str(d))
