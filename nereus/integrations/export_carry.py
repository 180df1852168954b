"""The user's own settings carried across frameworks by an export (``nereus plan --from-verl ...
--export openrlhf`` and ``--from-openrlhf ... --export verl``): model paths, data files, KL settings and
the reward, each written under the target framework's name where it has an equivalent, and named in a
note where it has none (never a placeholder).

Names: verl 0.9.1 (``verl/trainer/config/ppo_trainer.yaml``: ``actor_rollout_ref.model.path``,
``critic.model.path``, ``reward.reward_model.model_path``, ``reward.custom_reward_function.path``,
``data.train_files``/``val_files``/``prompt_key``, ``actor_rollout_ref.actor.use_kl_loss``/``kl_loss_coef``/
``kl_loss_type``, ``algorithm.use_kl_in_reward``/``kl_penalty``/``kl_ctrl.*``) and OpenRLHF 0.11.2
(``openrlhf/cli/train_ppo_ray.py``: ``--actor/--critic/--reward.model_name_or_path``, ``--reward.remote_url``,
``--data.prompt_dataset``, ``--eval.dataset``, ``--data.input_key``, ``--data.apply_chat_template``,
``--algo.kl.init_coef``/``use_loss``/``estimator``/``target``/``horizon``). KL estimators: verl's
``kl``/``k1``, ``mse``/``k2`` and ``low_var_kl``/``k3`` are OpenRLHF's ``k1``, ``k2`` and ``k3`` (both clamp
k3 to [-10, 10]: verl ``core_algos.kl_penalty_forward``, OpenRLHF ``models/utils.compute_approx_kl``).
"""

from __future__ import annotations

__all__ = ["verl_to_openrlhf", "openrlhf_to_verl", "merge_carried", "carry_settings", "export_model_path"]

_ARR = "actor_rollout_ref"
#: verl kl type -> OpenRLHF --algo.kl.estimator
_TO_ORL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
#: OpenRLHF --algo.kl.estimator -> verl kl type
_TO_VERL = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


def _get(cfg, dotted: str, default=None):
    cur = cfg
    for part in dotted.split("."):
        try:
            cur = cur[part]
        except (KeyError, TypeError, IndexError):
            return default
    return default if cur is None else cur


def _first(cfg, *keys):
    return next((v for v in (_get(cfg, k) for k in keys) if v not in (None, "")), None)


def _files(v) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    return [str(x) for x in v]


def _kl_estimator(name, key: str, notes: list) -> str | None:
    base = str(name)
    if base.endswith("+"):  # verl's straight-through gradient variant ("k3+"): OpenRLHF has none
        notes.append(f"{key}={name}: OpenRLHF has no straight-through ('+') KL gradient; its "
                     f"{_TO_ORL.get(base[:-1], '?')} estimator is written (see --algo.kl.unbiased_gradient)")
        base = base[:-1]
    if base in _TO_ORL:
        return _TO_ORL[base]
    notes.append(f"{key}={name}: OpenRLHF's --algo.kl.estimator has no equivalent (k1, k2, k3); its default k1 is used")
    return None


