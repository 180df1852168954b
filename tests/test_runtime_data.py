"""Datasets in verl's layout, the model directory's tokenizer, the GSM8K-style reward, and
``nereus run --model DIR --data FILE`` end to end (a tiny Qwen2 saved by ``transformers``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nereus.runtime.rl.data import (  # noqa: E402
    DataTask,
    HFTokenizer,
    char_tokenizer,
    final_answer,
    write_arithmetic_dataset,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "tiny"
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=80, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return str(d)


def test_final_answer_rule():
    assert final_answer("so 3 + 4 = 7 #### 7") == "7"
    assert final_answer("the total is 1,234.0 dollars") == "1234"
    assert final_answer("first 5 then -12") == "-12"
    assert final_answer("no number") is None


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_data_task_prompts_order_and_reward(tmp_path, model_dir, ext):
    path = write_arithmetic_dataset(str(tmp_path / f"d.{ext}"), 10, seed=1)
    tok = HFTokenizer(model_dir)
    task = DataTask(path, tok, response_len=8)
    ids, idx = task.prompts(3, 4)
    assert ids.shape == (4, task.prompt_len) and idx == [3, 4, 5, 6]
    for j, i in enumerate(idx):  # left-padded with the pad id, the row's own tokens at the end
        row = task.ids[task.row_of(i)]
        assert ids[j, -len(row):].tolist() == row and set(ids[j, :-len(row)].tolist()) <= {tok.pad_id}
    # every row once per epoch, in an order that depends on the global index only
    assert sorted(task.row_of(i) for i in range(10)) == list(range(10))
    assert task.prompts(5, 2)[0].tolist() == ids[2:4].tolist()
    rows = [json.loads(x) for x in open(path)] if ext == "jsonl" else None
    truth = task.answers[task.row_of(3)]
    if rows is not None:
        assert truth == rows[task.row_of(3)]["reward_model"]["ground_truth"]
    right = tok.tok(f"so #### {truth}")["input_ids"] + [tok.eos_id, 5, 6]
    wrong = tok.tok(f"#### {int(truth) + 1}")["input_ids"] + [tok.eos_id]
    assert task.reward(3, right) == 1.0 and task.reward(3, wrong) == 0.0


def test_data_errors_name_the_field(tmp_path, model_dir):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="'reward_model.ground_truth'"):
        DataTask(str(p), HFTokenizer(model_dir))
    with pytest.raises(ValueError, match="extension '.csv'"):
        (tmp_path / "x.csv").write_text("a")
        DataTask(str(tmp_path / "x.csv"), HFTokenizer(model_dir))


@pytest.mark.slow
def test_nereus_run_with_model_dir_and_data(tmp_path, model_dir):
    data = write_arithmetic_dataset(str(tmp_path / "d.parquet"), 16)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "run", "--model", model_dir, "--data", data, "--steps", "2",
                        "--algo", "ppo", "--workers", "2", "--prompts", "2", "--samples", "2", "--mini-batch", "4",
                        "--micro-batch", "2", "--response-len", "6", "--save", str(out),
                        "--layout", "actor.train=1,2,1"], capture_output=True, text=True, env=env, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(re.findall(r"^step=\d", r.stdout, re.M)) == 2
    for ms in ("actor.generate", "actor.train", "critic.train", "reference.infer"):
        assert re.search(rf"^\s+{re.escape(ms)}\s+measured\s+[\d.]+\s+predicted\s+[\d.]+", r.stdout, re.M), r.stdout
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    c = transformers.AutoModelForTokenClassification.from_pretrained(out / "critic", dtype=torch.float32)
    assert m.config.tie_word_embeddings and c.config.num_labels == 1
    assert (out / "tokenizer.json").is_file()
    before = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not torch.equal(before.model.embed_tokens.weight, m.model.embed_tokens.weight)  # it trained
