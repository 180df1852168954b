"""Checks of the names in a composed verl config against the installed verl: keys a ``+key=value``
adds that verl does not have, the installed key closest to a mistyped one (:func:`unknown_added`,
:func:`_close_key`), and rollout engine names (:func:`check_rollout_names`). Used by
:mod:`nereus.integrations.verl_config`."""

from __future__ import annotations

__all__ = ["unknown_added", "rollout_names", "check_rollout_names"]


def _close_key(key: str, keys) -> str | None:
    """The installed key closest to a mistyped ``key``, or None: :func:`difflib.get_close_matches` over
    the whole dotted keys (ratio >= 0.85), kept only where the last names are close too (ratio >= 0.75:
    ``rollout.zzzz`` is no typo of ``rollout.n`` however long the common section)."""
    import difflib

    last = key.rpartition(".")[2]
    for got in difflib.get_close_matches(key, sorted(keys), n=5, cutoff=0.85):
        if difflib.SequenceMatcher(None, last, got.rpartition(".")[2]).ratio() >= 0.75:
            return got
    return None


def _free_form(key: str) -> bool:
    """A key inside one of verl's free-form dicts (``override_transformer_config``, ``override_ddp_config``,
    ``engine_kwargs``...): any key may be added there."""
    return any(p.startswith("override_") or p.endswith("kwargs") for p in key.split(".")[:-1])


def unknown_added(overrides, keys) -> list[tuple[str, str | None]]:
    """``(key, closest installed key or None)`` of each ``+key=value`` / ``++key=value`` that adds a key
    the installed verl's config does not have outside its free-form dicts: Hydra adds it and verl's code
    never reads it (a typo, or a key of another release)."""
    out = []
    for ov in overrides:
        if not ov.startswith("+"):
            continue
        key = ov.partition("=")[0].lstrip("+")
        if key not in keys and not _free_form(key) and not any(k.startswith(key + ".") for k in keys):
            out.append((key, _close_key(key, keys)))
    return out


def _verl_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def rollout_names(config_dir=None) -> tuple[str, ...]:
    """The rollout engines the installed verl can build: the names of ``_ROLLOUT_REGISTRY`` in its
    ``verl/workers/rollout/base.py`` (verl 0.9.1: vllm, sglang, trtllm; ``hf`` is gone though its
    rollout.yaml comment still names it), read from the source without importing it. ``config_dir``:
    the installed ``verl/trainer/config`` (None: verl's own names of 0.9.1)."""
    import re

    d = config_dir
    src = d.parent.parent / "workers" / "rollout" / "base.py" if d is not None else None
    if src is None or not src.is_file():
        return ("vllm", "sglang", "trtllm")
    body = src.read_text().partition("_ROLLOUT_REGISTRY = {")[2].partition("}")[0]
    return tuple(dict.fromkeys(re.findall(r'\(\s*"(\w+)"\s*,', body))) or ("vllm", "sglang", "trtllm")


def check_rollout_names(cfg: dict, valid) -> None:
    """Refuse a rollout ``name`` the installed verl has no engine for (``actor_rollout_ref.rollout.name``,
    ``reward.reward_model.rollout.name``).

    Raises:
        ValueError: names the key, the value and the ``valid`` names (:func:`rollout_names`).
    """
    for key in ("actor_rollout_ref.rollout.name", "reward.reward_model.rollout.name"):
        cur = cfg
        for part in key.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur not in (None, "???") and cur not in valid:  # "???": left unset (a mandatory value)
            raise ValueError(f"verl key {key}={cur!r}: verl {_verl_version()} has no such rollout engine "
                             f"(valid: {', '.join(valid)})")
