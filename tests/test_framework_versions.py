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
    with pytest.raises(ValueError, match="version 'latest' is not a version number"):
        vllm_rule_for("latest")


def test_table_pins_and_their_rules():
    assert vllm_pin("verl", "0.9.1").vllm == "0.24.0" and vllm_pin("verl", "0.9.1").rule == "startup_check"
    assert vllm_pin("openrlhf", "0.11.2").vllm == "0.29.0"
    # verl 0.1 runs its own patched vLLM 0.6.3 worker: the table's rule, not upstream 0.6.3's (none)
    p = vllm_pin("verl", "0.1")
    assert (p.vllm, p.rule) == ("0.6.3", "free_share") and "TinyZero" in p.source
    for pin in VLLM_PINS.values():  # each table rule agrees with its vLLM where upstream's rule is sourced
        assert pin.source and (vllm_rule_for(pin.vllm) in (None, pin.rule))
    assert vllm_pin("verl", "0.2") is None  # neither in the tables nor installed
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
    assert version_rule("openrlhf", "0.4.0", notes) is None and "not in Nereus's table" in notes[0]
    notes = []  # a known release whose vLLM (0.4.2) has no sourced rule
    assert version_rule("openrlhf", "0.5.0", notes) is None and "vLLM 0.4.2" in notes[0] and "not sourced" in notes[0]
    notes = []
    assert version_rule("openrlhf", "0.6.3", notes) == "device_total" and "vLLM 0.8.1" in notes[0]


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
    imp = import_openrlhf(rows["10"]["launch"], model=rows["10"]["model"], version="0.4.0")
    assert imp.job.workload.vllm_memory_rule is None and any("not in Nereus's table" in n for n in imp.notes)


def test_benchmark_rows_rule_matches_their_version():
    """Every row with a framework version whose vLLM has a sourced rule: the auto-selected rule is the one
    its vllm_rule column names (the others keep the column's, by hand, with its reason)."""
    n = 0
    for r in csv.DictReader((ROOT / "benchmarks/data/user_layouts.csv").open()):
        pin = vllm_pin(r["framework"], r["framework_version"]) if r["framework_version"] else None
        if pin is not None and pin.rule is not None:
            assert pin.rule == r["vllm_rule"], r["id"]
            n += 1
        else:
            assert r["vllm_rule"] and "not sourced" in r["vllm_source"] or not r["framework_version"], r["id"]
    assert n >= 25


def test_release_history_pins():
    # OpenRLHF: setup.py extras_require['vllm'] at the tags; a version between tags takes the latest at or before
    p = vllm_pin("openrlhf", "0.5.9.post1")
    assert (p.vllm, p.rule) == ("0.7.2", None) and "v0.5.8" in p.source  # vLLM 0.7 (V0): no sourced rule
    assert vllm_pin("openrlhf", "0.6.3").vllm == "0.8.1" and vllm_pin("openrlhf", "0.6.3").rule == "device_total"
    assert vllm_pin("openrlhf", "0.8.5").rule == "startup_check"  # vLLM 0.9.1: the start-up check
    assert vllm_pin("openrlhf", "0.4.0") is None and vllm_pin("openrlhf", "0.11.1") is None  # outside the tags
    # verl: VLLM_REQUIRES is a range; its upper bound is the pin
    assert vllm_pin("verl", "0.4.1").vllm == "0.8.5" and vllm_pin("verl", "0.6.0").rule == "startup_check"
    assert fv.version_key("0.5.9.post1") == (0, 5, 9, 1) < fv.version_key("0.6.4")


def test_flat_name_line_takes_its_releases_vllm_fraction():
    from nereus.integrations.openrlhf_legacy import translate_legacy

    line = ["--pretrain", "m", "--vllm_num_engines", "1", "--prompt_max_len", "1024", "--generate_max_len", "1024"]
    toks, notes, _ = translate_legacy(line, "0.5.9.post1")  # OpenRLHF < 0.6.4: 0.9 (vLLM's own before v0.5.8)
    assert toks[toks.index("--vllm.gpu_memory_utilization") + 1] == "0.9" and any("0.9 (OpenRLHF 0.5.9" in n for n in notes)
    toks, notes, _ = translate_legacy(line)  # release not known: 0.11's 0.95, said in the notes
    assert "--vllm.gpu_memory_utilization" not in toks and any("0.95 (OpenRLHF >= 0.6.4" in n for n in notes)
    toks, _, _ = translate_legacy(line + ["--vllm_gpu_memory_utilization", "0.5"], "0.5.9")
    assert toks.count("--vllm.gpu_memory_utilization") == 1 and toks[toks.index("--vllm.gpu_memory_utilization") + 1] == "0.5"
