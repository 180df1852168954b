"""OpenRLHF's non-Ray ``openrlhf.cli.train_ppo`` (DeepSpeed, generation by the training engine): its
launch forms import unedited, every model on every GPU, per-GPU memory terms computed by hand for a
tiny model, and what is refused is named."""

import pytest

from nereus.cost.memory import WORKSPACE_BYTES
from nereus.cost.model import CostModel
from nereus.integrations.common import without_fraction
from nereus.integrations.openrlhf import _tokens, import_openrlhf, openrlhf_source
from nereus.integrations.openrlhf_deepspeed import deepspeed_launch
from nereus.planner.whatif import evaluate_layout
from nereus.spec.model import ModelSpec

pytestmark = pytest.mark.skipif(openrlhf_source() is None, reason="OpenRLHF not installed (its parser checks names)")

#: h 1024, F 4096, 4 layers, 8 query heads, 2 KV heads of 128, V 32000, untied head
TINY = ModelSpec(name="tiny", hidden_size=1024, intermediate_size=4096, num_layers=4, num_attention_heads=8,
                 num_kv_heads=2, head_dim=128, vocab_size=32000)
OPTS = ("--pretrain m --reward_pretrain rm --micro_train_batch_size 2 --train_batch_size 32 "
        "--micro_rollout_batch_size 16 --rollout_batch_size 64 --prompt_max_len 1024 --generate_max_len 1024 "
        "--zero_stage 1 --bf16 --init_kl_coef 0.01 --flash_attn --gradient_checkpointing")
#: OpenRLHF/OpenRLHF@v0.5.0 examples/scripts/train_ppo_llama.sh as written (its options: OPTS)
SCRIPT = ("set -x\n\nread -r -d '' training_commands <<EOF\nopenrlhf.cli.train_ppo \\\n   "
          + " \\\n   ".join(OPTS.replace(" --", "\n--").split("\n")) + "\nEOF\n\n    # --packing_samples\n"
          "    # --remote_rm_url http://localhost:5000/get_reward\n\nif [[ ${1} != \"slurm\" ]]; then\n"
          "    deepspeed --module $training_commands\nfi\n")
ECHO = "/env/bin/python -u -m openrlhf.cli.train_ppo --local_rank=3 " + OPTS


