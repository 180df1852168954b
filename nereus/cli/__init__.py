"""The ``nereus`` command: one sub-command per module.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``
(exit status); this file only wires them, so decision code and runtime code stay importable apart.

Bad input never ends in a traceback: argparse errors and the ``ValueError``/``FileNotFoundError``
that input validation raises (``docs/files.md``) print one line, ``nereus <command>: error: ...``,
on stderr and exit with status 2. Ctrl-C and SIGTERM print one line too (exit status 130 and 143,
the shell's 128 + signal number) after the command's own clean-up ran.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading

#: sub-command → (module, one-line help)
COMMANDS = {
    "plan": ("nereus.cli.plan", "fastest feasible plan for a job on a GPU pool"),
    "simulate": ("nereus.cli.simulate", "trace-driven simulation of adaptive vs static policies"),
    "transition": ("nereus.cli.transition", "transition DAG and schedule between two plans"),
    "run": ("nereus.cli.run", "RL steps on local Ray workers (fixed layouts, or --adaptive: the controller plans and replans)"),
}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so every ``finally`` (workers, checkpoints) runs."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _on_sigterm():
    """SIGTERM raises :class:`Terminated` (main thread only); returns the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``nereus plan: error: ... (nereus plan --help lists the options)``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` (options whose default comes from elsewhere say so)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix such as ``--gpus`` must not silently mean ``--gpus-per-node``
    parser = _Parser(
        prog="nereus", description="Adaptive parallelism for LLM RL post-training (PPO, GRPO, ReMax).",
        allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # sub-command not built yet, or its optional dependencies are absent
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0],
                           formatter_class=_HelpFormatter, allow_abbrev=False)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def _verl_entry(argv: list[str]) -> list[str]:
    """``argv`` with verl's entry point put after ``--from-verl`` when a launcher option comes first
    (``--from-verl --config-name=ppo_megatron_trainer ...``): argparse would take the option for one of
    its own and give --from-verl no value; verl's launch line reads the same with its module named."""
    out = list(argv)
    for i, t in enumerate(out[:-1]):
        if t == "--from-verl" and out[i + 1].partition("=")[0] in ("--config-name", "--config-path", "-cn", "-cp"):
            out.insert(i + 1, "verl.trainer.main_ppo")
            break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_verl_entry(sys.argv[1:] if argv is None else list(argv)))
    if extra and getattr(args, "from_verl", None):  # a pasted verl launch line: its tokens, in order
        args.from_verl, extra = args.from_verl + extra, []
    if extra:  # name the sub-command whose --help lists the valid options
        where = f"{parser.prog} {args.command}" if getattr(args, "command", None) else parser.prog
        parser.exit(2, f"{where}: error: unrecognized arguments: {' '.join(extra)} ({where} --help lists the "
                       f"options)\n")
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    previous = _on_sigterm()
    try:
        return int(args._module.main(args) or 0)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM: the run's own clean-up ran; one line, no traceback
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)"
        print(f"nereus {args.command}: {what}; the workers were stopped", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except SystemExit as e:  # Ray's own SIGTERM handler (installed by ray.init) exits with the signal number
        if e.code == signal.SIGTERM:
            print(f"nereus {args.command}: terminated (SIGTERM); the workers were stopped", file=sys.stderr)
            return 143
        raise
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, exit status 2
        msg = "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        print(f"nereus {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`: stop quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