def verl_to_openrlhf(cfg, has_critic: bool = True) -> tuple[list[str], list[str]]:
    """``(tokens, notes)``: the OpenRLHF ``train_ppo_ray`` options for the settings of a composed verl
    config ``cfg`` (nested dict) that Nereus's layout does not set; ``has_critic``: the job trains a
    critic (GAE; verl's ``critic.model.path`` is read only then)."""
    out: list[str] = []
    notes: list[str] = []
    actor = _get(cfg, f"{_ARR}.model.path")
    if actor:
        out += ["--actor.model_name_or_path", str(actor)]
    critic = _get(cfg, "critic.model.path")
    if has_critic and critic:  # always: OpenRLHF's critic would default to the reward model
        out += ["--critic.model_name_or_path", str(critic)]
    rm = _first(cfg, "reward.reward_model.model_path", "reward_model.model.path", "reward_model.model_path")
    rm_on = bool(_first(cfg, "reward.reward_model.enable", "reward_model.enable"))
    fn = _first(cfg, "reward.custom_reward_function.path", "custom_reward_function.path")
    if rm_on and rm:
        out += ["--reward.model_name_or_path", str(rm)]
    elif rm_on:
        notes.append("verl's reward model is enabled without a model path: give --reward.model_name_or_path")
    else:
        what = (f"custom_reward_function.path={fn} (compute_score(data_source, solution_str, ground_truth, "
                "extra_info))" if fn else "verl's rule-based reward by data_source (default_compute_score)")
        notes.append(f"{what}: OpenRLHF has no equivalent; add --reward.remote_url with a reward server URL or a "
                     "Python file defining reward_func(queries, prompts, labels)")
    train, val = _files(_get(cfg, "data.train_files")), _files(_get(cfg, "data.val_files"))
    if train:
        out += ["--data.prompt_dataset", ",".join(train)]
    if val:
        out += ["--eval.dataset", ",".join(val)]
    if train or val:  # verl's RLHFDataset reads chat messages under data.prompt_key and applies the chat template
        out += ["--data.input_key", str(_get(cfg, "data.prompt_key", "prompt")), "--data.apply_chat_template"]
        notes.append("data files carried as --data.prompt_dataset/--eval.dataset with --data.input_key and "
                     "--data.apply_chat_template; verl's ground truth (reward_model.ground_truth) is nested, and "
                     "OpenRLHF's --data.label_key reads a top-level column only: flatten it to pass labels")
    loss, in_reward = bool(_get(cfg, f"{_ARR}.actor.use_kl_loss", False)), bool(_get(cfg, "algorithm.use_kl_in_reward", False))
    if loss:
        key = f"{_ARR}.actor.kl_loss_type"
        out += ["--algo.kl.use_loss", "--algo.kl.init_coef", _num(_get(cfg, f"{_ARR}.actor.kl_loss_coef", 0.001))]
        est = _kl_estimator(_get(cfg, key, "low_var_kl"), key, notes)
        out += ["--algo.kl.estimator", est] if est else []
        if in_reward:
            notes.append("verl uses both a KL loss and a KL penalty in the reward; OpenRLHF takes one KL "
                         "coefficient: the loss (--algo.kl.use_loss) is written, the reward penalty is dropped")
    elif in_reward:
        out += ["--algo.kl.init_coef", _num(_get(cfg, "algorithm.kl_ctrl.kl_coef", 0.001))]
        est = _kl_estimator(_get(cfg, "algorithm.kl_penalty", "kl"), "algorithm.kl_penalty", notes)
        out += ["--algo.kl.estimator", est] if est else []
        if _get(cfg, "algorithm.kl_ctrl.type", "fixed") == "adaptive":
            out += ["--algo.kl.target", _num(_get(cfg, "algorithm.kl_ctrl.target_kl", 0.1)),
                    "--algo.kl.horizon", str(int(_get(cfg, "algorithm.kl_ctrl.horizon", 10000)))]
    else:
        out += ["--algo.kl.init_coef", "0"]
    return out, notes


def _num(v) -> str:
    return f"{float(v):.4g}"


