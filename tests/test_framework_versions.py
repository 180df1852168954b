"""Framework version → pinned vLLM → start-up memory rule (nereus/integrations/framework_versions.py), as
the importers and the users'-layouts benchmark use it."""

import csv
import json
from pathlib import Path

import pytest

from nereus.integrations import framework_versions as fv
from nereus.integrations.framework_versions import VLLM_PINS, version_rule, vllm_pin, vllm_rule_for

ROOT = Path(__file__).resolve().parents[1]


def test_vllm_version_to_rule_at_the_boundaries():
    assert vllm_rule_for("0.9.1") == vllm_rule_for("0.24.0") == vllm_rule_for("v0.29.0rc1") == "startup_check"
    assert vllm_rule_for("0.9.0") == vllm_rule_for("0.8.0") == vllm_rule_for("0.8.5.post1") == "device_total"
    assert vllm_rule_for("0.7.3") is None and vllm_rule_for("0.6.3") is None  # no sourced rule upstream
    with pytest.raises(ValueError, match="vLLM version 'latest' is not a version number"):
        vllm_rule_for("latest")


def test_table_pins_and_their_rules():
    assert vllm_pin("verl", "0.9.1").vllm == "0.24.0" and vllm_pin("verl", "0.9.1").rule == "startup_check"
    assert vllm_pin("openrlhf", "0.11.2").vllm == "0.29.0"
    # verl 0.1 runs its own patched vLLM 0.6.3 worker: the table's rule, not upstream 0.6.3's (none)
    p = vllm_pin("verl", "0.1")
    assert (p.vllm, p.rule) == ("0.6.3", "free_share") and "TinyZero" in p.source
    for pin in VLLM_PINS.values():  # each table rule agrees with its vLLM where upstream's rule is sourced
        assert pin.source and (vllm_rule_for(pin.vllm) in (None, pin.rule))
    assert vllm_pin("verl", "0.4.0") is None  # neither in the table nor installed
    with pytest.raises(ValueError, match="framework must be one of"):
        vllm_pin("trl", "0.1")


@pytest.mark.parametrize("fw", ["verl", "openrlhf"])
def test_installed_metadata_gives_the_same_pin_as_the_table(fw):
    v = fv.installed_version(fw)
    if v is None:
        pytest.skip(f"{fw} not installed")
    got = fv._installed_pin(fw, v)  # read from the installed wheel's Requires-Dist, not from the table
    assert got is not None and vllm_pin(fw).vllm == got.vllm
    if (fw, v) in VLLM_PINS:
        assert got.vllm == VLLM_PINS[(fw, v)].vllm and got.rule == VLLM_PINS[(fw, v)].rule


def test_version_rule_notes():
    notes = []
    assert version_rule("verl", "0.1", notes) == "free_share" and "vLLM 0.6.3" in notes[0]
    notes = []
    assert version_rule("verl", "0.9.1", notes) is None and notes == []  # startup_check is the default (None)
    notes = []
    assert version_rule("openrlhf", "0.5.0", notes) is None and "not in Nereus's table" in notes[0]


def test_importers_take_the_version(tmp_path):
    import sys

    from nereus.integrations.openrlhf import import_openrlhf, openrlhf_source
    from nereus.integrations.verl import import_verl
    from nereus.integrations.verl_config import load_verl_config, verl_config_dir

    if verl_config_dir() is None or openrlhf_source() is None:
        pytest.skip("needs verl and OpenRLHF installed")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import user_layouts

    rows = {r["id"]: r for r in csv.DictReader((ROOT / "benchmarks/data/user_layouts.csv").open())}
    r = rows["13"]
    cfg, model = load_verl_config(r["config"], json.loads(r["launch"])), user_layouts._model(r["model"], tmp_path)
    imp = import_verl(cfg, model=model, gpu="a100", version="0.1")
    assert imp.job.workload.vllm_memory_rule == "free_share" and any("vLLM 0.6.3" in n for n in imp.notes)
    assert import_verl(cfg, model=model, gpu="a100").job.workload.vllm_memory_rule is None  # installed 0.9.1
    imp = import_openrlhf(rows["10"]["launch"], model=rows["10"]["model"], version="0.5.0")
    assert imp.job.workload.vllm_memory_rule is None and any("not in Nereus's table" in n for n in imp.notes)


def test_benchmark_rows_rule_matches_their_version():
    """Every row with a framework version: the auto-selected rule is the one its vllm_rule column names."""
    for r in csv.DictReader((ROOT / "benchmarks/data/user_layouts.csv").open()):
        if r["framework_version"]:
            pin = vllm_pin(r["framework"], r["framework_version"])
            assert pin is not None and pin.rule == r["vllm_rule"], r["id"]
