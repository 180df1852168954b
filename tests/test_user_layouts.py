"""The users'-layouts score (benchmarks/user_layouts.py over benchmarks/data/user_layouts.csv): every
row has a source and a published outcome, imports as written, and is judged; two rows checked by hand."""

import csv
import sys
from pathlib import Path

import pytest

from nereus.integrations.openrlhf import openrlhf_source
from nereus.integrations.verl_config import verl_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None,
                                reason="needs verl and OpenRLHF installed")


def test_rows_have_sources_and_outcomes():
    rows = list(csv.DictReader((ROOT / "benchmarks/data/user_layouts.csv").open()))
    assert len(rows) >= 10
    for r in rows:
        assert r["source"] and r["outcome"] in ("fits", "oom") and r["framework"] in ("verl", "openrlhf")


def test_lora_and_readme_rows_by_hand(tmp_path):
    import user_layouts

    rows = {r["id"]: r for r in csv.DictReader((ROOT / "benchmarks/data/user_layouts.csv").open())}
    # row 7: verl's Qwen2.5-3B GRPO LoRA example on 2 GPUs (rank 64): the frozen base keeps no Adam state
    v, detail = user_layouts.verdict(rows["7"], tmp_path)
    assert v == "fits", detail
    # row 10: OpenRLHF's README example, every model colocated with vLLM at 0.5 of each GPU
    v, detail = user_layouts.verdict(rows["10"], tmp_path)
    assert v == "fits", detail
    sub = tmp_path / "two.csv"
    with sub.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows["7"]))
        w.writeheader()
        w.writerows([rows["7"], rows["10"]])
    right, n, _ = user_layouts.score(sub)
    assert (right, n) == (2, 2)
