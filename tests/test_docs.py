"""docs/ is self-contained and its sample outputs match the program (scripts/regen_docs.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("regen_docs", ROOT / "scripts" / "regen_docs.py")
regen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regen_docs)
MINE = [ROOT / "docs" / n for n in ("planner.md", "transition.md", "simulate.md", "files.md")]


def test_cheap_samples_match_the_program():
    paths = [p for p in MINE if p.exists()]
    assert sum(len(regen_docs.samples(p)) for p in paths) >= 4
    assert regen_docs.regen(paths, only=["plan", "transition"], check=True) == []


@pytest.mark.slow
def test_simulate_sample_matches_the_program():
    assert regen_docs.regen([ROOT / "docs" / "simulate.md"], only=["simulate"], check=True) == []


def test_docs_cite_only_files_in_the_repository():
    for p in MINE:
        text = p.read_text()
        for bad in ("DESIGN.md", "cost-model.md", "shared/", "resharding.md", "Notes for the"):
            assert bad not in text, (p.name, bad)
        for link in re.findall(r"\]\(([^)#]+)\)", text):
            if not link.startswith("http"):
                assert (p.parent / link).exists(), (p.name, link)
