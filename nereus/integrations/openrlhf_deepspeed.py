"""OpenRLHF's DeepSpeed PPO trainer without Ray, ``openrlhf.cli.train_ppo`` (v0.3.6 to v0.6.1.post1;
removed in v0.6.2 by OpenRLHF/OpenRLHF#882), read as the launch lines users run it with.

What ``train_ppo`` runs (OpenRLHF/OpenRLHF@v0.5.0 and @v0.6.1: ``openrlhf/cli/train_ppo.py``,
``openrlhf/utils/deepspeed.py``, ``openrlhf/trainer/ppo_trainer.py``,
``openrlhf/trainer/ppo_utils/experience_maker.py``, ``openrlhf/models/actor.py``):

* One process per GPU of the DeepSpeed world, and every model on every GPU: the actor and the critic
  as DeepSpeed training engines (``get_ds_train_config``: ``--zero_stage``, ``--adam_offload`` as
  ``offload_optimizer: cpu``), the reference (``initial_model``) and the reward model as evaluation
  engines (``get_ds_eval_config``: ZeRO-3 when ``--zero_stage 3``, else stage 0; no parameter
  offload). Data parallel over all N GPUs: each rank takes ``--rollout_batch_size / N`` prompts
  (``setup_dataloader(..., rollout_batch_size // world_size)``), DeepSpeed's ``train_batch_size`` is
  ``--train_batch_size`` with ``--micro_train_batch_size`` per GPU.
* Generation by the training engine: ``NaiveExperienceMaker.generate_samples`` calls
  ``Actor.generate`` (Hugging Face ``generate`` with ``use_cache=True``) on ``--micro_rollout_batch_size``
  prompts at a time, no vLLM; each such batch then gets its actor log-probs, reference log-probs,
  values and rewards (``make_experience``), so ``--micro_rollout_batch_size`` is also the inference
  micro-batch. ``--gradient_checkpointing`` applies to actor and critic. The reference model is built
  whatever ``--init_kl_coef`` is before v0.6.0 and only for ``--init_kl_coef`` > 0 from v0.6.0.

Expressed as the job types Nereus has: the actor, critic, reference and reward groups of
:func:`nereus.integrations.openrlhf.import_openrlhf` each on all N GPUs (``--train.colocate_all``),
DP = N, and ``actor.generate`` on the actor's GPUs at TP 1, DP N, concurrency
``--micro_rollout_batch_size``, under the framework flag ``train_engine_generation`` (its weights
are the training engine's, no weight sync, no chunked prefill: :mod:`nereus.spec.framework`) and with
no vLLM memory fraction. Refused by name: ``--zero_stage 3`` (Hugging Face ``generate`` on a ZeRO-3
actor gathers every layer for each decoded token; the generation model has no ZeRO-3 term), options
``train_ppo`` has no parser entry for (vLLM, GPU groups and colocation are ``train_ppo_ray``'s), and
DeepSpeed's ``--autotuning`` / ``--elastic_training`` (the launcher picks the batch or the GPUs).

Launch forms (:func:`deepspeed_launch`): ``deepspeed [launcher options] --module openrlhf.cli.train_ppo
...``; an example script's ``read -r -d '' VAR <<EOF openrlhf.cli.train_ppo ... EOF`` then
``deepspeed --module $VAR`` (``set -x``, comments and ``if ... fi`` around it as in
``examples/scripts/train_ppo_llama.sh``); one rank's command as DeepSpeed's launcher echoes it
(``/path/python -u -m openrlhf.cli.train_ppo --local_rank=7 ...``); the options alone. The GPUs:
``--num_gpus`` and ``--num_nodes``, or ``--include`` (``host:0,1,2,3@host2...``), or
``CUDA_VISIBLE_DEVICES=...`` before the launcher; otherwise DeepSpeed runs one rank per visible GPU of
the machine and the caller gives that count (``gpus_per_node``; DeepSpeed launcher options:
microsoft/DeepSpeed ``deepspeed/launcher/runner.py`` ``parse_args``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from nereus.integrations.framework_versions import version_key

__all__ = ["ENTRY", "TRAIN_PPO_OPTIONS", "TRAIN_PPO_DEFAULTS", "DeepSpeedLaunch", "deepspeed_launch",
           "train_ppo_options", "topology_tokens", "reference_always", "TRAIN_ENGINE_NOTES"]

ENTRY = "openrlhf.cli.train_ppo"
#: every option of ``train_ppo``'s parser in any release that has it (v0.3.6 ... v0.6.1.post1), read by
#: running the parser-building statements of each tag's ``openrlhf/cli/train_ppo.py``
TRAIN_PPO_OPTIONS = frozenset(
    ('actor_init_on_gpu', 'actor_learning_rate', 'adam_betas', 'adam_offload', 'advantage_estimator',
     'apply_chat_template', 'aux_loss_coef', 'bf16', 'ckpt_path', 'critic_learning_rate', 'critic_pretrain',
     'disable_ds_ckpt', 'disable_fast_tokenizer', 'disable_trace_cache', 'enable_ema', 'eps_clip',
     'eval_steps', 'flash_attn', 'freezing_actor_steps', 'gamma', 'generate_max_len', 'grad_accum_dtype',
     'gradient_checkpointing', 'gradient_checkpointing_use_reentrant', 'init_kl_coef', 'input_key',
     'input_template', 'kl_estimator', 'kl_target', 'l2', 'label_key', 'lambd', 'load_checkpoint',
     'load_in_4bit', 'local_rank', 'logging_steps', 'lora_alpha', 'lora_dropout', 'lora_rank',
     'lr_warmup_ratio', 'max_ckpt_mem', 'max_ckpt_num', 'max_epochs', 'max_len', 'max_norm', 'max_samples',
     'micro_rollout_batch_size', 'micro_train_batch_size', 'n_samples_per_prompt', 'normalize_reward',
     'num_episodes', 'overlap_comm', 'pretrain', 'pretrain_data', 'pretrain_data_probs', 'pretrain_split',
     'prompt_data', 'prompt_data_probs', 'prompt_max_len', 'prompt_split', 'ptx_coef', 'remote_rm_url',
     'reward_clip_range', 'reward_pretrain', 'rollout_batch_size', 'save_hf_ckpt', 'save_path',
     'save_steps', 'save_value_network', 'seed', 'target_modules', 'temperature', 'top_p',
     'train_batch_size', 'use_kl_estimator_k3', 'use_kl_loss', 'use_ms', 'use_tensorboard', 'use_wandb',
     'value_clip', 'value_head_prefix', 'wandb_group', 'wandb_org', 'wandb_project', 'wandb_run_name',
     'zero_stage', 'zpg'))
#: ``train_ppo``'s defaults (the same in every release) where they differ from what the flat-name
#: translation fills in (:data:`nereus.integrations.openrlhf_legacy.LEGACY_DEFAULTS` and 0.11's)
TRAIN_PPO_DEFAULTS = {"--rollout_batch_size": "512"}
#: ``train_ppo`` options the ``train_ppo_ray`` translation lacks: 0.11 name, or None (no effect, why)
_OWN = {"--aux_loss_coef": "--actor.aux_loss_coef", "--reward_clip_range": "--reward.clip_range",
        "--save_value_network": "--critic.save_value_network",
        "--disable_trace_cache": None, "--pretrain_data_probs": None, "--pretrain_split": None}
_DROPPED_WHY = ("--disable_trace_cache (ZeRO-3 prefetch settings; ZeRO-3 is refused here), --pretrain_data_probs "
                "and --pretrain_split (PPO-ptx data, refused with --pretrain_data)")
#: DeepSpeed launcher options that take a value (runner.py ``parse_args``); the rest are flags
_DS_VALUE = {"-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--min_elastic_nodes",
             "--max_elastic_nodes", "--num_gpus", "--num_accelerators", "--master_port", "--master_addr",
             "--launcher", "--launcher_args", "--enable_each_rank_log", "--autotuning", "--bind_core_list"}
_DS_FLAGS = {"--module", "--no_python", "--no_local_rank", "--no_ssh_check", "--force_multi", "--save_pid",
             "--elastic_training", "--bind_cores_to_rank"}
_HEREDOC = re.compile(r"read\s+-r\s+-d\s+(?:''|\"\")\s+(\w+)\s*<<-?\s*['\"]?(\w+)['\"]?[^\n]*\n(.*?)\n\s*\2\s*(?:\n|$)",
                      re.S)

TRAIN_ENGINE_NOTES = (
    "openrlhf.cli.train_ppo: actor, critic, reference and reward model on every GPU of the DeepSpeed world "
    "(DP = all GPUs); the reference and reward as DeepSpeed evaluation engines (ZeRO-0 below --zero_stage 3)",
    "generation by the training engine: Hugging Face generate on the DeepSpeed actor, --micro_rollout_batch_size "
    "sequences at a time (actor.generate tp 1 on the actor's GPUs, its weights the engine's; KV cache, one-pass "
    "prefill and logits as transients); the time is the decode roofline, a lower bound for eager Hugging Face "
    "generate without paged attention or CUDA graphs",
)


@dataclass
class DeepSpeedLaunch:
    """A ``train_ppo`` launch line: its own option tokens and what the launcher says of the GPUs.

    Attributes:
        options: ``train_ppo``'s option tokens (after the entry point, ``--local_rank`` cut).
        launcher: ``deepspeed``, ``rank`` (one rank's echoed command) or ``none`` (options only).
        gpus_per_node / nodes: from ``--num_gpus`` / ``--num_nodes`` / ``--include`` /
            ``CUDA_VISIBLE_DEVICES`` (None: not in the line).
        local_rank: the echoed rank's ``--local_rank`` (None: not given).
        refused: ``(option, value, why)`` of launcher options outside the cost model.
    """

    options: list[str]
    launcher: str
    gpus_per_node: int | None = None
    nodes: int | None = None
    local_rank: int | None = None
    refused: list = field(default_factory=list)


def _expand_heredoc(text: str) -> str:
    """The script's ``deepspeed ... $VAR`` line with the heredoc's body in place of ``$VAR``."""
    m = _HEREDOC.search(text)
    if m is None:
        return text
    var, body = m.group(1), m.group(3).replace("\\\n", " ")
    rest = text[:m.start()] + "\n" + text[m.end():]
    lines = [ln for ln in rest.replace("\\\n", " ").splitlines() if re.search(rf"\$\{{?{var}\}}?(\W|$)", ln)]
    if not lines:
        raise ValueError(f"OpenRLHF launch script: the heredoc {var!r} is never launched (no line runs ${var}; "
                         f"give e.g. 'deepspeed --module ${var}')")
    line = next((ln for ln in lines if re.match(r"\s*(\w+=\S*\s+)*deepspeed\b", ln)), lines[0])
    return re.sub(rf"\$\{{?{var}\}}?", lambda _: " " + body + " ", line)


def _include(spec: str) -> tuple[int, int | None]:
    """(nodes, GPUs per node) of a DeepSpeed ``--include`` ``NAME[:SLOT,...][@NAME...]`` (None: all slots)."""
    hosts = [h for h in spec.split("@") if h]
    slots = [len(h.split(":", 1)[1].split(",")) if ":" in h else None for h in hosts]
    return len(hosts), (None if None in slots else max(slots))


def deepspeed_launch(args) -> DeepSpeedLaunch | None:
    """The ``train_ppo`` launch in ``args`` (a string or token list), or None when it runs another entry.

    Raises:
        ValueError: a launcher other than DeepSpeed's or a bad launcher value, named with what is valid.
    """
    if isinstance(args, str):
        if ENTRY not in args and "openrlhf/cli/train_ppo.py" not in args:
            return None
        toks = shlex.split(_expand_heredoc(args).replace("\\\n", " "), comments=True)
    else:
        toks = list(args)
    idx = next((i for i, t in enumerate(toks) if t == ENTRY or t.endswith("openrlhf/cli/train_ppo.py")), None)
    if idx is None:
        return None
    before, opts = [t for t in toks[:idx] if t != "\\"], [t for t in toks[idx + 1:] if t != "\\"]
    launch = DeepSpeedLaunch(options=[], launcher="none")
    rank = [i for i, t in enumerate(opts) if t == "--local_rank" or t.startswith("--local_rank=")]
    for i in reversed(rank):
        val = opts[i].split("=", 1)[1] if "=" in opts[i] else (opts[i + 1] if i + 1 < len(opts) else "")
        del opts[i:i + (1 if "=" in opts[i] else 2)]
        if not val.isdigit():
            raise ValueError(f"OpenRLHF argument --local_rank {val!r}: must be a GPU index (0, 1, ...)")
        launch.local_rank = int(val)
    launch.options = opts
    env = {}
    while before and re.match(r"^[A-Za-z_]\w*=", before[0]):
        k, v = before.pop(0).split("=", 1)
        env[k] = v
    if env.get("CUDA_VISIBLE_DEVICES"):
        launch.gpus_per_node = len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    if not before:
        return launch
    prog = before[0].rsplit("/", 1)[-1]
    if prog == "deepspeed":
        launch.launcher = "deepspeed"
        _deepspeed_options(before[1:], launch)
    elif re.fullmatch(r"python[\d.]*", prog) and before[1:] and before[-1] == "-m":
        launch.launcher = "rank"  # deepspeed/launcher/launch.py's per-rank command: python -u -m ENTRY --local_rank=R
    else:
        raise ValueError(f"OpenRLHF launch {' '.join(before)!r}: openrlhf.cli.train_ppo is read as DeepSpeed "
                         "launches it: 'deepspeed [--num_gpus N] --module openrlhf.cli.train_ppo ...', one rank's "
                         "'python -u -m openrlhf.cli.train_ppo --local_rank=R ...', or its options alone")
    return launch


def _deepspeed_options(toks: list[str], launch: DeepSpeedLaunch) -> None:
    i = 0
    while i < len(toks):
        t = toks[i]
        k, eq, v = t.partition("=")
        if k in _DS_FLAGS:
            if k == "--elastic_training":
                launch.refused.append(("deepspeed --elastic_training", True, "elastic training changes the GPU "
                                       "count while the job runs; Nereus judges one fixed layout"))
            i += 1
            continue
        if k not in _DS_VALUE:
            raise ValueError(f"DeepSpeed launcher option {t!r}: not an option of deepspeed's runner (valid: "
                             f"{', '.join(sorted(_DS_VALUE | _DS_FLAGS))})")
        if not eq:
            if i + 1 >= len(toks):
                raise ValueError(f"DeepSpeed launcher option {k}: needs a value")
            v, i = toks[i + 1], i + 1
        i += 1
        if k in ("--num_gpus", "--num_accelerators", "--num_nodes"):
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"DeepSpeed launcher option {k} {v!r}: must be a positive integer")
            if k == "--num_nodes":
                launch.nodes = int(v)
            else:
                launch.gpus_per_node = int(v)
        elif k in ("-i", "--include"):
            launch.nodes, gpn = _include(v)
            launch.gpus_per_node = gpn or launch.gpus_per_node
        elif k in ("-e", "--exclude"):
            launch.refused.append((f"deepspeed {k}", v, "excluded slots leave a GPU count Nereus does not know; "
                                   "give --num_gpus or --include instead"))
        elif k == "--autotuning":
            launch.refused.append(("deepspeed --autotuning", v, "DeepSpeed's autotuner chooses the micro-batch and "
                                   "ZeRO settings itself; give the ones it found"))


def train_ppo_options(launch: DeepSpeedLaunch, version: str | None, translate) -> tuple[list, list, list]:
    """``(0.11 option tokens, notes, refused)`` of a ``train_ppo`` launch;
    ``translate``: :func:`nereus.integrations.openrlhf_legacy.translate_legacy`.

    Raises:
        ValueError: an option ``train_ppo``'s parser does not have, named with where it belongs.
    """
    toks: list[str] = []
    dropped = False
    i, opts = 0, launch.options
    while i < len(opts):
        k = opts[i].split("=", 1)[0]
        j = i + 1
        while j < len(opts) and not opts[j].startswith("--"):
            j += 1
        if not k.startswith("--") or k[2:] not in TRAIN_PPO_OPTIONS:
            ray = re.match(r"--(vllm|colocate|ref_|reward_num|actor_num|critic_num|packing|ring|async)", k)
            why = (" (an option of openrlhf.cli.train_ppo_ray: vLLM engines, GPU groups, colocation, reference/"
                   "reward offload, packing, ring attention and asynchronous training are the Ray trainer's)"
                   if ray else "")
            raise ValueError(f"OpenRLHF argument {opts[i]!r}: openrlhf.cli.train_ppo has no such option{why}; "
                             "its options are those of v0.3.6 to v0.6.1.post1's parser")
        if k in _OWN:
            dropped |= _OWN[k] is None
            toks += [_OWN[k]] + opts[i + 1:j] if _OWN[k] else []
        else:
            toks += opts[i:j]
        i = j
    given = {t.split("=", 1)[0] for t in opts if t.startswith("--")}
    for k, v in TRAIN_PPO_DEFAULTS.items():
        if k not in given:
            toks += [k, v]
    out, notes, refused = translate(toks, version)
    keep: list[str] = []
    skip = False
    for t in out:  # train_ppo has no vLLM: the translation's vLLM memory fraction is not the job's
        if skip:
            skip = False
            continue
        if t == "--vllm.gpu_memory_utilization":
            skip = True
            continue
        keep.append(t)
    own = "openrlhf.cli.train_ppo's defaults (the same in every release) filled in"
    notes = [n.replace("flat-name defaults of OpenRLHF v0.8.0 filled in", own) for n in notes
             if "vllm_gpu_memory_utilization" not in n]
    filled = [f"{k} {v}" for k, v in TRAIN_PPO_DEFAULTS.items() if k not in given]
    if filled:
        notes.append(f"{own}: {', '.join(filled)}")
    if dropped:
        notes.append(f"no effect on the cost model: {_DROPPED_WHY}")
    if next((keep[n + 1] for n, t in enumerate(keep[:-1]) if t == "--ds.zero_stage"), "2") == "3":
        refused.append(("--zero_stage", 3, "with openrlhf.cli.train_ppo the actor generates with Hugging Face "
                        "generate on its ZeRO-3 engine, gathering every layer for each decoded token; the "
                        "generation model has no ZeRO-3 term (valid here: 0, 1, 2)"))
    return keep, notes, refused + launch.refused


def reference_always(version: str | None) -> bool:
    """Whether ``train_ppo`` of ``version`` builds the reference model whatever ``--init_kl_coef`` is
    (before v0.6.0; from v0.6.0 only for ``--init_kl_coef`` > 0, as 0.11's importer assumes)."""
    return version is not None and version_key(version) < version_key("0.6.0")


def topology_tokens(launch: DeepSpeedLaunch, gpus_per_node: int | None, nodes: int | None) -> tuple[list, list]:
    """``(--{role}.num_nodes/num_gpus_per_node for every role, --train.colocate_all; notes)``: every model
    on every GPU of the DeepSpeed world. The launch line's GPU count wins over the caller's.

    Raises:
        ValueError: no GPU count in the line and none given; an echoed ``--local_rank`` outside it.
    """
    gpn = launch.gpus_per_node or gpus_per_node
    if gpn is None:
        how = {"deepspeed": "deepspeed without --num_gpus or --include runs one rank per visible GPU",
               "rank": "one rank's echoed command does not say how many ranks the launcher started",
               "none": "the options alone do not say how many GPUs run them"}[launch.launcher]
        raise ValueError(f"openrlhf.cli.train_ppo: {how}; give the machine's GPU count (gpus_per_node=N, "
                         "nereus plan --gpus-per-node N)")
    n = launch.nodes or nodes or 1
    if launch.local_rank is not None and launch.local_rank >= gpn:
        raise ValueError(f"OpenRLHF argument --local_rank={launch.local_rank}: outside the {gpn} GPUs per node given "
                         f"(ranks 0 to {gpn - 1})")
    toks = [t for r in ("actor", "critic", "ref", "reward")
            for t in (f"--{r}.num_nodes", str(n), f"--{r}.num_gpus_per_node", str(gpn))] + ["--train.colocate_all"]
    src = "the launch line" if launch.gpus_per_node else "the machine's count given"
    return toks, [f"DeepSpeed world: {n} node(s) x {gpn} GPUs ({src})", *TRAIN_ENGINE_NOTES]
