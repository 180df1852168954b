"""``nereus simulate`` end to end on a small scenario, and its errors."""

import json

from nereus.cli import main


def test_simulate_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["simulate", "--nodes", "2", "--hours", "0.4", "--policies", "nereus,static", "--gammas", "",
               "--jobs", "1", "--trace", "parcae-hh", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "SYNTHETIC" in text and "nereus" in text and "static" in text
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"nereus", "static"} and summary["scenario"]["lengths_synthetic"]
    log = json.loads((out / "nereus.json").read_text())
    assert log["summary"]["steps"] == len([p for p in log["timeline"]]) or log["summary"]["restarts"] > 0
    assert (out / "nereus.png").stat().st_size > 0 and (out / "static.png").stat().st_size > 0
    for name in ("nereus", "static"):
        p = summary["policies"][name]
        assert sum(p["restarts_by_cause"].values()) == p["restarts"]
        if p["restarts"]:
            assert "restart causes:" in text


def test_simulate_bad_inputs_exit_2(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "missing.csv" in err and "bamboo-p3" in err
    assert main(["simulate", "--hours", "-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--hours must be > 0" in err and "-1" in err
    bad = tmp_path / "neg.csv"
    bad.write_text("0,4\n60,-1\n")
    assert main(["simulate", "--trace", str(bad), "--out", str(tmp_path)]) == 2
    assert "non-negative" in capsys.readouterr().err
    assert main(["simulate", "--policies", "nereus,magic", "--jobs", "1", "--hours", "0.1", "--out", str(tmp_path)]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["simulate", "--growth", "500-8000", "--out", str(tmp_path)]) == 2
    assert "START:END:STEPS" in capsys.readouterr().err
