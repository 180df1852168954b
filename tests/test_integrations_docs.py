"""docs/integrations.md is self-contained and its samples match the program: the imported layouts, the
refused settings and the exported settings (the parts that do not depend on Nereus's own best plan,
which the planner's search decides) are regenerated and compared (scripts/regen_docs.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from nereus.integrations.openrlhf import openrlhf_source
from nereus.integrations.verl_config import verl_config_dir

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "integrations.md"
_spec = importlib.util.spec_from_file_location("regen_docs", ROOT / "scripts" / "regen_docs.py")
regen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen_docs)


def _own_part(body: str) -> str:
    """The lines an integration decides: before Nereus's best plan (imports), or the settings
    (exports; the closest expressible layout does not depend on the best plan)."""
    lines = body.splitlines()
    for i, ln in enumerate(lines):
        if ln.endswith(" settings:"):
            return "\n".join(lines[i:])
        if ln.startswith("Nereus's best plan for the same job:"):
            return "\n".join(lines[:i])
    return body


def test_doc_cites_only_files_in_the_repository():
    text = DOC.read_text()
    for bad in ("DESIGN.md", "cost-model.md", "shared/", "http://", "https://"):
        assert bad not in text, bad
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        assert (DOC.parent / link).exists(), link


@pytest.mark.skipif(verl_config_dir() is None or openrlhf_source() is None, reason="needs verl and OpenRLHF")
def test_samples_match_the_program():
    samples = regen_docs.samples(DOC)
    assert len(samples) >= 5
    for cmd, body in samples:
        assert _own_part(regen_docs.run_sample(cmd)) == _own_part(body), cmd[:120]
