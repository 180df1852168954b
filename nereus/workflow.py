"""RL algorithms as model-stages, the order of stages, and the per-step weight sync (DESIGN.md §4.1).

A *model-stage* is a (model, stage) pair named ``"<model>.<stage>"``. Model-stages of one stage run
concurrently on disjoint GPUs; stages run one after another (synchronous) and may share GPUs.

* PPO: ``actor.generate`` → {``actor.infer`` (old log-probs), ``reference.infer``, ``critic.infer``
  (values), ``reward.infer``} → {``actor.train``, ``critic.train``} → weight sync
  ``actor.train`` → ``actor.generate``.
* GRPO: no critic; group-normalized advantages; KL to the reference in the loss.
* ReMax: no critic; one greedy rollout per prompt (the baseline) inside generation.

``reward.infer`` is a model-stage only when the job uses a reward model; a rule-based reward runs on
the CPU. ``reference.infer`` is one only when the job has a KL term (``WorkloadSpec.reference_model``). Asynchronous execution (one step off-policy) overlaps ``actor.generate`` of step k+1 with the
inference and training of step k, so generation needs GPUs of its own; its critical path spans the
interval between two weight synchronizations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.spec.workload import WorkloadSpec

__all__ = ["STAGES", "ModelStage", "Workflow", "workflow_for"]

STAGES = ("generate", "infer", "train")
STAGE_RANK = {s: i for i, s in enumerate(STAGES)}


@dataclass(frozen=True, order=True)
class ModelStage:
    """A (model, stage) pair, e.g. ``ModelStage("actor", "train")`` named ``actor.train``.

    Raises:
        ValueError: unknown stage or empty model name.
    """

    model: str
    stage: str

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if not self.model:
            raise ValueError("model name of a model-stage must not be empty")

    @property
    def name(self) -> str:
        return f"{self.model}.{self.stage}"

    @classmethod
    def parse(cls, name: str) -> ModelStage:
        """Parse ``"actor.train"``.

        Raises:
            ValueError: not of the form ``<model>.<stage>``.
        """
        model, _, stage = name.partition(".")
        if not stage:
            raise ValueError(f"model-stage name must look like 'actor.train', got {name!r}")
        return cls(model, stage)

    @property
    def trainable(self) -> bool:
        """Holds gradients and optimizer state."""
        return self.stage == "train"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Workflow:
    """The model-stages of one RL step and their dependencies.

    Attributes:
        algorithm: ``ppo``, ``grpo`` or ``remax``.
        model_stages: in stage order (generate → infer → train), then by name.
        asynchronous: generation overlaps training of the previous step.
        weight_sync: (source, destination) pairs of model-stages whose weights move every step.
    """

    algorithm: str
    model_stages: tuple[ModelStage, ...]
    asynchronous: bool = False
    weight_sync: tuple[tuple[ModelStage, ModelStage], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.model_stages:
            raise ValueError("a workflow needs at least one model-stage")
        names = [m.name for m in self.model_stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model-stages in workflow: {names}")
        for src, dst in self.weight_sync:
            if src not in self.model_stages or dst not in self.model_stages:
                raise ValueError(f"weight sync {src}→{dst} names a model-stage not in the workflow")

    @property
    def stages(self) -> tuple[str, ...]:
        """Stages present, in execution order."""
        present = {m.stage for m in self.model_stages}
        return tuple(s for s in STAGES if s in present)

    def in_stage(self, stage: str) -> tuple[ModelStage, ...]:
        """Model-stages that run concurrently in ``stage``."""
        return tuple(m for m in self.model_stages if m.stage == stage)

    def models(self) -> tuple[str, ...]:
        seen: list[str] = []
        for m in self.model_stages:
            if m.model not in seen:
                seen.append(m.model)
        return tuple(seen)

    def get(self, name: str) -> ModelStage:
        """The model-stage called ``name``.

        Raises:
            KeyError: not in this workflow.
        """
        for m in self.model_stages:
            if m.name == name:
                return m
        raise KeyError(f"model-stage {name!r} is not in the {self.algorithm} workflow "
                       f"({[m.name for m in self.model_stages]})")

    def dependencies(self) -> list[tuple[ModelStage, ModelStage]]:
        """Data dependencies inside one step: every model-stage of a stage feeds every model-stage
        of the next present stage (advantages need all rewards, values and log-probs)."""
        edges = []
        stages = self.stages
        for a, b in zip(stages, stages[1:]):
            for u in self.in_stage(a):
                for v in self.in_stage(b):
                    edges.append((u, v))
        return edges

    def to_dict(self) -> dict:
        return {"algorithm": self.algorithm, "asynchronous": self.asynchronous,
                "model_stages": [m.name for m in self.model_stages],
                "weight_sync": [[s.name, d.name] for s, d in self.weight_sync]}


def workflow_for(workload: WorkloadSpec) -> Workflow:
    """The workflow of ``workload.algorithm`` (PPO, GRPO or ReMax); ``reference.infer`` only with
    ``workload.reference_model``, ``reward.infer`` only with ``workload.reward_model``."""
    ms = [ModelStage("actor", "generate"), ModelStage("actor", "infer")]
    if workload.reference_model:
        ms.append(ModelStage("reference", "infer"))
    if workload.algorithm == "ppo":
        ms.append(ModelStage("critic", "infer"))
    if workload.reward_model:
        ms.append(ModelStage("reward", "infer"))
    ms.append(ModelStage("actor", "train"))
    if workload.algorithm == "ppo":
        ms.append(ModelStage("critic", "train"))
    ms.sort(key=lambda m: (STAGE_RANK[m.stage], m.model))
    sync = ((ModelStage("actor", "train"), ModelStage("actor", "generate")),)
    return Workflow(algorithm=workload.algorithm, model_stages=tuple(ms),
                    asynchronous=workload.asynchronous, weight_sync=sync)
