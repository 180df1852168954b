"""Multi-process parity of the runtime's TP/PP/DP layouts against a single-process reference.

One launch of 4 gloo workers runs every check (starting processes costs seconds): forward logits and
gradients of layouts (tp, pp, dp) in LAYOUTS, one PPO actor update and one critic update under
(2,1,2) and (1,1,1), KV-cache generation under several layouts, the weight sync between layouts,
and the logical state gathered after the update. The reference is an independent plain-PyTorch
Llama over the full weights (no KV cache, no sharding) with ``torch.optim.Adam``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from nereus.runtime.comm.parallel import Layout  # noqa: E402
from nereus.runtime.model.sharding import init_full_params  # noqa: E402
from nereus.runtime.rl import algorithms as alg  # noqa: E402
from nereus.runtime.run.local import run_local  # noqa: E402
from nereus.runtime.worker.engine import AdamConfig  # noqa: E402
from nereus.runtime.worker.rollout import gumbel_noise  # noqa: E402
from nereus.spec.model import ModelSpec  # noqa: E402
from nereus.spec.presets import MODEL_PRESETS  # noqa: E402

SPEC = MODEL_PRESETS["tiny"]
# From a Hugging Face-style config: Qwen3-style q/k norms, tied embeddings, one KV head (replicated at
# tp=2), a vocabulary of 61 (padded to 62 at tp=2).
HF_SPEC = ModelSpec.from_hf_config({"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                                    "head_dim": 8, "vocab_size": 61, "tie_word_embeddings": True}, name="hf")
VSPEC = SPEC.value_head()
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (4, 1, 1), (1, 4, 1), (2, 1, 2)]
GEN_LAYOUTS = [(1, 1, 1), (2, 2, 1), (4, 1, 1), (1, 1, 2)]
VARIANTS = [((1, 4, 1), "gpipe", {"schedule": "gpipe"}), ((2, 2, 1), "gpipe", {"schedule": "gpipe"}),
            ((2, 2, 1), "full", {"recompute": "full"}), ((2, 1, 1), "selective", {"recompute": "selective"})]
N, T, P, R, MB = 8, 10, 5, 5, 2
LR = 1e-2
# Adam's first step is lr·g/(|g|+eps): a gradient near zero turns an fp32 reduction-order error δ
# (~1e-7 of the largest gradient here) into a weight error up to lr·δ/eps. eps=1e-3 bounds it by ~2e-6;
# the moments themselves are compared directly.
EPS = 1e-3
TOL = 2e-5


# ---------------------------------------------------------------------- independent reference
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, theta):
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * freqs[None]
    c, s = torch.cos(ang).float(), torch.sin(ang).float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def ref_forward(W, spec, ids):
    """Logits [B, T, V] (or values [B, T]) of the full model."""
    B, L = ids.shape
    nh, g, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    x = W["model.embed_tokens.weight"][ids]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"], spec.rms_norm_eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, L, nh, d).transpose(1, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, L, g, d).transpose(1, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, L, g, d).transpose(1, 2)
        if spec.qk_norm:
            q = _rms(q, W[p + "self_attn.q_norm.weight"], spec.rms_norm_eps)
            k = _rms(k, W[p + "self_attn.k_norm.weight"], spec.rms_norm_eps)
        q, k = _rope(q, spec.rope_theta), _rope(k, spec.rope_theta)
        k = torch.stack([k[:, j // (nh // g)] for j in range(nh)], 1)
        v = torch.stack([v[:, j // (nh // g)] for j in range(nh)], 1)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(B, L, nh * d)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = _rms(x, W[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        m = torch.nn.functional.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + m @ W[p + "mlp.down_proj.weight"].T
    x = _rms(x, W["model.norm.weight"], spec.rms_norm_eps)
    if spec.head == "value":
        return (x @ W["score.weight"].T + W["score.bias"]).squeeze(-1)
    return x @ (W["model.embed_tokens.weight"] if spec.tie_word_embeddings else W["lm_head.weight"]).T


def ref_generate(W, spec, prompts, seeds, greedy):
    """Token-by-token generation without a KV cache: argmax over the full vocabulary of the logits, plus
    (sampling) the noise of (seed, step, id) (``rollout.gumbel_noise``, tested in test_runtime_sampling.py)."""
    V = spec.vocab_size
    seq = prompts.clone()
    for s in range(R):
        logits = ref_forward(W, spec, seq)[:, -1]
        if greedy:
            nxt = logits.argmax(-1)
        else:
            nxt = (logits + gumbel_noise(seeds, s, 0, V)).argmax(-1)
        seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, prompts.shape[1]:]


def make_batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, SPEC.vocab_size, (N, T), generator=g)
    mask = torch.ones(N, R)
    mask[0, 3:] = 0
    mask[5, 2:] = 0
    return {"tokens": tokens, "mask": mask, "old_logp": -torch.rand(N, R, generator=g) * 3,
            "adv": torch.randn(N, R, generator=g), "ref_logp": -torch.rand(N, R, generator=g) * 3,
            "old_values": torch.randn(N, R, generator=g) * 0.1, "returns": torch.randn(N, R, generator=g)}


ACTOR_LOSS = {"kind": "actor", "prompt_len": P, "clip": 0.2, "kl_coef": 0.1, "temperature": 1.0}
CRITIC_LOSS = {"kind": "critic", "prompt_len": P, "clip": 0.5}


def _share(x, dp, d):
    return x.chunk(dp)[d]


# ---------------------------------------------------------------------- the rank program
def _rank_main(core, batch):
    from nereus.runtime.comm.groups import new_group

    # all 4 processes meet once under a generous timeout: start-up skew is not a collective failure
    new_group(core.store, "par/warm", (0, 1, 2, 3), core.id, core.meter, timeout_s=120.0).all_reduce(torch.ones(1))
    out = {"fwd": {}, "grad": {}, "gen": {}, "ppo": {}}
    tokens = batch["tokens"]
    denom = float(N * (T - 1))
    for tp, pp, dp in LAYOUTS:
        n = tp * pp * dp
        if core.id >= n:
            continue
        lay = Layout(tp, pp, dp, tuple(range(n)))
        name = f"m{tp}{pp}{dp}"
        d, p, t = core.build(name, SPEC, lay, seed=0, trainable=False, tag="par")
        share = _share(tokens, dp, d)
        logits = core.forward(name, share, MB)
        if p == pp - 1 and t == 0:
            out["fwd"][(tp, pp, dp, d)] = logits
        core.backward_lm(name, share, MB, denom)
        grads = core.gather(name, "grads")
        if core.id == 0:
            out["grad"][(tp, pp, dp)] = grads
        core.destroy(name)
    # a model from a Hugging Face-style config (q/k norms, tied embeddings, padded vocab, 1 KV head)
    if core.id < 2:
        hf_tokens = tokens % HF_SPEC.vocab_size
        core.build("hf", HF_SPEC, Layout(2, 1, 1, (0, 1)), seed=3, trainable=False, tag="hf")
        logits = core.forward("hf", hf_tokens, MB)
        core.backward_lm("hf", hf_tokens, MB, denom)
        g = core.gather("hf", "grads")
        if core.id == 0:
            out["hf"] = (logits, g)
        core.destroy("hf")
    # the GPipe schedule (the loop above used 1F1B) and activation recomputation
    for (tp, pp, dp), key, kw in VARIANTS:
        n = tp * pp * dp
        if core.id >= n:
            continue
        core.build("v", SPEC, Layout(tp, pp, dp, tuple(range(n))), seed=0, trainable=False,
                   tag=f"v{key}{tp}{pp}", **kw)
        core.backward_lm("v", tokens, MB, denom)
        g = core.gather("v", "grads")
        if core.id == 0:
            out["grad"][(tp, pp, dp, key)] = g
        core.destroy("v")
    # 1F1B keeps fewer micro-batches of activations alive than GPipe (8 micro-batches, pp=4)
    for sch in ("gpipe", "1f1b"):
        core.build(f"mem_{sch}", SPEC, Layout(1, 4, 1, (0, 1, 2, 3)), seed=0, trainable=False, tag=f"mem{sch}",
                   schedule=sch)
        core.backward_lm(f"mem_{sch}", tokens, 1, denom)
        core.destroy(f"mem_{sch}")
    peaks = core.measurements()["peak_bytes_by_stage"]
    out["mem"] = (peaks["mem_gpipe"], peaks["mem_1f1b"])
    seeds = list(range(100, 100 + N))
    prompts = tokens[:, :P]
    for tp, pp, dp in GEN_LAYOUTS:
        n = tp * pp * dp
        if core.id >= n:
            continue
        lay = Layout(tp, pp, dp, tuple(range(n)))
        name = f"g{tp}{pp}{dp}"
        d, p, t = core.build(name, SPEC, lay, seed=0, trainable=False, tag="gen")
        for greedy in (False, True):
            resp = core.generate(name, _share(prompts, dp, d), _share(torch.tensor(seeds), dp, d).tolist(), R,
                                 1.0, greedy, eos_id=-1)
            if p == 0 and t == 0:
                out["gen"][(tp, pp, dp, d, greedy)] = resp
        core.destroy(name)
    # waves of at most 3 sequences (a KV-cache budget): the same tokens, sampling is per sequence
    if core.id < 2:
        core.build("waves", SPEC, Layout(1, 2, 1, (0, 1)), seed=0, trainable=False, tag="waves")
        resp = core.generate("waves", prompts, seeds, R, 1.0, False, eos_id=-1, concurrency=3)
        if core.id == 0:
            out["gen"][("waves",)] = resp
        core.destroy("waves")
    # bf16 forward-only model-stage (what "auto" picks on a bf16 GPU), layout (2,2,1)
    d, p, t = core.build("bf16", SPEC, Layout(2, 2, 1, (0, 1, 2, 3)), seed=0, trainable=False, tag="bf",
                         dtype="bfloat16")
    logits = core.forward("bf16", tokens, MB)
    resp = core.generate("bf16", prompts, seeds, R, 1.0, False, eos_id=-1)
    if p == 1 and t == 0:
        out["bf16"] = logits
    if p == 0 and t == 0:
        out["bf16_gen"] = resp
    core.destroy("bf16")
    # One PPO actor update and one critic update under (1,1,1) and (2,1,2).
    denom_r = float(batch["mask"].sum())
    for tp, pp, dp in [(1, 1, 1), (2, 1, 2)]:
        n = tp * pp * dp
        lay = Layout(tp, pp, dp, tuple(range(n)))
        if core.id < n:
            d, p, t = core.build(f"a{tp}{pp}{dp}", SPEC, lay, 0, True, AdamConfig(lr=LR, eps=EPS), tag="ppo")
            core.build(f"c{tp}{pp}{dp}", VSPEC, lay, 1, True, AdamConfig(lr=LR, eps=EPS), tag="ppo")
            sub = {k: _share(v, dp, d) for k, v in batch.items()}
            ma = core.train(f"a{tp}{pp}{dp}", sub, ACTOR_LOSS, MB, denom_r, position=1)
            mc = core.train(f"c{tp}{pp}{dp}", sub, CRITIC_LOSS, MB, denom_r, position=1)
            sa = core.gather_logical_state(f"a{tp}{pp}{dp}")
            sc = core.gather_logical_state(f"c{tp}{pp}{dp}")
            if core.id == 0:
                out["ppo"][(tp, pp, dp)] = {"actor": sa, "critic": sc}
            if p == pp - 1 and t == 0:
                out["ppo"][(tp, pp, dp, "metrics", d)] = (ma, mc)
    # Weight sync: actor (2,1,2) on workers 0-3 -> a (1,2,1) layout on workers 2,3 built from another seed.
    gl = Layout(1, 2, 1, (2, 3))
    if core.id in gl.workers:
        core.build("gen121", SPEC, gl, seed=123, trainable=False, tag="sync")
    core.sync_weights("a212", "gen121", Layout(2, 1, 2, (0, 1, 2, 3)), gl, SPEC, policy_version=1, tag="sync")
    if core.id in gl.workers:
        st = core.gather_logical_state("gen121")
        if core.id == 2:
            out["sync"] = st
    out["meas"] = core.measurements()
    return out


# ---------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def results():
    batch = make_batch()
    res = run_local(4, _rank_main, (batch,), timeout_s=240, group_timeout_s=30)
    merged = {"fwd": {}, "grad": {}, "gen": {}, "ppo": {}}
    for r in res:
        for k in merged:
            merged[k].update(r[k])
    merged["sync"] = res[2]["sync"]
    merged["hf"] = res[0]["hf"]
    merged["mem"] = [r["mem"] for r in res]
    merged["bf16"] = res[2]["bf16"]
    merged["bf16_gen"] = res[0]["bf16_gen"]
    merged["meas"] = [r["meas"] for r in res]
    return batch, merged


def _maxdiff(a, b):
    return float((a - b).abs().max())


@pytest.mark.slow
def test_forward_and_grad_parity(results):
    batch, res = results
    W = {k: v.clone().requires_grad_(True) for k, v in init_full_params(SPEC, 0).items()}
    tokens = batch["tokens"]
    logits = ref_forward(W, SPEC, tokens)
    denom = float(N * (T - 1))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, SPEC.vocab_size),
                                             tokens[:, 1:].reshape(-1), reduction="sum") / denom
    loss.backward()
    report = {}
    for tp, pp, dp in LAYOUTS:
        got = torch.cat([res["fwd"][(tp, pp, dp, d)] for d in range(dp)])
        fd = _maxdiff(got, logits.detach())
        gd = max(_maxdiff(res["grad"][(tp, pp, dp)][n], W[n].grad) for n in W)
        report[(tp, pp, dp)] = (fd, gd)
        assert fd < TOL, f"logits of layout {(tp, pp, dp)} differ by {fd}"
        assert gd < TOL, f"grads of layout {(tp, pp, dp)} differ by {gd}"
    for lay, key, _ in VARIANTS:
        gd = max(_maxdiff(res["grad"][lay + (key,)][n], W[n].grad) for n in W)
        assert gd < TOL, f"grads of layout {lay} with {key} differ by {gd}"
    print("max abs diff (logits, grads) per layout:", report)


@pytest.mark.slow
def test_bf16_forward_close_to_fp32_reference(results):
    batch, res = results
    W = init_full_params(SPEC, 0)
    with torch.no_grad():
        ref = ref_forward(W, SPEC, batch["tokens"])
    got = res["bf16"]
    assert got.dtype == torch.float32 and got.shape == ref.shape
    rel = float((got - ref).abs().max() / ref.abs().max())
    print(f"bf16 (2,2,1) logits: max abs diff / max |ref| = {rel:.4f}")
    assert rel < 0.05, rel
    gen = res["bf16_gen"]
    assert gen.shape == (N, R) and int(gen.min()) >= 0 and int(gen.max()) < SPEC.vocab_size


def test_dtype_resolution():
    from nereus.runtime.worker.device import resolve_dtype

    assert resolve_dtype("auto", False, "cpu") == torch.float32
    assert resolve_dtype("auto", True, "cpu") == torch.float32
    assert resolve_dtype("bfloat16", False, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="training keeps fp32"):
        resolve_dtype("bfloat16", True, "cpu")
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp8", False, "cpu")


@pytest.mark.slow
def test_1f1b_holds_fewer_activations_than_gpipe(results):
    _, res = results
    print("tracked peak bytes per PP rank (gpipe, 1f1b):", res["mem"])
    for gpipe, one_f_one_b in res["mem"]:
        assert one_f_one_b < gpipe


@pytest.mark.slow
def test_hf_config_model_parity(results):
    batch, res = results
    W = {k: v.clone().requires_grad_(True) for k, v in init_full_params(HF_SPEC, 3).items()}
    assert "lm_head.weight" not in W and "model.layers.0.self_attn.q_norm.weight" in W
    tokens = batch["tokens"] % HF_SPEC.vocab_size
    logits = ref_forward(W, HF_SPEC, tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, HF_SPEC.vocab_size),
                                             tokens[:, 1:].reshape(-1), reduction="sum") / float(N * (T - 1))
    loss.backward()
    got_logits, grads = res["hf"]
    assert got_logits.shape == (N, T, HF_SPEC.vocab_size)
    assert _maxdiff(got_logits, logits.detach()) < TOL
    assert max(_maxdiff(grads[n], W[n].grad) for n in W) < TOL


@pytest.mark.slow
def test_generation_matches_uncached_reference(results):
    batch, res = results
    W = init_full_params(SPEC, 0)
    prompts = batch["tokens"][:, :P]
    seeds = list(range(100, 100 + N))
    with torch.no_grad():
        for greedy in (False, True):
            ref = ref_generate(W, SPEC, prompts, seeds, greedy)
            for tp, pp, dp in GEN_LAYOUTS:
                got = torch.cat([res["gen"][(tp, pp, dp, d, greedy)] for d in range(dp)])
                assert torch.equal(got, ref), f"generation of layout {(tp, pp, dp)} greedy={greedy}"
            if not greedy:
                assert torch.equal(res["gen"][("waves",)], ref)


def _ref_update(spec, seed, loss_fn):
    W = {k: v.clone().requires_grad_(True) for k, v in init_full_params(spec, seed).items()}
    opt = torch.optim.Adam(list(W.values()), lr=LR, eps=EPS)
    out = ref_forward(W, spec, make_batch()["tokens"])
    loss = loss_fn(out)
    loss.backward()
    opt.step()
    return W, opt, float(loss.detach())


@pytest.mark.slow
def test_ppo_update_parity(results):
    batch, res = results
    denom = float(batch["mask"].sum())

    def actor_loss(logits):
        lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, batch["tokens"][:, P:, None]).squeeze(-1)
        ratio = torch.exp(lp - batch["old_logp"])
        a = batch["adv"]
        pg = (torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.2) * a) * batch["mask"]).sum() / denom
        d = batch["ref_logp"] - lp
        kl = ((torch.exp(d) - d - 1) * batch["mask"]).sum() / denom
        return pg + 0.1 * kl

    def critic_loss(values):
        v = values[:, P - 1:-1]
        vc = batch["old_values"] + (v - batch["old_values"]).clamp(-0.5, 0.5)
        return 0.5 * (torch.maximum((v - batch["returns"]) ** 2, (vc - batch["returns"]) ** 2)
                      * batch["mask"]).sum() / denom

    for role, spec, seed, fn in (("actor", SPEC, 0, actor_loss), ("critic", VSPEC, 1, critic_loss)):
        W, opt, ref_loss = _ref_update(spec, seed, fn)
        for lay in [(1, 1, 1), (2, 1, 2)]:
            st = res["ppo"][lay][role]
            assert st["update_count"] == 1 and st["step"] == 1 and st["position"] == 1
            pd = max(_maxdiff(st["params"][n], W[n].detach()) for n in W)
            md = max(_maxdiff(st["exp_avg"][n], opt.state[W[n]]["exp_avg"]) for n in W)
            vd = max(_maxdiff(st["exp_avg_sq"][n], opt.state[W[n]]["exp_avg_sq"]) for n in W)
            assert pd < TOL and md < TOL and vd < 1e-9, (role, lay, pd, md, vd)
            loss = sum(res["ppo"][lay + ("metrics", d)][0 if role == "actor" else 1]["loss"]
                       for d in range(lay[2]))
            assert abs(loss - ref_loss) < 1e-5, (role, lay, loss, ref_loss)
        # parameters actually moved
        init = init_full_params(spec, seed)
        assert max(_maxdiff(res["ppo"][(2, 1, 2)][role]["params"][n], init[n]) for n in W) > 1e-4


@pytest.mark.slow
def test_weight_sync_and_measurements(results):
    _, res = results
    src = res["ppo"][(2, 1, 2)]["actor"]["params"]
    got = res["sync"]["params"]
    assert set(got) == set(src)
    for n in src:
        assert torch.equal(got[n], src[n]), n
    assert res["sync"]["policy_version"] == 1 and res["sync"]["version"] == 1
    for m in res["meas"]:
        ops = m["op_seconds"]
        assert ops["gemm"] > 0 and ops["attention"] > 0 and m["peak_bytes"] > 0
        assert m["bytes_sent"] > 0
    w0 = res["meas"][0]["op_seconds"]
    for k in ("allreduce@gloo", "allgather@gloo", "broadcast@gloo", "p2p@gloo"):
        assert w0.get(k, 0) > 0, k


def test_pure_losses_by_hand():
    # GAE on one sequence of 3 tokens, gamma=1, lam=0.5: hand-computed.
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.4]])
    m = torch.ones(1, 3)
    adv, ret = alg.gae(r, v, m, gamma=1.0, lam=0.5)
    d2 = 1.0 - 0.4
    d1 = 0.0 + 0.4 - 0.2
    d0 = 0.0 + 0.2 - 0.5
    a2, a1 = d2, d1 + 0.5 * d2
    a0 = d0 + 0.5 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + v)
    # masked tail: the value after the last valid token must not leak in
    m2 = torch.tensor([[1.0, 1.0, 0.0]])
    adv2, _ = alg.gae(torch.tensor([[0.0, 1.0, 0.0]]), v, m2, gamma=1.0, lam=1.0)
    assert torch.allclose(adv2, torch.tensor([[-0.3 + 0.8, 0.8, 0.0]]))
    # GRPO: group of 2 with scores 1, 0 -> +-1/sqrt(2)/... unbiased std = sqrt(0.5)
    a = alg.grpo_advantages(torch.tensor([1.0, 0.0]), 2, torch.ones(2, 1), eps=0.0)
    assert torch.allclose(a.squeeze(1), torch.tensor([0.5, -0.5]) / math.sqrt(0.5))
    # ReMax: reward-to-go minus baseline
    a = alg.remax_advantages(torch.tensor([[0.1, 0.0, 1.0]]), torch.tensor([0.5]), torch.ones(1, 3))
    assert torch.allclose(a, torch.tensor([[0.6, 0.5, 0.5]]))
    # token rewards: KL penalty per token and the score on the last valid token
    tr = alg.token_rewards(torch.tensor([2.0]), torch.tensor([[-1.0, -1.0, -1.0]]),
                           torch.tensor([[-1.5, -1.0, -0.5]]), torch.tensor([[1.0, 1.0, 0.0]]), 0.1)
    assert torch.allclose(tr, torch.tensor([[-0.05, 2.0, 0.0]]))
    # clipped policy loss: ratio e^0.5 > 1.2 with A>0 is clipped at 1.2
    loss, clipped = alg.policy_loss(torch.tensor([[0.5]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                                    torch.ones(1, 1), 0.2, 1.0)
    assert abs(float(loss) + 1.2) < 1e-6 and float(clipped) == 1.0
    assert float(alg.kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0


# ---------------------------------------------------------------------- timeouts and bad layouts
def _comm_main(core):
    import time

    from nereus.runtime.comm.groups import CommError, new_group
    from nereus.runtime.comm.parallel import build_context

    out = {}
    # rendezvous first under a generous timeout (process start-up skews), then the short-timeout group
    new_group(core.store, "t/warm", (0, 1), core.id, core.meter, timeout_s=60.0).all_reduce(torch.ones(1))
    g = new_group(core.store, "t/pair", (0, 1), core.id, core.meter, timeout_s=2.0)
    x = torch.ones(4) * (core.id + 1)
    g.all_reduce(x)
    out["sum"] = x.clone()
    if core.id == 0:  # the peer never joins this all-reduce: it must fail, not hang
        t0 = time.perf_counter()
        try:
            g.all_reduce(torch.ones(4))
            out["error"] = None
        except CommError as e:
            out["error"] = str(e)
        out["elapsed"] = time.perf_counter() - t0
    else:
        time.sleep(5.0)
    try:
        build_context(SPEC, Layout(3, 1, 1, (0, 1, 2)), core.id, core.store, "t/bad", core.meter, 2.0)
    except ValueError as e:
        out["bad_tp"] = str(e)
    try:
        new_group(core.store, "t/x", (5, 6), core.id, core.meter)
    except ValueError as e:
        out["not_member"] = str(e)
    return out


@pytest.mark.slow
def test_collective_timeout_and_layout_errors():
    r0, r1 = run_local(2, _comm_main, timeout_s=60)
    assert torch.equal(r0["sum"], torch.full((4,), 3.0))
    assert r0["error"] is not None and "allreduce" in r0["error"] and "t/pair" in r0["error"]
    assert r0["elapsed"] < 30
    assert "tp=3 does not divide num_attention_heads=4" in r0["bad_tp"]
    assert "not a member" in r1["not_member"]
