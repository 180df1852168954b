"""verl configurations as dicts: locate verl's own config folder, compose ``ppo_trainer`` or
``ppo_megatron_trainer`` with Hydra-style overrides (:func:`load_verl_config`), and read dotted keys
while remembering which were read (:class:`VerlConfig`, used by :mod:`nereus.integrations.verl`'s import).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

__all__ = ["verl_config_dir", "load_verl_config", "VerlConfig"]

_MISSING = object()

def verl_config_dir() -> Path | None:
    """``verl/trainer/config`` of the installed verl package, or None when verl is not installed."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        return None
    d = Path(spec.origin).parent / "trainer" / "config"
    return d if d.is_dir() else None


def _parse_override(ov: str) -> tuple[str, object]:
    key, sep, val = ov.partition("=")
    if not sep or not key.lstrip("+"):
        raise ValueError(f"verl override {ov!r} must look like key=value (e.g. trainer.nnodes=2)")
    return key.lstrip("+"), yaml.safe_load(val) if val != "" else None


def _set(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"verl override {key}={value!r}: {p!r} is not a section")
    d[parts[-1]] = value


def _compose(config_dir: Path, name: str, overrides: list[str]) -> dict:
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf
    except ImportError as e:
        raise ValueError(f"verl config {name!r} uses Hydra defaults; install hydra-core (or verl) to read it") from e
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            cfg = compose(config_name=name, overrides=list(overrides))
    except Exception as e:  # hydra's errors name the override and the key
        raise ValueError(f"verl config {name!r}: {' '.join(str(e).split())}"[:500]) from e
    finally:
        GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def load_verl_config(config: str, overrides=()) -> dict:
    """A verl trainer configuration as a nested dict, with Hydra-style ``key=value`` overrides.

    ``config`` is a YAML file, or the name of a config of the installed verl (``ppo_trainer``,
    ``ppo_megatron_trainer``). A file with a Hydra ``defaults`` list (verl's own layout) is composed
    by Hydra from its directory; a plain file gets the overrides merged by OmegaConf in struct
    mode, so an override of a key the file does not have is refused (``+key=value`` adds one).

    Raises:
        ValueError: missing file, malformed YAML, or an override naming an unknown key.
    """
    overrides = [str(o) for o in overrides]
    p = Path(config)
    vdir = verl_config_dir()
    if not p.exists() and p.suffix == "" and vdir is not None and (vdir / f"{config}.yaml").is_file():
        return _compose(vdir, config, overrides)
    if not p.is_file():
        hint = " (verl is not installed, so verl's own config names are not available)" if vdir is None else \
            " or a config name of the installed verl (ppo_trainer, ppo_megatron_trainer)"
        raise ValueError(f"--from-verl {config!r}: no such file; give a verl trainer YAML{hint}")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"verl config {str(p)!r} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"verl config {str(p)!r} must be a mapping of sections, got {type(doc).__name__}")
    if "defaults" in doc:
        return _compose(p.parent, p.stem, overrides)
    try:
        from omegaconf import OmegaConf
    except ImportError:
        for ov in overrides:
            _set(doc, *_parse_override(ov))
        return doc
    cfg = OmegaConf.create(doc)
    OmegaConf.set_struct(cfg, True)
    for ov in overrides:
        key, val = _parse_override(ov)
        try:
            if ov.startswith("+"):
                with __import__("omegaconf").open_dict(cfg):
                    OmegaConf.update(cfg, key, val, force_add=True)
            else:
                OmegaConf.update(cfg, key, val)
        except Exception as e:
            raise ValueError(f"verl override {ov!r}: {str(p)!r} has no key {key!r} (use +{key}=... to add one)") from e
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


class VerlConfig:
    """Reads dotted keys of a nested dict and remembers what was read."""

    def __init__(self, d: dict):
        self.d, self.read = d, {}

    def get(self, key: str, default=_MISSING):
        cur = self.d
        for part in key.split("."):
            if not isinstance(cur, dict) or part not in cur:
                if default is _MISSING:
                    raise ValueError(f"verl config has no key {key!r} (Nereus needs it; docs/integrations.md)")
                return default
            cur = cur[part]
        if cur == "???":
            cur = default if default is not _MISSING else None
        self.read[key] = cur
        return cur

    def int(self, key: str, default=_MISSING, low: int = 1):
        v = self.get(key, default)
        if v is None and default is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"verl key {key}={v!r}: must be an integer >= {low}")
        return v
