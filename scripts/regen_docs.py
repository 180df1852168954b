#!/usr/bin/env python3
"""Regenerate (or check) the sample outputs in docs/*.md by running their commands.

A sample is a marked block in a Markdown file::

    <!-- sample: nereus plan --nodes 2 -->
    ```
    $ nereus plan --nodes 2
    ...output...
    ```
    <!-- /sample -->

The text after ``sample:`` is a bash command line run in a fresh temporary directory (so commands
may write files for the next ones: ``nereus plan --json > a.json && ...``), with ``nereus`` bound
to this checkout (``python -m nereus.cli``) and ``COLUMNS=120`` so tables have one width. The block
shows the command after ``$ `` and its stdout and stderr. Run-dependent text is normalized: progress
bars are dropped and a wall time ``(12 s)`` at the end of a line prints as ``(N s)``.

A sample of a run on real workers (``<!-- sample (measured): CMD -->``) prints measured seconds, and
its plan decisions follow from them (the controller calibrates on the matmul speed it measures), so no
two runs print the same text. It is regenerated like the others; ``--check`` runs it and requires exit
status 0 and the same first line with every number masked (the run's headline: model, algorithm,
workers), and says that the rest was not compared.

Usage::

    python scripts/regen_docs.py            # rewrite every sample in docs/
    python scripts/regen_docs.py --check    # exit 1 and list the samples that differ
    python scripts/regen_docs.py --only plan,transition docs/planner.md
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"<!-- sample(?P<measured> \(measured\))?: (?P<cmd>.+?) -->\n```\n(?P<body>.*?)```\n<!-- /sample -->", re.S)
NUMBER = re.compile(r"\d+(\.\d+)?")
PROGRESS = re.compile(r"^\s*\S+ ━+ +\d+% +\d+:\d\d:\d\d\s*$")
WALL = re.compile(r"\(\d+ s\)$")


def run_sample(cmd: str, timeout: float = 600.0, status: list | None = None) -> str:
    """The block body for ``cmd``: ``$ cmd`` then its normalized output (``status`` gets the exit code)."""
    env = dict(os.environ, COLUMNS="120", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TERM="dumb")
    env.pop("FORCE_COLOR", None)
    script = f'nereus() {{ "{sys.executable}" -m nereus.cli "$@"; }}\n{cmd}\n'
    with tempfile.TemporaryDirectory() as d:
        res = subprocess.run(["bash", "-c", script], cwd=d, env=env, capture_output=True, text=True,
                             timeout=timeout)
    out = res.stdout + res.stderr
    if status is not None:
        status.append(res.returncode)
    lines = [WALL.sub("(N s)", ln.rstrip()) for ln in out.splitlines() if not PROGRESS.match(ln)]
    return f"$ {cmd}\n" + "\n".join(lines).rstrip("\n") + "\n"


def samples(path: Path) -> list[tuple[str, str]]:
    """``(command, current body)`` of every sample block in ``path``."""
    return [(m["cmd"], m["body"]) for m in BLOCK.finditer(path.read_text())]


def _headline(body: str) -> str:
    lines = body.splitlines()
    return NUMBER.sub("N", lines[1]) if len(lines) > 1 else ""


def selected(cmd: str, only: list[str] | None) -> bool:
    if not only:
        return True
    words = re.findall(r"nereus (\w+)", cmd)
    return any(w in only for w in words[-1:])


def regen(paths: list[Path], only: list[str] | None = None, check: bool = False) -> list[str]:
    """Rewrite (or with ``check`` compare) the selected samples; returns ``path: command`` of those
    that differed."""
    differ = []
    for p in paths:
        text = p.read_text()

        def fill(m: re.Match, p: Path = p) -> str:
            if not selected(m["cmd"], only):
                return m.group(0)
            status: list = []
            body = run_sample(m["cmd"], status=status)
            tag = "sample (measured)" if m["measured"] else "sample"
            if m["measured"]:
                if status[0] != 0 or _headline(body) != _headline(m["body"]):
                    differ.append(f"{p.relative_to(ROOT)}: {m['cmd']} (measured: exit {status[0]}, headline "
                                  f"{_headline(body)!r})")
                elif check:
                    print(f"ran: {p.relative_to(ROOT)}: {m['cmd']} (measured: exit 0, same headline; the rest "
                          f"is not compared)")
            elif body != m["body"]:
                differ.append(f"{p.relative_to(ROOT)}: {m['cmd']}")
            return f"<!-- {tag}: {m['cmd']} -->\n```\n{body}```\n<!-- /sample -->"

        new = BLOCK.sub(fill, text)
        if not check and new != text:
            p.write_text(new)
    return differ


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files [docs/*.md]")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when a sample differs")
    ap.add_argument("--only", default="", help="comma-separated sub-commands to run (plan, transition, simulate)")
    a = ap.parse_args(argv)
    only = [x.strip() for x in a.only.split(",") if x.strip()] or None
    differ = regen([p.resolve() for p in a.files] or DOCS, only, a.check)
    for d in differ:
        print(("differs: " if a.check else "updated: ") + d)
    return 1 if (a.check and differ) else 0


if __name__ == "__main__":
    sys.exit(main())
