"""The across-traces tables of docs/simulate.md ("Results") from ``benchmarks/bench_admission.py --json``.

Usage::

    python benchmarks/bench_admission.py --notice 0 --json n0.json
    python benchmarks/bench_admission.py --notice 120 --json n120.json
    python scripts/simulate_tables.py n0.json n120.json

Several JSON files are merged (their runs are keyed by job class, trace, seed, notice and policy;
a run without a ``job`` field, written before issue 29, is the ``8b`` class). Prints Markdown: first
one row per job class and notice (runs, Nereus / policy geometric means, Nereus / static minimum and
the runs below 0.98x static), then per job class: Nereus / policy as a geometric mean over runs with
its range and the runs won / lost / tied (a tie is within ``bench_admission.TIE`` = 0.1%), restarts
per policy and transitions, the geometric mean over seeds per trace, and the restarts per cause of
``nereus`` and ``uncalibrated``. All figures are response tokens per second over each run's
simulated time (``summary.json``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_admission import TIE  # noqa: E402

ORDER = ("nereus-paper", "nereus-ema", "static", "elastic", "elastic-oracle", "replan-all", "nereus-h1",
         "uncalibrated")
PER_TRACE = ("static", "elastic-oracle", "replan-all", "nereus-ema", "uncalibrated")
#: the job class of a run written before runs carried one (bench_admission's default scenario)
DEFAULT_JOB = "8b"


def _geo(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _notice(n: float) -> str:
    return "none" if n == 0 else f"{n:g} s"


def job_of(run: dict) -> str:
    """The run's job class (:data:`DEFAULT_JOB` when the run has no ``job`` field)."""
    return run.get("job", DEFAULT_JOB)


def tables(runs: list[dict]) -> str:
    """Markdown tables (module docstring) from bench_admission's ``runs``."""
    jobs = list(dict.fromkeys(job_of(r) for r in runs))
    out = [overview(runs), ""]
    for j in jobs:
        out += [f"**{j}**", "", job_tables([r for r in runs if job_of(r) == j]), ""]
    return "\n".join(out).rstrip("\n")


def overview(runs: list[dict]) -> str:
    """One row per (job class, notice), and per notice over all job classes when there are several:
    runs compared (those where Nereus and static both made tokens), runs without tokens for either,
    Nereus / policy geometric means over the runs where both made tokens, Nereus / static minimum
    and the runs below 0.98x static."""
    thr = {(job_of(r), r["trace"], r["seed"], r["notice"], r["policy"]): r["tokens_per_s"] for r in runs}
    policies = [p for p in ("static", "elastic-oracle", "replan-all", "nereus-paper", "nereus-ema")
                if any(r["policy"] == p for r in runs)]
    out = ["| job | notice | runs | no tokens | " + " | ".join(f"vs {p}" for p in policies)
           + " | min vs static | runs < 0.98x static |", "|---" * (len(policies) + 6) + "|"]
    jobs = list(dict.fromkeys(job_of(r) for r in runs))
    notices = sorted({r["notice"] for r in runs})
    groups = [(j, n) for j in jobs for n in notices] + ([("all", n) for n in notices] if len(jobs) > 1 else [])
    for j, n in groups:
        keys = sorted({k[:3] for k in thr if (j == "all" or k[0] == j) and k[3] == n and k[4] == "nereus"})
        if not keys:
            continue
        cells, st = [], []
        for p in policies:
            rs = [thr[(*k, n, "nereus")] / thr[(*k, n, p)] for k in keys
                  if thr.get((*k, n, p), 0) > 0 and thr[(*k, n, "nereus")] > 0]
            cells.append(f"{_geo(rs):.3f}" if rs else "-")
            if p == "static":
                st = rs
        none = sum(thr[(*k, n, "nereus")] <= 0 and thr.get((*k, n, "static"), 0) <= 0 for k in keys)
        low = f"{min(st):.3f}" if st else "-"
        out.append(f"| {j} | {_notice(n)} | {len(st)} | {none} | " + " | ".join(cells)
                   + f" | {low} | {sum(x < 0.98 for x in st) if st else '-'} |")
    return "\n".join(out)


