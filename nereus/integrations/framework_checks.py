"""The frameworks' own configuration checks, run on a configuration Nereus reads or writes (an
export composes with them: docs/integrations.md).

* verl: ``verl.utils.config.validate_config``, what ``verl.trainer.main_ppo.main`` runs before it
  starts a worker (the batch sizes against the DP degree and micro-batches, the actor's and critic's
  dataclass ``validate``, the mutually exclusive micro-batch keys), with ``main_ppo``'s own
  ``need_reference_policy`` / ``need_critic``, on the configuration Hydra composes from the installed
  verl's ``trainer/config`` with the overrides (:func:`nereus.integrations.verl_config.load_verl_config`).
* OpenRLHF: ``openrlhf.cli.train_ppo_ray``'s own parser and the statements its ``__main__`` block runs
  between ``parse_args()`` and ``train(args)`` (``hierarchize`` and its argument checks: estimators
  that need several samples per prompt, packing only with vLLM, sleep against async, the sample
  batches against the actor processes), taken from the installed module's source as
  :func:`nereus.integrations.openrlhf.openrlhf_parser` takes the parser (``--use_ms``'s ModelScope hub
  patch and ``train`` itself are not run).

Both need the framework installed and raise ValueError with the framework's own message.
"""

from __future__ import annotations

import ast
import contextlib
import io
from pathlib import Path

from nereus.integrations.openrlhf import openrlhf_parser, openrlhf_source
from nereus.integrations.verl_config import load_verl_config

__all__ = ["verl_check", "openrlhf_check"]


def verl_check(config: str, overrides=()) -> None:
    """Run verl's ``validate_config`` on ``config`` (a config name, YAML file or launch line) with
    ``overrides``.

    Raises:
        ValueError: verl refuses the configuration (its message), or verl is not installed.
    """
    try:
        from omegaconf import OmegaConf
        from verl.trainer.main_ppo import need_critic, need_reference_policy
        from verl.utils.config import validate_config
    except ImportError as e:
        raise ValueError(f"verl's configuration checks need verl installed: {e}") from None
    cfg = OmegaConf.create(dict(load_verl_config(config, list(overrides))))  # OmegaConf takes plain dicts only
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints "All configuration checks passed"
            validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except (AssertionError, ValueError) as e:
        raise ValueError(f"verl's validate_config refuses the configuration: {e}") from None


def openrlhf_check(args, source: Path | None = None) -> None:
    """Parse ``args`` (a list of tokens) with OpenRLHF's ``train_ppo_ray`` parser and run its
    ``__main__`` block's checks between ``parse_args()`` and ``train(args)``.

    Raises:
        ValueError: OpenRLHF's parser or one of its checks refuses the arguments (its message), or
            OpenRLHF is not installed.
    """
    source = source or openrlhf_source()
    parser = openrlhf_parser(source)
    if parser is None:
        raise ValueError("OpenRLHF's argument checks need OpenRLHF installed")
    parsed = parser.parse_args(list(args))
    tree = ast.parse(Path(source).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    at = next(i for i, st in enumerate(main.body) if "parse_args" in ast.unparse(st))
    checks = [st for st in main.body[at + 1:] if not _runs_training(st)]
    ns: dict = {"args": parsed}
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its warnings print
            exec(compile(ast.Module(body=checks, type_ignores=[]), str(source), "exec"), ns)  # noqa: S102
    except AssertionError as e:
        raise ValueError(f"OpenRLHF's argument checks refuse the arguments: {e}") from None


def _runs_training(st: ast.stmt) -> bool:
    """The ``train(args)`` call and the ``--use_ms`` hub patch (side effects, not checks)."""
    text = ast.unparse(st)
    return (isinstance(st, ast.Expr) and text.startswith("train(")) or text.startswith("if args.use_ms")
