"""A job: the models of an RL run, the cluster, and the workload; loadable from JSON or YAML.

The file format is documented in ``docs/files.md``; every malformed field raises a ValueError that
names the field, the value and what is valid.

The actor and reference share the actor's shapes; the critic and reward model use the same backbone
with a scalar value head unless given explicitly (the paper's setting: "the actor, reference, reward,
and (when present) critic models have equal size").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nereus.spec.framework import DEFAULT_FRAMEWORK, FrameworkSpec, get_framework
from nereus.spec.hardware import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.presets import get_model
from nereus.spec.workload import WorkloadSpec

__all__ = ["JobSpec", "check_context"]

MODEL_ROLES = ("actor", "critic", "reference", "reward")
#: sections of a job document (``docs/files.md``)
JOB_SECTIONS = ("model", "cluster", "workload", "framework")


@dataclass(frozen=True)
class JobSpec:
    """Models, cluster and workload of one RL job.

    Attributes:
        actor: the policy's shapes.
        cluster: nodes x GPUs and their links.
        workload: algorithm, batches, lengths.
        models: optional overrides per role (``critic``, ``reference``, ``reward``).
        framework: what the user's framework supports (ZeRO, SP, interleaving, offload,
            colocation; :mod:`nereus.spec.framework`); default ``nereus`` (the paper's space); a job
            file without a ``framework`` section and the commands use ``runtime``
            (:data:`~nereus.spec.framework.DEFAULT_FRAMEWORK`), what the Nereus runtime executes.
    """

    actor: ModelSpec
    cluster: ClusterSpec
    workload: WorkloadSpec
    models: dict = field(default_factory=dict, compare=False)
    framework: FrameworkSpec = field(default_factory=FrameworkSpec)

    def __post_init__(self) -> None:
        if not isinstance(self.framework, FrameworkSpec):
            raise ValueError(f"job field 'framework' must be a FrameworkSpec, got {self.framework!r}")
        unknown = sorted(set(self.models) - set(MODEL_ROLES))
        if unknown:
            raise ValueError(f"unknown model role(s) {unknown}; valid roles: {list(MODEL_ROLES)}")

    def model(self, role: str) -> ModelSpec:
        """Shapes of the model playing ``role``.

        Raises:
            ValueError: unknown role.
        """
        if role not in MODEL_ROLES:
            raise ValueError(f"unknown model role {role!r}; valid roles: {list(MODEL_ROLES)}")
        if role in self.models:
            return self.models[role]
        if role in ("actor", "reference"):
            return self.actor
        return self.actor.value_head()

    def with_workload(self, workload: WorkloadSpec) -> JobSpec:
        return JobSpec(actor=self.actor, cluster=self.cluster, workload=workload, models=self.models,
                       framework=self.framework)

    def with_framework(self, framework: FrameworkSpec) -> JobSpec:
        return JobSpec(actor=self.actor, cluster=self.cluster, workload=self.workload, models=self.models,
                       framework=framework)

    def to_dict(self) -> dict:
        d = {
            "model": self.actor.to_hf_config() | {"name": self.actor.name},
            "cluster": self.cluster.to_dict(),
            "workload": self.workload.to_dict(),
        }
        if self.framework != get_framework(DEFAULT_FRAMEWORK):  # from_dict's default when absent
            d["framework"] = self.framework.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> JobSpec:
        """Build from ``{"model": preset-name | config dict, "cluster": {...}, "workload": {...}}``.

        Raises:
            ValueError: a missing section or a malformed field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a job must be a mapping with sections {list(JOB_SECTIONS)}, got {d!r}")
        if "job" in d and ("plan" in d or "feasible" in d):  # the output of `nereus plan --json`
            d = d["job"]
            if not isinstance(d, dict):
                raise ValueError(f"the plan document's 'job' must be a mapping, got {d!r}")
        unknown = sorted(str(k) for k in set(d) - set(JOB_SECTIONS))
        if unknown:
            raise ValueError(f"unknown job section(s) {unknown}; valid: {list(JOB_SECTIONS)}")
        for k in ("model", "cluster"):
            if k not in d:
                raise ValueError(f"job spec is missing section {k!r} (sections: {list(JOB_SECTIONS)}; "
                                 "docs/files.md)")
        m = d["model"]
        if isinstance(m, str):
            actor = get_model(m)
        elif isinstance(m, dict):
            name = m.get("name", "custom")
            if not isinstance(name, str):
                raise ValueError(f"model field 'name' must be a string, got {name!r}")
            actor = ModelSpec.from_hf_config({k: v for k, v in m.items() if k != "name"}, name=name)
        else:
            raise ValueError(f"job section 'model' must be a preset name or a mapping of config.json fields, "
                             f"got {m!r}")
        return cls(actor=actor, cluster=ClusterSpec.from_dict(d["cluster"]),
                   workload=WorkloadSpec.from_dict(d.get("workload", {})),
                   framework=FrameworkSpec.from_dict(d.get("framework", DEFAULT_FRAMEWORK)))

    @classmethod
    def from_file(cls, path: str | Path) -> JobSpec:
        """Load a job from a ``.json`` or ``.yaml`` file.

        The output of ``nereus plan --json`` is accepted too (it carries its job under ``"job"``).

        Raises:
            ValueError: missing file or a malformed document.
        """
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"job file {str(p)!r} does not exist")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"job file {str(p)!r} cannot be read as text: {e}") from e
        if p.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"job file {str(p)!r} is not valid YAML: {e}") from e
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"job file {str(p)!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"job file {str(p)!r} must hold a mapping")
        return cls.from_dict(data)


def check_context(job: JobSpec, what: str = "--prompt-len + --response-len-max") -> JobSpec:
    """``job`` when its longest sequence fits the actor's context, else ValueError.

    The longest sequence is ``prompt_len + response_len_max`` (or the mean response when no maximum is
    set: ``WorkloadSpec.memory_seq_len``); the context is the model config's
    ``max_position_embeddings`` (a model generates and trains past it only with RoPE scaling the
    config would declare; vLLM refuses ``max_model_len`` above it).

    Raises:
        ValueError: naming the lengths, the model and its context.
    """
    w, ctx = job.workload, job.actor.max_position_embeddings
    if w.memory_seq_len > ctx:
        raise ValueError(f"{what} = {w.prompt_len} + {w.memory_response_len} = {w.memory_seq_len} tokens exceeds "
                         f"{job.actor.name}'s context (max_position_embeddings={ctx}); valid: a prompt plus response "
                         f"of at most {ctx} tokens")
    return job
