"""Trace loaders: every shipped file, the scaling rule, and clear errors on bad traces."""

import json
import pathlib

import pytest

from nereus.sim.growth import NOISE_SIGMA, fit_noise, growth_scenario
from nereus.sim.traces import (
    SHIPPED_TRACES,
    AvailabilityTrace,
    load_availability,
    load_response_lengths,
    shipped_trace,
)


@pytest.mark.parametrize("name", sorted(SHIPPED_TRACES))
def test_every_shipped_trace_loads(name):
    tr = shipped_trace(name)
    assert tr.times[0] == 0 and tr.end > 0 and min(tr.counts) >= 0


def test_bamboo_p3_matches_sources_md():
    tr = shipped_trace("bamboo-p3")   # SOURCES.md: 10-32 nodes, 163 distinct change times, 11.37 h
    assert (min(tr.counts), max(tr.counts)) == (10, 32)
    assert tr.num_changes == 162       # 163 change times, the first is the initial ramp at t=0
    assert tr.end / 3600 == pytest.approx(11.37, abs=0.01)
    assert shipped_trace("parcae-p3").counts == tr.counts   # Parcae's p3.csv is the same trace


def test_event_log_replay_and_scaling(tmp_path):
    p = tmp_path / "ev.csv"
    p.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n60000,remove,node1\n30000,remove,node2\n")
    tr = load_availability(p)          # rows unsorted on purpose
    assert tr.times == (0.0, 30.0, 60.0) and tr.counts == (4, 3, 2)
    s = tr.scaled(8)                   # floor(n * 8 / 4)
    assert s.counts == (8, 6, 4) and s.unit == "gpus"
    assert s.count_at(45) == 6 and s.next_change(30) == 60.0


def test_count_series_time_units(tmp_path):
    p = tmp_path / "c.csv"
    p.write_text("0,4\n1800,2\n")
    assert load_availability(p).times == (0.0, 1800.0)              # guessed seconds
    assert load_availability(p, time_unit="ms").times == (0.0, 1.8)
    with pytest.raises(ValueError, match="time_unit"):
        load_availability(p, time_unit="days")


def test_a_header_row_naming_the_columns_is_skipped(tmp_path):
    # issue 30: `simulate --trace` refused a count series with a `time,gpus` header
    p = tmp_path / "h.csv"
    p.write_text("time,gpus\n0,4\n1800,2\n")
    tr = load_availability(p)
    assert tr.times == (0.0, 1800.0) and tr.counts == (4, 2)
    q = tmp_path / "e.csv"
    q.write_text("time_ms,event,node\n0,add,a\n0,add,b\n60000,remove,a\n")
    assert load_availability(q).counts == (2, 1)
    (tmp_path / "only.csv").write_text("time,gpus\n")
    with pytest.raises(ValueError, match="no data rows"):
        load_availability(tmp_path / "only.csv")


def test_jsonl_and_skypilot(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text('[0, "add", {"nodes": ["a", "b"]}]\n[60000, "remove", {"nodes": ["a"]}]\n[120000, "DONE", {"nodes": []}]\n')
    assert load_availability(p).counts == (2, 1)
    q = tmp_path / "sky.json"
    q.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [1, 1, 0, 1]}))
    tr = load_availability(q)
    assert tr.times == (0.0, 600.0, 900.0) and tr.counts == (1, 0, 1) and tr.end == 1200.0


@pytest.mark.parametrize("text,match", [
    ("0,add,node1\n5,explode,node1\n", "add|remove"),
    ("0,4\n10,-2\n", "non-negative"),
    ("0,4,5,6\n", "unknown trace format"),
    ("0,four\n", "numbers"),
    ("   \n", "empty"),
    ('{"data": [1]}', "SkyPilot"),
    ('{"metadata": {"gap_seconds": 30}, "data": [1, -1]}', "non-negative"),
])
def test_bad_availability_traces_fail_clearly(tmp_path, text, match):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_availability(p)


def test_missing_file_and_unknown_name():
    with pytest.raises(ValueError, match="no such file; give a file path or a shipped trace name"):
        load_availability("/no/such/trace.csv")
    with pytest.raises(ValueError, match="unknown shipped trace"):
        shipped_trace("bamboo-p4")


def test_trace_invariants():
    with pytest.raises(ValueError, match="negative"):
        AvailabilityTrace("x", (0.0, 1.0), (2, -1), 2.0)
    with pytest.raises(ValueError, match="empty"):
        AvailabilityTrace("x", (), (), 0.0)
    with pytest.raises(ValueError, match="ever available"):
        AvailabilityTrace("x", (0.0,), (0,), 1.0)
    with pytest.raises(ValueError, match="num_gpus"):
        AvailabilityTrace("x", (0.0,), (1,), 1.0).scaled(0)


def test_response_length_csv(tmp_path):
    p = tmp_path / "len.csv"
    p.write_text("step,mean_response_length,score\n2,210.5,0.1\n1,200,0.1\n")
    lt = load_response_lengths(p)
    assert lt.lengths == (200.0, 210.5) and not lt.synthetic and lt.at(2) == 200.0
    p.write_text("step,length\n1,200\n")
    with pytest.raises(ValueError, match="mean_response_length"):
        load_response_lengths(p)
    p.write_text("step,mean_response_length\n")
    with pytest.raises(ValueError, match="no data rows"):
        load_response_lengths(p)
    p.write_text("step,mean_response_length\n1,-5\n")
    with pytest.raises(ValueError, match="positive"):
        load_response_lengths(p)


def test_growth_scenario_is_anchored_and_labelled():
    g = growth_scenario(1200, sigma=0.0)
    assert g.synthetic and "SYNTHETIC" in g.label and "SYNTHETIC" in g.source
    assert g.at(0) == pytest.approx(500) and g.at(1000) == pytest.approx(8000) and g.at(1100) == pytest.approx(8000)
    assert g.at(500) == pytest.approx(2000)            # geometric: 500 * 16**0.5
    assert g.meta["crossing_every_steps"] == pytest.approx(94.6, abs=0.1)
    noisy = growth_scenario(1000, seed=1)
    assert fit_noise(noisy.lengths) == pytest.approx(NOISE_SIGMA, rel=0.2)
    with pytest.raises(ValueError, match="start"):
        growth_scenario(10, start=0)


SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared/traces not present")
def test_every_shared_trace_loads():
    files = [p for p in (SHARED / "gpu_availability").rglob("*") if p.is_file() and p.suffix in (".csv", ".txt", ".json")]
    assert len(files) >= 60
    for p in files:
        tr = load_availability(p)
        assert min(tr.counts) >= 0 and tr.end >= tr.times[-1]
    for p in (SHARED / "response_length").glob("*.csv"):
        lt = load_response_lengths(p)
        assert len(lt.lengths) > 400
        assert 0.01 < fit_noise(lt.lengths) < 0.03            # the σ range quoted in growth.py
