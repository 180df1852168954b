"""Hugging Face checkpoints in the runtime, against ``transformers`` as the reference implementation.

Small random models are created and saved with ``transformers`` at test time (weights perturbed so
biases and norms are not trivial): Llama with ``attention_bias`` and llama3 RoPE scaling, Qwen2 (q/k/v
biases) in a split checkpoint with an index file, Qwen3 (q/k norms) with tied embeddings, and a Llama
with ``gelu_pytorch_tanh``. One launch of 4 gloo workers loads each under several (tp, pp) layouts, each
worker reading only its own shard, and checks:

* logits against ``transformers``' forward (fp32, atol 1e-5), also with left-padded prompts;
* vocab-parallel log-probs against ``log_softmax`` of ``transformers``' logits;
* greedy generation against ``transformers``' greedy ``generate``, token for token;
* vocab-parallel sampled generation: the same tokens under every layout, those of the Gumbel-max rule
  applied to ``transformers``' full-vocabulary logits with the same noise;
* one PPO update of the tied model under (1,1,1) and (2,2,1) (tied copies under PP, gradients summed)
  gives the same parameters; the result saved as a Hugging Face directory loads in ``transformers``
  with logits equal to the runtime's.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

transformers = pytest.importorskip("transformers")

from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.run.local import run_local  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.runtime.worker.rollout import gumbel_noise  # noqa: E402
from nereus.spec.model import ModelSpec  # noqa: E402
from nereus.spec.presets import get_model  # noqa: E402

V = 61  # odd: vocab padding at tp=2 and tp=4
BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=V, max_position_embeddings=128, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
MODELS = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(attention_bias=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                    rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=8)),
    "gelu": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu_pytorch_tanh", num_key_value_heads=1)),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]
N, T, P, R, MB = 4, 9, 4, 6, 2
PAD = 0
SEEDS, TEMP = [11, 12, 13, 14], 0.8  # sampled generation: one seed per prompt (N = 4)


def _make(root, key):
    cfg_cls, model_cls, extra = MODELS[key]
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    torch.manual_seed(hash(key) % 1000)
    m = getattr(transformers, model_cls)(cfg).float().eval()
    with torch.no_grad():
        for _n, p in m.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    d = root / key
    m.save_pretrained(d, max_shard_size="40KB" if key == "qwen2" else "50GB")
    return str(d), m


def _rank_main(core, dirs, tokens, padded, prompts, tied_batch, outdir):
    from nereus.runtime.comm.groups import new_group

    new_group(core.store, "hf/warm", (0, 1, 2, 3), core.id, core.meter, timeout_s=120.0).all_reduce(torch.ones(1))
    out = {"fwd": {}, "lp": {}, "pad": {}, "gen": {}, "sample": {}, "train": {}}
    for key, d in dirs.items():
        spec = get_model(d)
        pspec = replace(spec, extra={"pad_id": PAD})
        for tp, pp in LAYOUTS:
            if core.id >= tp * pp:
                continue
            lay = Layout(tp, pp, 1, tuple(range(tp * pp)))
            ms = f"{key}{tp}{pp}"
            _, p, t = core.build(ms, spec, lay, seed=0, trainable=False, tag=ms)
            logits = core.forward(ms, tokens, MB)
            lp = core.logprobs(ms, tokens, P, MB)
            gen = core.generate(ms, prompts, [0] * prompts.shape[0], R, greedy=True, eos_id=-1)
            sgen = core.generate(ms, prompts, SEEDS, R, TEMP, greedy=False, eos_id=-1)
            core.destroy(ms)
            core.build(ms + "p", pspec, lay, seed=0, trainable=False, tag=ms + "p")
            lpad = core.forward(ms + "p", padded, MB)
            core.destroy(ms + "p")
            if p == pp - 1 and t == 0:
                out["fwd"][(key, tp, pp)] = logits
                out["lp"][(key, tp, pp)] = lp
                out["pad"][(key, tp, pp)] = lpad
            if p == 0 and t == 0:
                out["gen"][(key, tp, pp)] = gen
                out["sample"][(key, tp, pp)] = sgen
    # one PPO update of the tied model under (1,1,1) and (2,2,1), then saved; eps 1e-3 keeps Adam from
    # turning fp32 reduction-order noise in near-zero gradients into lr-sized weight differences
    spec = get_model(dirs["qwen3tied"])
    loss = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}
    for tp, pp in [(1, 1), (2, 2)]:
        if core.id >= tp * pp:
            continue
        ms = f"t{tp}{pp}"
        core.build(ms, spec, Layout(tp, pp, 1, tuple(range(tp * pp))), 0, True, AdamConfig(lr=1e-2, eps=1e-3), tag=ms)
        core.train(ms, tied_batch, loss, MB, float(tied_batch["mask"].sum()), position=1)
        st = core.gather_logical_state(ms)
        core.save_hf(ms, os.path.join(outdir, ms))
        logits = core.forward(ms, tokens, MB)
        if core.id == 0:
            out["train"][(tp, pp)] = st["params"]
        if core.id == tp * pp - tp:
            out["train"][(tp, pp, "logits")] = logits
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs, models = {}, {}
    for key in MODELS:
        dirs[key], models[key] = _make(root, key)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, V, (N, T), generator=g)
    padded = tokens.clone()
    padded[0, :3] = PAD
    padded[2, :1] = PAD
    prompts = tokens[:, :P].clone()
    tied_batch = {"tokens": tokens, "mask": torch.ones(N, T - P), "old_logp": -torch.rand(N, T - P, generator=g) * 3,
                  "adv": torch.randn(N, T - P, generator=g)}
    outdir = str(root / "saved")
    res = run_local(4, _rank_main, (dirs, tokens, padded, prompts, tied_batch, outdir), timeout_s=280,
                    group_timeout_s=60)
    merged = {k: {} for k in res[0]}
    for r in res:
        for k in merged:
            merged[k].update(r[k])
    return dirs, models, tokens, padded, prompts, merged, outdir


@pytest.mark.slow
def test_logits_and_logprobs_match_transformers(results):
    dirs, models, tokens, _padded, _prompts, res, _ = results
    worst = {}
    for key, m in models.items():
        with torch.no_grad():
            ref = m(tokens).logits.float()
        ref_lp = torch.log_softmax(ref[:, P - 1:-1], -1).gather(-1, tokens[:, P:, None]).squeeze(-1)
        for tp, pp in LAYOUTS:
            got = res["fwd"][(key, tp, pp)]
            assert got.shape == ref.shape
            e = float((got - ref).abs().max())
            el = float((res["lp"][(key, tp, pp)] - ref_lp).abs().max())
            worst[(key, tp, pp)] = (e, el)
            assert e < 1e-5, f"{key} (tp={tp}, pp={pp}): logits differ from transformers by {e}"
            assert el < 1e-5, f"{key} (tp={tp}, pp={pp}): log-probs differ from transformers by {el}"
    print("max |logits - transformers|, |logprobs - transformers| per (model, tp, pp):", worst)


@pytest.mark.slow
def test_left_padding_matches_transformers_attention_mask(results):
    _dirs, models, _tokens, padded, _prompts, res, _ = results
    mask = (torch.cumprod((padded == PAD).long(), 1) == 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for key, m in models.items():
        with torch.no_grad():
            ref = m(padded, attention_mask=mask, position_ids=pos).logits.float()
        for tp, pp in LAYOUTS:
            got = res["pad"][(key, tp, pp)]
            e = float(((got - ref).abs() * mask[..., None]).max())
            assert e < 1e-5, f"{key} (tp={tp}, pp={pp}) left-padded: logits differ by {e}"


@pytest.mark.slow
def test_greedy_generation_matches_transformers(results):
    _dirs, models, _tokens, _padded, prompts, res, _ = results
    for key, m in models.items():
        with torch.no_grad():
            ref = m.generate(prompts, max_new_tokens=R, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None)[:, P:]
        for tp, pp in LAYOUTS:
            assert torch.equal(res["gen"][(key, tp, pp)], ref), f"{key} (tp={tp}, pp={pp}) greedy tokens differ"


@pytest.mark.slow
def test_sampling_is_layout_independent_and_follows_transformers_logits(results):
    """Vocab-parallel sampling (padded vocab at tp=2 and 4): every layout draws the same tokens, those of
    argmax(logits/T + noise) over transformers' full-vocabulary logits, token by token."""
    _dirs, models, _tokens, _padded, prompts, res, _ = results
    for key, m in models.items():
        seq = prompts.clone()
        with torch.no_grad():
            for s in range(R):
                logits = m(seq).logits[:, -1].float()
                nxt = (logits / TEMP + gumbel_noise(SEEDS, s, 0, V)).argmax(-1)
                seq = torch.cat([seq, nxt[:, None]], 1)
        ref = seq[:, P:]
        for tp, pp in LAYOUTS:
            assert torch.equal(res["sample"][(key, tp, pp)], ref), f"{key} (tp={tp}, pp={pp}) sampled tokens differ"