def openrlhf_to_verl(values: dict, has_critic: bool) -> tuple[list[str], list[str]]:
    """``(overrides, notes)``: verl ``key=value`` overrides for the settings of parsed OpenRLHF options
    ``values`` (``{dest: value}`` with the parser's defaults, :func:`nereus.integrations.openrlhf.parse_args`)
    that Nereus's layout does not set; ``has_critic``: the job trains a critic (GAE)."""
    out: list[str] = []
    notes: list[str] = []
    actor = values.get("actor.model_name_or_path")
    if actor:
        out.append(f"{_ARR}.model.path={actor}")
    rm, url = values.get("reward.model_name_or_path"), values.get("reward.remote_url")
    if isinstance(url, list):
        url = ",".join(url)
    if has_critic:  # OpenRLHF's critic defaults to the reward model, or the actor with a remote reward
        critic = values.get("critic.model_name_or_path") or (str(rm).split(",")[0] if rm and not url else actor)
        if critic:
            out.append(f"critic.model.path={critic}")
    if rm and not url:
        out.append(f"reward.reward_model.model_path={str(rm).split(',')[0]}")
    elif url:
        notes.append(f"--reward.remote_url {url}: verl has no equivalent (its reward.custom_reward_function.path "
                     "takes a Python file defining compute_score(data_source, solution_str, ground_truth, "
                     "extra_info)); set it, or verl scores with its rule-based reward by data_source")
    for opt, key in (("data.prompt_dataset", "data.train_files"), ("eval.dataset", "data.val_files")):
        v = values.get(opt)
        if not v:
            continue
        parts = [p for p in str(v).split(",") if p]
        if all(p.endswith(".parquet") for p in parts):
            out.append(f"{key}=[{','.join(repr(p) for p in parts)}]")
        else:
            notes.append(f"--{opt} {v}: verl reads parquet files only; give {key} (verl's default is kept)")
    if values.get("data.input_key") not in (None, "input") and any(o.startswith("data.train_files") for o in out):
        out.append(f"data.prompt_key={values['data.input_key']}")
    coef = float(values.get("algo.kl.init_coef") or 0.0)
    est = _TO_VERL.get(str(values.get("algo.kl.estimator") or "k1"), "kl")
    if coef > 0 and values.get("algo.kl.use_loss"):
        out += [f"{_ARR}.actor.use_kl_loss=True", f"{_ARR}.actor.kl_loss_coef={_num(coef)}",
                f"{_ARR}.actor.kl_loss_type={est}", "algorithm.use_kl_in_reward=False"]
    elif coef > 0:
        out += [f"{_ARR}.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=True",
                f"algorithm.kl_ctrl.kl_coef={_num(coef)}", f"algorithm.kl_penalty={est}"]
        if values.get("algo.kl.target") is not None:
            out += ["algorithm.kl_ctrl.type=adaptive", f"algorithm.kl_ctrl.target_kl={_num(values['algo.kl.target'])}",
                    f"algorithm.kl_ctrl.horizon={int(values.get('algo.kl.horizon') or 10000)}"]
    else:
        out += [f"{_ARR}.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False"]
    return out, notes


def merge_carried(mine, carried) -> list[str]:
    """Nereus's verl overrides ``mine`` with the carried ones: a key both set takes the carried value
    (the user's KL mode), the rest of ``mine`` first."""
    keys = {o.partition("=")[0].lstrip("+") for o in carried}
    return [o for o in mine if o.partition("=")[0].lstrip("+") not in keys] + list(carried)


def export_model_path(model: str | None) -> str | None:
    """The model path an export writes for ``--model``: None for a preset name (no path to give), the
    folder of a ``config.json`` path (the frameworks load a model folder or hub name, not the file)."""
    from pathlib import Path

    from nereus.spec.presets import MODEL_PRESETS

    if not model or model.lower() in MODEL_PRESETS:
        return None
    p = Path(model).expanduser()
    return str(p.parent) if p.name == "config.json" else model


def carry_settings(target: str, source: dict, job) -> tuple[list[str], list[str]]:
    """``(settings, notes)`` of an import ``source`` (``{"cfg": composed verl config}`` or ``{"args":
    OpenRLHF tokens}``) for an export to ``target`` (``"openrlhf"`` tokens or ``"verl"`` overrides)."""
    from nereus.workflow import workflow_for

    critic = any(m.name == "critic.train" for m in workflow_for(job.workload).model_stages)
    if target == "openrlhf":
        return verl_to_openrlhf(source["cfg"], critic)
    from nereus.integrations.openrlhf import parse_args

    values, _ = parse_args(source["args"])
    return openrlhf_to_verl(values, critic)
