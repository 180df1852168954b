"""The vLLM start-up memory rule of a verl or OpenRLHF version: framework version → the vLLM version it
pins → the rule of :mod:`nereus.cost.vllm_startup` (the workload's ``vllm_memory_rule``).

Pins (:data:`VLLM_PINS`), each with its source:

* verl 0.9.1: ``vllm==0.24.0`` (the wheel's METADATA, ``Requires-Dist: vllm==0.24.0; extra == "vllm"``).
* OpenRLHF 0.11.2: ``vllm==0.29.0`` (the wheel's METADATA, ``Requires-Dist: vllm==0.29.0; extra == "vllm"``).
* verl 0.1 as TinyZero ships it (Jiayi-Pan/TinyZero@95df88f ``verl/version/version`` = 0.1,
  ``requirements.txt`` ``vllm<=0.6.3``): vLLM 0.6.3 run through verl's patched worker
  ``verl/third_party/vllm/vllm_v_0_6_3/worker.py``, hence ``free_share`` whatever upstream 0.6.3 does.

Releases between (:data:`PIN_HISTORY`, change points: a version takes the pin of the latest listed
release at or before it):

* OpenRLHF: ``extras_require["vllm"]`` of ``setup.py`` at each release tag of OpenRLHF/OpenRLHF
  (v0.5.0 ``vllm==0.4.2`` ... v0.5.8 ``0.7.2``, v0.6.3 ``0.8.1``, v0.6.4 ``0.8.2``, v0.7.0 ``0.8.3``,
  v0.7.5 ``0.8.5.post1``, v0.8.4 ``0.9.0.1``, v0.8.5 ``0.9.1`` ... v0.11.0 ``0.27.1``).
* verl: ``VLLM_REQUIRES`` of ``setup.py`` at each release tag of volcengine/verl is a range
  (v0.3.0.post0 ``vllm<=0.8.2``, v0.4.0 and v0.5.0 ``<=0.8.5``, v0.6.0 ``<=0.9.1``, v0.6.1
  ``<=0.11.0``, v0.7.0 ``<=0.12.0``): pip installs its upper bound, which is taken as the pin.

An installed verl or OpenRLHF not in the table is read from its own metadata (``importlib.metadata``:
the ``vllm==X`` requirement of its ``vllm`` extra). vLLM version → rule (:func:`vllm_rule_for`, the
sources in :mod:`nereus.cost.vllm_startup`): >= 0.9.1 ``startup_check`` (the start-up check appeared
in 0.9.1: vLLM issue 20305, llm-compressor PR 1560); 0.8.0 up to 0.9.1 ``device_total`` (V1's
``determine_available_memory`` at vllm-project/vllm@0012cf69); older upstream versions have no
sourced rule here (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

__all__ = ["VllmPin", "VLLM_PINS", "PIN_HISTORY", "vllm_rule_for", "vllm_pin", "installed_version", "version_rule", "version_key"]

FRAMEWORKS = ("verl", "openrlhf")


@dataclass(frozen=True)
class VllmPin:
    """A framework version's vLLM and the start-up rule it implies.

    Attributes:
        framework: ``verl`` or ``openrlhf``.
        version: the framework's version.
        vllm: the vLLM version it pins (``"0.24.0"``).
        rule: the workload's ``vllm_memory_rule`` (None: no sourced rule for that vLLM).
        source: where the pin comes from.
    """

    framework: str
    version: str
    vllm: str
    rule: str | None
    source: str


VLLM_PINS = {
    ("verl", "0.9.1"): VllmPin("verl", "0.9.1", "0.24.0", "startup_check",
                               "verl 0.9.1 wheel METADATA: Requires-Dist vllm==0.24.0; extra == 'vllm'"),
    ("openrlhf", "0.11.2"): VllmPin("openrlhf", "0.11.2", "0.29.0", "startup_check",
                                    "openrlhf 0.11.2 wheel METADATA: Requires-Dist vllm==0.29.0; extra == 'vllm'"),
    ("verl", "0.1"): VllmPin("verl", "0.1", "0.6.3", "free_share",
                             "TinyZero's verl 0.1 (Jiayi-Pan/TinyZero@95df88f verl/version/version, requirements.txt "
                             "vllm<=0.6.3) runs verl/third_party/vllm/vllm_v_0_6_3/worker.py (KV = f x free memory)"),
}


#: framework -> ((first release, vLLM it pins), ...) in release order (module docstring's sources)
PIN_HISTORY = {
    "openrlhf": (("0.5.0", "0.4.2"), ("0.5.2.post1", "0.6.4.post1"), ("0.5.5", "0.6.5"), ("0.5.8", "0.7.2"),
                 ("0.6.3", "0.8.1"), ("0.6.4", "0.8.2"), ("0.7.0", "0.8.3"), ("0.7.5", "0.8.5.post1"),
                 ("0.8.4", "0.9.0.1"), ("0.8.5", "0.9.1"), ("0.8.6", "0.9.2"), ("0.8.8", "0.10.0"),
                 ("0.8.10", "0.10.1.1"), ("0.8.11", "0.10.2"), ("0.9.0", "0.11.0"), ("0.9.1", "0.13.0"),
                 ("0.9.3", "0.15.0"), ("0.9.4", "0.16.0"), ("0.9.5", "0.17.0"), ("0.9.6", "0.17.1"),
                 ("0.9.7", "0.18.0"), ("0.9.10", "0.19.0"), ("0.10.2", "0.19.1"), ("0.10.4", "0.22.1"),
                 ("0.11.0", "0.27.1")),
    "verl": (("0.3.0.post0", "0.8.2"), ("0.4.0", "0.8.5"), ("0.6.0", "0.9.1"), ("0.6.1", "0.11.0"),
             ("0.7.0", "0.12.0")),
}
_LAST_TAG = {"openrlhf": "0.11.0", "verl": "0.7.0"}  # releases after these: the table or installed metadata only


def _parse(v: str) -> tuple:
    m = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:\.?post(\d+))?", str(v))
    if not m:
        raise ValueError(f"version {v!r} is not a version number (e.g. '0.24.0')")
    return tuple(int(x or 0) for x in m.groups())


def version_key(version: str) -> tuple:
    """A release number as a comparable tuple (``"0.5.9.post1"`` -> ``(0, 5, 9, 1)``).

    Raises:
        ValueError: not a version number.
    """
    return _parse(version)


def _history_pin(framework: str, version: str) -> VllmPin | None:
    v = _parse(version)
    hist = PIN_HISTORY[framework]
    if v < _parse(hist[0][0]) or v > _parse(_LAST_TAG[framework]) + (99,):
        return None
    first, vllm = [h for h in hist if _parse(h[0]) <= v][-1]
    repo = {"openrlhf": "OpenRLHF/OpenRLHF", "verl": "volcengine/verl"}[framework]
    what = "extras_require['vllm']" if framework == "openrlhf" else "VLLM_REQUIRES (upper bound)"
    return VllmPin(framework, version, vllm, vllm_rule_for(vllm),
                   f"{repo}@v{first} setup.py {what}: vllm {vllm} (the pin of the latest release at or before {version})")


def vllm_rule_for(vllm: str) -> str | None:
    """The start-up rule of upstream vLLM ``vllm`` (module docstring); None where none is sourced.

    Raises:
        ValueError: ``vllm`` is not a version number.
    """
    v = _parse(vllm)
    if v >= (0, 9, 1):
        return "startup_check"
    if v >= (0, 8, 0):
        return "device_total"
    return None


def installed_version(framework: str) -> str | None:
    """The installed version of ``framework`` (None when it is not installed)."""
    try:
        return metadata.version(framework)
    except metadata.PackageNotFoundError:
        return None


def _installed_pin(framework: str, version: str) -> VllmPin | None:
    if installed_version(framework) != version:
        return None
    for req in metadata.requires(framework) or ():
        m = re.match(r"^vllm\s*==\s*([0-9][^;\s]*)\s*;.*extra\s*==\s*['\"]vllm['\"]", req)
        if m:
            return VllmPin(framework, version, m.group(1), vllm_rule_for(m.group(1)),
                           f"{framework} {version} installed metadata: Requires-Dist {req}")
    return None


def vllm_pin(framework: str, version: str | None = None) -> VllmPin | None:
    """The vLLM pin of ``framework`` at ``version`` (None: the installed version): the table, else the
    installed package's own metadata; None when neither knows the version.

    Raises:
        ValueError: an unknown framework.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    version = installed_version(framework) if version is None else str(version)
    if version is None:
        return None
    return VLLM_PINS.get((framework, version)) or _installed_pin(framework, version) or _history_pin(framework, version)


def version_rule(framework: str, version: str | None, notes: list) -> str | None:
    """The workload's ``vllm_memory_rule`` for ``framework`` at ``version`` (None: the installed one), as
    the importers set it: None for ``startup_check`` (the field's default), the pinned vLLM's rule
    otherwise, with a note in ``notes`` naming the pin and its source; when the version or its vLLM
    has no sourced rule, None (``startup_check``) with a note saying so.

    Raises:
        ValueError: an unknown framework.
    """
    pin = vllm_pin(framework, version)
    if pin is None:
        notes.append(f"{framework} {version or '(not installed)'}: its vLLM version is not in Nereus's table "
                     "(nereus/integrations/framework_versions.py): vLLM's start-up rule startup_check "
                     "(vLLM >= 0.9.1) assumed")
        return None
    if pin.rule is None:
        notes.append(f"{framework} {pin.version} pins vLLM {pin.vllm} ({pin.source}), whose start-up memory rule "
                     "is not sourced: startup_check (vLLM >= 0.9.1) assumed")
        return None
    if pin.rule != "startup_check":
        notes.append(f"{framework} {pin.version} runs vLLM {pin.vllm} ({pin.source}): vLLM memory rule {pin.rule}")
        return pin.rule
    return None
