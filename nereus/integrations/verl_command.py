"""verl launch lines a user pastes into bash: each Hydra override quoted so bash hands it to verl's
``main_ppo`` as one unchanged argument (:func:`verl_command`; bash word splitting and pathname
expansion, the GNU Bash manual sections 3.5.7 and 3.5.8)."""

from __future__ import annotations

__all__ = ["shell_word", "verl_command"]


def shell_word(token: str) -> str:
    """``token`` as bash reads it back unchanged: as is when it has no character the shell treats
    specially; in double quotes when it has none of ``"$`\\!`` (Hydra's own quoted list elements,
    ``data.train_files=['/a b', '/c']``, stay readable); else :func:`shlex.quote`. bash splits words
    at spaces and expands ``[...]`` globs (``trainer.logger=["console","wandb"]`` unquoted)."""
    import shlex

    q = shlex.quote(token)
    if q == token:
        return token
    if not any(ch in token for ch in '"$`\\!'):
        return f'"{token}"'
    return q


def verl_command(config_name: str, overrides) -> str:
    """The ``python3 -m verl.trainer.main_ppo --config-name=NAME key=value ...`` line a user pastes
    into bash, one override per continued line, each quoted as :func:`shell_word` says."""
    lines = [f"python3 -m verl.trainer.main_ppo --config-name={shell_word(config_name)}"]
    lines += [f"    {shell_word(o)}" for o in overrides]
    return " \\\n".join(lines)