@pytest.mark.slow
def test_tied_update_under_pp_and_save_round_trip(results):
    dirs, _models, tokens, _padded, _prompts, res, outdir = results
    a, b = res["train"][(1, 1)], res["train"][(2, 2)]
    assert set(a) == set(b)
    diff = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert diff < 2e-5, f"tied PPO update (2,2,1) vs (1,1,1) differs by {diff}"
    before = transformers.AutoModelForCausalLM.from_pretrained(dirs["qwen3tied"], dtype=torch.float32)
    moved = float((before.model.embed_tokens.weight.detach() - a["model.embed_tokens.weight"]).abs().max())
    assert moved > 1e-4  # the update changed the tied embedding
    for tp, pp in [(1, 1), (2, 2)]:
        d = os.path.join(outdir, f"t{tp}{pp}")
        assert json.load(open(os.path.join(d, "config.json")))["architectures"] == ["Qwen3ForCausalLM"]
        m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = m(tokens).logits.float()
        e = float((res["train"][(tp, pp, "logits")] - ref).abs().max())
        assert e < 1e-5, f"saved (tp={tp}, pp={pp}) model's logits differ from the runtime's by {e}"
        # round trip: the saved directory is again a checkpoint the runtime reads
        assert get_model(d).checkpoint == os.path.realpath(d)


