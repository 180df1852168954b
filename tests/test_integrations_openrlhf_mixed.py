"""A line with OpenRLHF 0.11 option names and some flat (pre-0.11) ones, as in OpenRLHF 0.11.2's README:
the options it leaves out take 0.11.2's defaults (its own parser's), not the flat-name releases'."""

from __future__ import annotations

import pytest
from test_integrations_openrlhf import README, README_011

from nereus.integrations.openrlhf import import_openrlhf, openrlhf_parser
from nereus.integrations.openrlhf_legacy import LEGACY_DEFAULTS

parser = openrlhf_parser()
pytestmark = pytest.mark.skipif(parser is None, reason="openrlhf not installed (pip install --no-deps openrlhf)")

FIXED = README.replace(" --train.dynamic_batch_enable", "")  # fixed micro-batches: the defaults are read
FIXED_011 = README_011.replace(" --train.dynamic_batch_enable", "")


def test_mixed_line_takes_the_0_11_parser_defaults():
    d = vars(parser.parse_args([]))  # OpenRLHF 0.11.2 train_ppo_ray.py: default=1 for both
    train, roll = d["train.micro_batch_size"], d["rollout.micro_batch_size"]
    assert (train, roll) == (1, 1) != (int(LEGACY_DEFAULTS["--micro_train_batch_size"]),
                                       int(LEGACY_DEFAULTS["--micro_rollout_batch_size"]))
    mixed, new = import_openrlhf(FIXED, model="llama-3.1-8b"), import_openrlhf(FIXED_011, model="llama-3.1-8b")
    by = {c.model_stage: c for c in mixed.layout}
    assert by["actor.train"].micro_batch == train and by["critic.train"].micro_batch == train
    assert by["actor.infer"].micro_batch == roll and by["reference.infer"].micro_batch == roll
    assert mixed.job == new.job and mixed.layout == new.layout
    assert not any("defaults of OpenRLHF v0.8.0" in n for n in mixed.notes)
    note = next(n for n in mixed.notes if n.startswith("the line mixes OpenRLHF 0.11 option names"))
    assert "--generate_max_len, --prompt_max_len" in note and "0.11.2's own parser rejects them" in note
    assert "--train.micro_batch_size 1, --rollout.micro_batch_size 1" in note


def test_the_0_11_parser_rejects_the_flat_names():
    with pytest.raises(Exception, match="prompt_max_len"):
        parser.parse_args(["--prompt_max_len", "1024"])


def test_flat_only_line_keeps_the_v0_8_defaults():
    flat = ("python3 -m openrlhf.cli.train_ppo_ray --pretrain x --reward_pretrain x --actor_num_gpus_per_node 8 "
            "--ref_num_gpus_per_node 8 --reward_num_gpus_per_node 8 --critic_num_gpus_per_node 8 --colocate_all_models "
            "--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --train_batch_size 128 --rollout_batch_size 1024 "
            "--zero_stage 3 --bf16")
    imp = import_openrlhf(flat, model="llama-3.1-8b")
    by = {c.model_stage: c for c in imp.layout}
    assert by["actor.train"].micro_batch == int(LEGACY_DEFAULTS["--micro_train_batch_size"])
    assert any("defaults of OpenRLHF v0.8.0 filled in" in n for n in imp.notes)