def job_tables(runs: list[dict]) -> str:
    """The tables of one job class (module docstring)."""
    thr = {(r["trace"], r["seed"], r["notice"], r["policy"]): r for r in runs}
    notices = sorted({r["notice"] for r in runs})
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    policies = [p for p in ORDER if any(r["policy"] == p for r in runs)]
    out = []

    def ratio(t, s, n, p):
        a, b = thr.get((t, s, n, "nereus")), thr.get((t, s, n, p))
        if a is None or b is None or b["tokens_per_s"] <= 0:
            return None
        return a["tokens_per_s"] / b["tokens_per_s"]

    nruns = len(traces) * len(seeds)
    out.append(f"Nereus / policy, geometric mean over the runs of {nruns} where both made tokens (range); runs Nereus won / lost / tied "
               f"(within {TIE:.1%}):\n")
    out.append("| notice | " + " | ".join(f"vs {p}" for p in policies) + " |")
    out.append("|---" * (len(policies) + 1) + "|")
    for n in notices:
        cells = []
        for p in policies:
            rs = [x for t in traces for s in seeds if (x := ratio(t, s, n, p)) is not None]
            if not rs:
                cells.append("")
                continue
            w = sum(x > 1 + TIE for x in rs)
            ll = sum(x < 1 - TIE for x in rs)
            cells.append(f"{_geo(rs):.3f} ({min(rs):.2f}–{max(rs):.2f}); {w} / {ll} / {len(rs) - w - ll}")
        out.append(f"| {_notice(n)} | " + " | ".join(cells) + " |")

    allp = ["nereus", *policies]
    out.append("")
    out.append(f"| notice | restarts: {' / '.join(allp)} | transitions, n (s): nereus / replan-all / uncalibrated |")
    out.append("|---|---|---|")
    for n in notices:
        rs = [sum(r["restarts"] for r in runs if r["notice"] == n and r["policy"] == p) for p in allp]
        tr = []
        for p in ("nereus", "replan-all", "uncalibrated"):
            sel = [r for r in runs if r["notice"] == n and r["policy"] == p]
            tr.append(f"{sum(r['transitions'] for r in sel)} ({sum(r['transition_s'] for r in sel):,.0f})" if sel else "-")
        out.append(f"| {_notice(n)} | {' / '.join(map(str, rs))} | {' / '.join(tr)} |")

    cols = [p for p in PER_TRACE if p in policies]
    out.append("")
    out.append(f"Per trace (geometric mean over seeds {seeds[0]}–{seeds[-1]} of Nereus / policy):\n")
    head = " | ".join(f"notice {_notice(n)}: {' / '.join(cols)}" for n in notices)
    out.append(f"| trace | {head} |")
    out.append("|---" * (len(notices) + 1) + "|")
    for t in traces:
        cells = []
        for n in notices:
            vals = []
            for p in cols:
                rs = [x for s in seeds if (x := ratio(t, s, n, p)) is not None]
                vals.append(f"{_geo(rs):.2f}" if rs else "-")
            cells.append(" / ".join(vals))
        out.append(f"| {t} | " + " | ".join(cells) + " |")

    out.append("")
    out.append("| notice | restarts by cause: nereus | uncalibrated |")
    out.append("|---|---|---|")
    for n in notices:
        cells = []
        for p in ("nereus", "uncalibrated"):
            c: Counter = Counter()
            for r in runs:
                if r["notice"] == n and r["policy"] == p:
                    c.update(r.get("restart_causes", {}))
            cells.append(", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none")
        out.append(f"| {_notice(n)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__)
        return 2
    runs: dict = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["runs"]:
                runs[(job_of(r), r["trace"], r["seed"], r["notice"], r["policy"])] = r
    print(tables(list(runs.values())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