def test_config_fields_read_and_refused(tmp_path):
    q2 = transformers.Qwen2Config(**BASE).to_dict()
    s = ModelSpec.from_hf_config(q2)
    assert s.qkv_bias and not s.o_bias and s.model_type == "qwen2"
    ll = transformers.LlamaConfig(**{**BASE, **MODELS["llama3"][2]}).to_dict()
    s = ModelSpec.from_hf_config(ll)
    assert s.qkv_bias and s.o_bias and dict(s.rope_scaling)["rope_type"] == "llama3"
    assert ModelSpec.from_hf_config(s.to_hf_config()) == s
    # parameter counts include biases: q/k/v a·d + 2·g·d, o h
    h, a, g, dd = 32, 4, 2, 8
    assert s.bias_params_per_layer == a * dd + 2 * g * dd + h
    moe = {**q2, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768}
    with pytest.raises(ValueError, match="'num_experts'=128: mixture-of-experts"):
        ModelSpec.from_hf_config(moe)
    for field, value, match in [("use_sliding_window", True, "sliding-window"),
                                ("hidden_act", "swish", "'hidden_act'='swish'"),
                                ("mlp_bias", True, "'mlp_bias'"),
                                ("model_type", "gemma2", "'model_type'='gemma2'"),
                                ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'")]:
        with pytest.raises(ValueError, match=match):
            ModelSpec.from_hf_config({**q2, field: value})


@pytest.mark.parametrize("cmd", [["plan"], ["run", "--steps", "1"]])
def test_moe_config_refused_by_plan_and_run(tmp_path, capsys, cmd):
    from nereus.cli import main

    cfg = transformers.Qwen2Config(**BASE).to_dict() | {"model_type": "qwen3_moe", "num_experts": 128,
                                                         "num_experts_per_tok": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main([*cmd, "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "'num_experts'=128" in err and "mixture-of-experts" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags", [dict(qkv_bias=True), dict(qkv_bias=True, o_bias=True, tie_word_embeddings=True),
                                   dict(tie_word_embeddings=True, qk_norm=True)])
def test_cost_model_counts_equal_runtime_shards(flags):
    """``params_on_rank`` (planner) equals the elements of every rank's shards (runtime), biases and the
    tied output-layer copy under PP included, so moved bytes predicted and executed agree."""
    from nereus.cost.shapes import params_on_rank
    from nereus.runtime.model.sharding import names_of_stage, param_shapes
    from nereus.runtime.transit.plans import region

    spec = ModelSpec(name="b", hidden_size=16, intermediate_size=32, num_layers=4, num_attention_heads=4,
                     num_kv_heads=2, head_dim=4, vocab_size=37, **flags)
    for head in (spec, spec.value_head()):
        shapes = param_shapes(head)
        for tp in (1, 2, 4):
            for pp in (1, 2, 4):
                for p in range(pp):
                    for t in range(tp):
                        n = 0
                        for name in names_of_stage(head, pp, p):
                            r = region(head, name, tp, t)
                            shape = list(shapes[name][0])
                            if r.dim is not None:
                                shape[r.dim] = r.length
                            n += int(torch.Size(shape).numel())
                        assert n == params_on_rank(head, tp, pp, p), (flags, head.head, tp, pp, p)
