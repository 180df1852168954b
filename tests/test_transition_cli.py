"""``nereus transition``: text, JSON and Gantt output from plan files."""

from __future__ import annotations

import json

from nereus.cli import main
from nereus.spec.plan import Candidate, Plan


def _write(tmp_path):
    cur = Plan((Candidate("actor.generate", 1, 4, 2, concurrency=64, gpus=tuple(range(8))),
                Candidate("critic.train", 1, 4, 2, micro_batch=4, grad_accum=32, gpus=tuple(range(8, 16)))))
    tgt = Plan((Candidate("actor.generate", 2, 4, 2, concurrency=64,
                          gpus=(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)),
                Candidate("critic.train", 1, 4, 4, micro_batch=4, grad_accum=16,
                          gpus=tuple(range(8, 16)) + tuple(range(24, 32)))))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"plan": cur.to_dict()}))  # the `nereus plan --json` shape
    b.write_text(tgt.to_json())
    return a, b


def test_cli_text_gantt_and_json(tmp_path, capsys):
    a, b = _write(tmp_path)
    png = tmp_path / "g.png"
    assert main(["transition", "--from", str(a), "--to", str(b), "--nodes", "4", "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    assert "L_tran = 0.836 s" in out and "bytes moved: 226.20 GB (minimum any transition moves: 226.20 GB)" in out
    assert "extend:critic.train*2" in out and "T_sub (1, 4)" in out
    assert png.stat().st_size > 1000
    assert main(["transition", "--from", str(a), "--to", str(b), "--nodes", "4", "--json", "--exact",
                 "--time-limit", "5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["feasible"] and doc["exact"]["status"] == "OPTIMAL"
    assert abs(doc["exact"]["makespan_s"] - doc["l_tran_s"]) < 1e-5


def test_cli_infeasible_and_bad_input(tmp_path, capsys):
    a, b = _write(tmp_path)
    assert main(["transition", "--from", str(a), "--to", str(b), "--nodes", "4", "--pool", "16"]) == 1
    assert "outside the pool" in capsys.readouterr().out
    assert main(["transition", "--from", str(tmp_path / "missing.json"), "--to", str(b)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_prints_a_reload_from_storage(tmp_path, capsys):
    train = (Candidate("actor.train", 2, 1, 2, micro_batch=4, grad_accum=32, gpus=(0, 1, 2, 3)),)
    cur = Plan(train + (Candidate("reference.infer", 1, 1, 2, micro_batch=8, gpus=(14, 15)),))
    tgt = Plan(train + (Candidate("reference.infer", 1, 1, 2, micro_batch=8, gpus=(6, 7)),))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(cur.to_json())
    b.write_text(tgt.to_json())
    png = tmp_path / "g.png"
    assert main(["transition", "--from", str(a), "--to", str(b), "--nodes", "2", "--pool", "8",
                 "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    assert "reference.infer  lost -> tp1 pp1 dp2 on GPUs 6-7" in out and "load x1" in out and "(reloaded from storage)" in out
    assert "load:reference.infer*0" in out and "storage -> 6" in out and png.stat().st_size > 1000
    assert main(["transition", "--from", str(a), "--to", str(b), "--nodes", "2", "--pool", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reloads"] == {"reference.infer": "storage"} and "reloaded by Load" in doc["reason"]
