"""Drive Nereus's controller API from a recorded step log, as a verl or OpenRLHF trainer would.

    python examples/controller_api_replay.py [--job examples/data/job.json] [--log examples/data/step_log.jsonl] [--json]

At every step boundary the trainer hands its measurements to ``NereusController.observe`` and gets a
decision back as data; on a transition it reads the target plan and the transition DAG (primitives
and their schedule) and applies them its own way. Prints one line per step (``--json``: the
decisions as JSON lines). Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nereus.controller.api import NereusController, read_step_log
from nereus.planner.notation import format_plan
from nereus.spec.job import JobSpec

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default=str(HERE / "data" / "job.json"))
    p.add_argument("--log", default=str(HERE / "data" / "step_log.jsonl"))
    p.add_argument("--json", action="store_true", help="print each decision as a JSON line")
    a = p.parse_args(argv)
    job = JobSpec.from_file(a.job)
    ctl = NereusController.for_job(job)
    if not a.json:
        print(f"initial plan (L_step {ctl.plan.l_step:.1f} s):\n{format_plan(ctl.plan, unit='GPUs', indent='  ')}")
    for rec in read_step_log(a.log):
        d = ctl.observe_record(rec)
        if a.json:
            print(json.dumps(d))
            continue
        line = f"step {d['step']:>2}: {d['kind']:<10} {d['reason'][:110]}"
        if d["kind"] == "transition":
            tr = d["transition"]
            kinds: dict = {}
            for n in tr["dag"]["nodes"]:
                kinds[n["kind"]] = kinds.get(n["kind"], 0) + 1
            line += (f"\n          target L_step {d['plan']['l_step']:.1f} s; DAG {len(tr['dag']['nodes'])} primitives "
                     f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), {len(tr['dag']['edges'])} edges, "
                     f"L_tran {tr['l_tran_s']:.1f} s\n{format_plan(ctl.plan, unit='GPUs', indent='          ')}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