def test_both_launch_forms_import_as_the_options_on_every_gpu():
    a = import_openrlhf(SCRIPT, model=TINY, gpu="h100", gpus_per_node=4)
    b = import_openrlhf(ECHO, model=TINY, gpu="h100", gpus_per_node=4)
    c = import_openrlhf("deepspeed --num_gpus 4 --module openrlhf.cli.train_ppo " + OPTS, model=TINY, gpu="h100")
    assert a.job == b.job == c.job and a.layout == b.layout == c.layout and a.expressible
    assert deepspeed_launch(SCRIPT).launcher == "deepspeed" and deepspeed_launch(ECHO).local_rank == 3
    assert _tokens(SCRIPT) == _tokens(ECHO)  # what an export keeps: train_ppo's own options, translated
    by = {x.model_stage: x for x in a.layout}
    # every model on all 4 GPUs, DP 4, no TP: actor, critic, reference and reward, generation on the actor
    assert set(by) == {"actor.generate", "actor.infer", "actor.train", "critic.infer", "critic.train",
                       "reference.infer", "reward.infer"}
    assert all(x.gpus == (0, 1, 2, 3) and x.dp == 4 and x.tp == 1 and x.pp == 1 for x in a.layout)
    g = by["actor.generate"]
    assert g.concurrency == 16 and g.offload == "none"  # --micro_rollout_batch_size sequences at a time
    t = by["actor.train"]
    assert (t.zero, t.micro_batch, t.grad_accum, t.recompute, t.offload) == (1, 2, 32 // (4 * 2), "full", "none")
    assert by["reference.infer"].zero == 0 and by["reference.infer"].micro_batch == 16  # eval engine, ZeRO-0
    w, fw = a.job.workload, a.job.framework
    assert (w.prompts_per_step, w.prompt_len, w.response_len, w.mini_batch_size) == (64, 1024, 1024, 32)
    assert w.rollout_memory_fraction is None and fw.train_engine_generation and fw.shared_engine
    assert (a.job.cluster.num_nodes, a.job.cluster.gpus_per_node) == (1, 4)
    # the launcher's own count wins; --include counts the slots it names
    inc = import_openrlhf("deepspeed --include localhost:0,1 --module openrlhf.cli.train_ppo " + OPTS, model=TINY)
    assert {x.gpus for x in inc.layout} == {(0, 1)}
    # train_ppo's default --rollout_batch_size is 512 (0.11's train_ppo_ray: 1024)
    d = import_openrlhf(ECHO.replace("--rollout_batch_size 64 ", ""), model=TINY, gpus_per_node=4)
    assert d.job.workload.prompts_per_step == 512


def test_per_gpu_memory_by_hand():
    imp = import_openrlhf(ECHO, model=TINY, gpu="h100", gpus_per_node=4)
    cost = CostModel(imp.job)
    ev = evaluate_layout(imp.job, imp.layout, cost=cost)
    est = ev.plan.estimates
    h, f, L, V = 1024, 4096, 4, 32000
    layer = 2 * h * h + 2 * h * 256 + 3 * h * f + 2 * h  # q/o, k/v (2 KV heads x 128), SwiGLU, two norms
    actor_p = L * layer + 2 * V * h + h  # embedding, untied head, final norm
    value_p = L * layer + V * h + h + h + 1  # critic and reward: value head [h] + bias
    g = est["actor.generate"].memory
    assert g["weights"] == 2 * actor_p
    assert g["kv_cache"] == 16 * 2048 * (2 * L * 2 * 128 * 2)  # c x (prompt + response) x K,V bf16 per token
    tokens = 16 * 1024  # Hugging Face generate prefills all 16 prompts at once (16,384 > vLLM's 8,192 chunk)
    assert g["activations"] == 2 * tokens * (8 * h + 4 * h + 4 * h * 2 / 8 + 6 * f)
    assert g["logits"] == 6 * 16 * V
    # ZeRO-1 over 4: the training engines keep bf16 weights and a quarter of the 12-byte Adam state
    assert est["actor.train"].resident == 2 * actor_p + 12 * actor_p / 4
    assert est["critic.train"].resident == 2 * value_p + 12 * value_p / 4
    assert est["reference.infer"].resident == 2 * actor_p and est["reward.infer"].resident == 2 * value_p
    # actor.generate / actor.infer / critic.infer run on the training engines: their weights count once
    resident = est["actor.train"].resident + est["critic.train"].resident + 2 * actor_p + 2 * value_p
    peak = WORKSPACE_BYTES + resident + max(e.transient for e in est.values())
    assert ev.plan.gpu_memory == {gid: pytest.approx(peak) for gid in range(4)}
    assert not any(k.startswith("broadcast") for k in est["actor.generate"].breakdown)  # no weight sync
    # Nereus's own plans (and the train_ppo_ray export) generate with vLLM
    assert not without_fraction(imp.job).framework.train_engine_generation


def test_refused_and_bad_lines_are_named():
    z3 = import_openrlhf(ECHO.replace("--zero_stage 1", "--zero_stage 3"), model=TINY, gpus_per_node=4)
    assert [u.key for u in z3.unexpressible] == ["--zero_stage"] and "ZeRO-3" in z3.unexpressible[0].why
    ema = import_openrlhf(ECHO + " --enable_ema", model=TINY, gpus_per_node=4)
    assert "--train.enable_ema" in {u.key for u in ema.unexpressible}
    with pytest.raises(ValueError, match=r"--vllm_num_engines.*train_ppo has no such option.*train_ppo_ray"):
        import_openrlhf(ECHO + " --vllm_num_engines 2", model=TINY, gpus_per_node=4)
    with pytest.raises(ValueError, match=r"one rank per visible GPU; give the machine's GPU count"):
        import_openrlhf("deepspeed --module openrlhf.cli.train_ppo " + OPTS, model=TINY)
    with pytest.raises(ValueError, match=r"--local_rank=3: outside the 2 GPUs"):
        import_openrlhf(ECHO, model=TINY, gpus_per_node=2)
    with pytest.raises(ValueError, match=r"DeepSpeed launcher option '--bogus'"):
        import_openrlhf("deepspeed --bogus 1 --module openrlhf.cli.train_ppo " + OPTS, model=TINY)
    auto = import_openrlhf("deepspeed --num_gpus 4 --autotuning run --module openrlhf.cli.train_ppo " + OPTS,
                           model=TINY)
    assert [u.key for u in auto.unexpressible] == ["deepspeed --autotuning"]
    # before v0.6.0 train_ppo builds the reference whatever --init_kl_coef is
    kl0 = ECHO.replace("--init_kl_coef 0.01", "--init_kl_coef 0")
    assert import_openrlhf(kl0, model=TINY, gpus_per_node=4, version="0.5.0").job.workload.reference_model
    assert not import_openrlhf(kl0, model=TINY, gpus_per_node=4, version="0.6.1").job.workload.reference_model


def test_every_train_ppo_option_is_translated_read_or_classified():
    """Each option of train_ppo's parser (any release) becomes a 0.11 option the importer reads or
    classifies (openrlhf_keys), or is dropped with a reason (no effect) or refused by name."""
    from nereus.integrations import openrlhf_keys
    from nereus.integrations.openrlhf import _DEFAULTS, argument_names
    from nereus.integrations.openrlhf_deepspeed import _OWN, TRAIN_PPO_OPTIONS
    from nereus.integrations.openrlhf_legacy import _SPECIAL, DROPPED, REFUSED, RENAMED

    names = argument_names()
    special = {"--prompt_max_len": "--data.max_len", "--generate_max_len": "--rollout.max_new_tokens",
               "--bf16": "--ds.param_dtype", "--use_kl_estimator_k3": "--algo.kl.estimator"}
    assert set(special) == set(_SPECIAL) - {"--ref_reward_offload"}  # train_ppo never had that one
    for o in sorted("--" + x for x in TRAIN_PPO_OPTIONS):
        if o in DROPPED or o in REFUSED or (o in _OWN and _OWN[o] is None):
            continue
        target = special.get(o) or _OWN.get(o) or RENAMED.get(o) or (o if o in names else None)
        assert target in names, o
        k = target[2:]
        assert k in _DEFAULTS or openrlhf_keys.classify(k) is not None, o


def test_cli_reads_the_example_script_with_the_machines_gpu_count(capsys):
    from nereus.cli import main

    assert main(["plan", "--from-openrlhf", SCRIPT, "--model", "qwen2.5-0.5b", "--gpus-per-node", "4",
                 "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["job"]["cluster"]["gpus_per_node"] == 4 and out["user"]["expressible"]
    assert {tuple(c["gpus"]) for c in out["user"]["layout"]} == {(0, 1, 2, 3)}
    assert out["job"]["framework"]["train_engine_generation"] is True
    assert main(["plan", "--from-openrlhf", SCRIPT, "--model", "qwen2.5-0.5b"]) == 2  # the count is named
    assert "give the machine's GPU count" in capsys.readouterr().err
