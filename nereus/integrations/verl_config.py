"""verl configurations as dicts: locate verl's own config folder, compose ``ppo_trainer`` or
``ppo_megatron_trainer`` with Hydra-style overrides (:func:`load_verl_config`), and read dotted keys
while remembering which were read (:class:`VerlConfig`, used by :mod:`nereus.integrations.verl`'s import).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from nereus.integrations.verl_legacy import LegacyConfig, translate
from nereus.integrations.verl_names import (
    _close_key,
    _verl_version,
    check_rollout_names,
    rollout_names,
    unknown_added,
)

__all__ = ["verl_config_dir", "load_verl_config", "verl_launch", "VerlConfig"]

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


def _installed_keys(config_dir: Path, name: str) -> frozenset:
    """The dotted leaf keys of ``name`` as the installed verl composes it (no overrides)."""
    key = (str(config_dir.resolve()), name)
    if key not in _INSTALLED:
        _INSTALLED[key] = frozenset(_leaves(_compose_raw(config_dir, name, [])))
    return _INSTALLED[key]


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        yield from _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else (f"{prefix}{k}",)


_INSTALLED: dict = {}


def _compose(config_dir: Path, name: str, overrides: list[str]) -> LegacyConfig:
    """:func:`_compose_raw` after the legacy keys of ``overrides`` are read under the installed names
    (:func:`nereus.integrations.verl_legacy.translate`; the rewrites ride on the result's ``legacy``)."""
    keys = _installed_keys(config_dir, name)
    overrides, rewrites = translate(overrides, keys)
    cfg = LegacyConfig(_compose_raw(config_dir, name, overrides))
    cfg.legacy, cfg.overrides = tuple(rewrites), tuple(overrides)
    cfg.unknown = tuple(unknown_added(overrides, keys))
    check_rollout_names(cfg, rollout_names(verl_config_dir()))
    return cfg


def _compose_raw(config_dir: Path, name: str, overrides: list[str]) -> dict:
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf
    except ImportError as e:
        raise ValueError(f"verl config {name!r} uses Hydra defaults; install hydra-core (or verl) to read it") from e
    overrides = list(overrides)
    while True:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
                cfg = compose(config_name=name, overrides=overrides)
            break
        except Exception as e:  # hydra's errors name the override and the key
            redo = _append_to_existing(e, overrides)
            if redo is not None:
                overrides = redo
                continue
            ver = _verl_version()
            import re

            bad = re.search(r"Could not override '([^']+)'", str(e))
            close = _close_key(bad.group(1), _installed_keys(config_dir, name)) if bad and overrides else None
            if close is not None:  # a typo: the key verl has, not another release
                raise ValueError(f"verl config {name!r}: unknown key {bad.group(1)}; did you mean `{close}`?") from e
            hint = (f" (verl {ver}'s own launcher refuses this line too: it was written for another verl version)"
                    if "Could not override" in str(e) or "Key '" in str(e) else "")
            raise ValueError(f"verl config {name!r}: {' '.join(str(e).split())}"[:500] + hint) from e
        finally:
            GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def _append_to_existing(err: Exception, overrides: list[str]) -> list[str] | None:
    """Overrides with ``+key=value`` made ``++key=value`` where Hydra says the key already exists
    ("Could not append to config. An item is already at 'key'"): a line written for a verl release
    that did not have the key yet (TinyZero's ``+trainer.val_before_train=False`` for verl 0.1) sets
    it in a later release, which is what Hydra's ``++`` (add or override) does. None: another error."""
    import re

    m = re.search(r"An item is already at '([^']+)'", str(err))
    if m is None:
        return None
    key = m.group(1)
    out = [("+" + o) if o.startswith("+") and not o.startswith("++") and o[1:].partition("=")[0] == key else o
           for o in overrides]
    return out if out != overrides else None


_ENTRY = ("verl.trainer.main_ppo", "verl/trainer/main_ppo.py")
_SHELL_TAIL = ("$@", '"$@"', "${@}", "2>&1", "|", "&&", ";", "&")


def _expand(text: str, env: dict) -> str:
    """``$NAME``, ``${NAME}`` and ``${NAME:-default}`` replaced from ``env`` then the process environment
    (unknown names left as written)."""
    import os
    import re

    def sub(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        if name in env:
            return env[name]
        if name in os.environ:
            return os.environ[name]
        return default if default is not None else m.group(0)

    text = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", sub, text)
    return re.sub(r"\$\(\(([0-9+\-*/%() ]+)\)\)", _arith, text)


def _arith(m) -> str:
    """bash's integer ``$((...))`` of literal numbers (``+ - * / %``, parentheses): ``/`` truncates."""
    import ast

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if isinstance(n.op, (ast.Div, ast.Mod)) and b:
                q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
                return q if isinstance(n.op, ast.Div) else a - q * b
        raise ValueError
    try:
        return str(ev(ast.parse(m.group(1).strip(), mode="eval")))
    except (ValueError, SyntaxError):
        return m.group(0)


def _script_tokens(path: Path) -> list[str]:
    """The ``python3 -m verl.trainer.main_ppo ...`` command of a launch script as tokens: line
    continuations joined, simple ``NAME=value`` assignments (and ``export NAME=value``) expanded into
    the command, bash arrays (``NAME=(a b ...)`` over one or more lines, ``NAME+=(...)``) expanded
    where the command says ``"${NAME[@]}"`` (as verl's newer example scripts write their override
    groups), comments dropped.

    Raises:
        ValueError: no verl entry point in the script.
    """
    import re
    import shlex

    env: dict = {}
    arrays: dict[str, list[str]] = {}
    open_array: tuple[str, list[str]] | None = None
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if open_array is not None:  # inside NAME=( ... ) spanning lines
            body = "" if line.startswith("#") else _expand(line, env)
            body, closed = (body[: body.index(")")], True) if ")" in body else (body, False)
            open_array[1].extend(shlex.split(body, comments=True))
            if closed:
                arrays[open_array[0]] = open_array[1]
                open_array = None
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"(?:export\s+)?(\w+)(\+?)=\((.*)$", line)
        if m:
            name, add, rest = m.groups()
            items = arrays.get(name, []) if add else []
            if ")" in rest:
                arrays[name] = items + shlex.split(_expand(rest[: rest.rindex(")")], env), comments=True)
            else:
                open_array = (name, items + shlex.split(_expand(rest, env), comments=True))
            continue
        body = line[len("export "):] if line.startswith("export ") else line
        head, eq, _ = body.partition("=")
        if eq and head.isidentifier() and " " not in head:
            try:
                parts = shlex.split(_expand(body, env), comments=True)
            except ValueError:
                continue
            if len(parts) == 1:  # NAME=value alone on its line
                env[head] = parts[0].partition("=")[2]
                continue
        if any(e in line for e in _ENTRY):
            out: list[str] = []
            for t in shlex.split(_expand(line, env), comments=True):
                a = re.fullmatch(r"\$\{(\w+)\[[@*]\]\}", t)
                out.extend(arrays.get(a.group(1), []) if a else [t])
            return out
    raise ValueError(f"--from-verl {str(path)!r}: no `python3 -m verl.trainer.main_ppo ...` line in the script")


def verl_launch(tokens) -> tuple[str, list[str], str | None]:
    """``(config, overrides, config_path)`` of what a user pastes: a config name or YAML and its
    overrides, a whole launch line (``[ENV=..] python3 -m verl.trainer.main_ppo --config-path=P
    --config-name=N key=value ... $@``) or a launch script (``run_*.sh``). verl's ``main_ppo`` uses
    ``ppo_trainer`` when no ``--config-name`` is given. Hydra overrides may come in any order.

    Raises:
        ValueError: empty input, or an option verl's launcher does not take (named).
    """
    toks = [str(t) for t in tokens]
    if not any(t.strip() for t in toks):  # "" would otherwise plan verl's default config silently
        raise ValueError("--from-verl: empty; give a verl config (ppo_trainer, a YAML file, a launch script) "
                         "and its key=value overrides, or a whole `python3 -m verl.trainer.main_ppo ...` line")
    if toks[0].endswith(".sh"):  # a launch script, then overrides appended where it says $@ (later wins)
        p = Path(toks[0]).expanduser()
        if not p.is_file():
            raise ValueError(f"--from-verl {toks[0]!r}: no such launch script")
        script = _script_tokens(p)
        cut = next((i for i, t in enumerate(script) if t in ("|", "&&", ";", "&")), len(script))
        toks = script[:cut] + toks[1:]
    if len(toks) == 1 and " " in toks[0]:  # a whole line passed as one string
        import shlex

        toks = shlex.split(toks[0].replace("\\\n", " "))
    entry = next((i for i, t in enumerate(toks) if t in _ENTRY or t.endswith("main_ppo.py")), None)
    if entry is not None:
        toks = toks[entry + 1:]
        config = None
    elif any(t.startswith("--config-") for t in toks) and "=" in toks[0]:
        config = None
    else:
        config, toks = toks[0], toks[1:]
    overrides, path = [], None
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in _SHELL_TAIL:
            if t in ("|", "&&", ";", "&"):
                break
            i += 1
            continue
        for opt in ("--config-name", "--config-path", "-cn", "-cp"):
            if t == opt or t.startswith(opt + "="):
                val = t.split("=", 1)[1] if "=" in t else (toks[i + 1] if i + 1 < len(toks) else "")
                i += 1 if "=" in t else 2
                if opt in ("--config-name", "-cn"):
                    config = val
                else:
                    path = val
                break
        else:
            if t.startswith("-"):
                raise ValueError(f"--from-verl: {t!r} is not an option of verl's launcher (it takes --config-path, "
                                 "--config-name and key=value overrides)")
            overrides.append(t)
            i += 1
    config = config or "ppo_trainer"
    if config.endswith(".yaml") and not Path(config).is_file() and not (path and (Path(path) / config).is_file()):
        config = config[: -len(".yaml")]  # --config-name='ppo_megatron_trainer.yaml' names verl's own config
    return config, overrides, path


def load_verl_config(config: str, overrides=()) -> dict:
    """A verl trainer configuration as a nested dict, with Hydra-style ``key=value`` overrides.

    ``config`` is a YAML file, the name of a config of the installed verl (``ppo_trainer``,
    ``ppo_megatron_trainer``), a launch script, or the first token of a launch line
    (:func:`verl_launch` reads the rest: ``--config-path``/``--config-name``, overrides in any order). A file with a Hydra ``defaults`` list (verl's own layout) is composed
    by Hydra from its directory; a plain file gets the overrides merged by OmegaConf in struct
    mode, so an override of a key the file does not have is refused (``+key=value`` adds one).
    Composed with the installed verl's config, overrides that use an older verl's key names are read
    under the installed names first (:mod:`nereus.integrations.verl_legacy`; the result's ``legacy``
    lists each rewrite, for the import's notes); a plain file is taken as written.

    Raises:
        ValueError: missing file, malformed YAML, an override naming an unknown key, a legacy key that
            changes memory or time the installed verl cannot say, or a legacy key and its new name
            set to different values.
    """
    config, overrides, cpath = verl_launch([config, *overrides])
    p = Path(config)
    if cpath is not None and not p.exists():
        for cand in (Path(cpath) / config, Path(cpath) / f"{config}.yaml"):
            if cand.is_file():
                p = cand
                break
    config = str(p) if p.is_file() else config
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
    out = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    check_rollout_names(out, rollout_names(verl_config_dir()))
    return out


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
