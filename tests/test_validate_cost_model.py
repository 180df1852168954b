"""Structure of the cost-model validation benchmark (benchmarks/validate_cost_model.py): every CSV row
parsed with a named source, the conversions and errors checked by hand for one row. No figure of
merit and no wall-clock time is asserted (the cost model changes; the figures are in docs/planner.md)."""

import csv
import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from nereus.cost.efficiency import EfficiencyTable
from nereus.cost.model import CostModel
from nereus.spec.hardware import ClusterSpec, get_gpu
from nereus.spec.job import JobSpec
from nereus.spec.plan import Candidate
from nereus.spec.workload import WorkloadSpec
from nereus.workflow import ModelStage, Workflow

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "benchmarks" / "data" / "published_measurements.csv"
_spec = importlib.util.spec_from_file_location("validate_cost_model", ROOT / "benchmarks" / "validate_cost_model.py")
V = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = V  # dataclasses look their module up there
_spec.loader.exec_module(V)
import validation_data as VD  # noqa: E402  (the benchmark put benchmarks/ on sys.path)
import validation_report as VR  # noqa: E402

SOURCES = {"llm-foundry-h100", "llm-foundry-a100", "nemo-megatron-h100-fp8", "nemo-automodel-h100-bf16",
           "nemo-launcher-a100-bf16"}


@pytest.fixture(scope="module")
def rows():
    return VD.load_rows(CSV)


@pytest.fixture(scope="module")
def result(rows):
    # a subset keeps the test quick: a few rows of every source (the fits run on them)
    keep = [r for r in rows if r.id in ("F019", "F030", "F033", "F039", "F073", "F080", "F087", "F095",
                                        "N01", "N03", "N06", "N09", "A01", "L01", "L11")]
    return V.evaluate(keep)


def test_every_row_parsed_with_a_named_source(rows):
    with open(CSV, newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(rows) == len(raw) > 100
    assert {r.source for r in rows} == SOURCES
    assert len({r.id for r in rows}) == len(rows)
    for r in rows:
        # repository @ commit, file, and the table/row the number comes from
        assert "@" in r.reference and ("README.md" in r.reference or ".md" in r.reference), r.id
        assert r.tp * r.pp * r.cp * r.dp == r.num_gpus
        assert r.dp * r.micro_batch * r.grad_accum == r.global_batch
        assert r.precision in ("bf16", "fp8")
        VD.model_spec(r.model)  # every model maps to a preset or a config the benchmark defines


def test_conversions_by_hand(rows):
    by = {r.id: r for r in rows}
    # NeMo 24.07 LLAMA2-7B: 128 sequences x 4096 tokens / (16934 tokens/s/GPU x 8 GPUs)
    assert by["N01"].iter_time_s == pytest.approx(128 * 4096 / (16934 * 8), rel=1e-4)
    assert by["N01"].iter_time_s == pytest.approx(3.8700, abs=1e-4)
    # llm-foundry 70b on 64 H100: global batch 2048 x 2048 tokens / 66523 tokens/s
    assert by["F019"].iter_time_s == pytest.approx(2048 * 2048 / 66523, rel=1e-4)
    # AutoModel Llama3 70B: the published step time
    assert by["A01"].iter_time_s == 18.9
    # NeMo-Megatron-Launcher GPT-3 175B on 128 nodes: 2048 x 2048 tokens / 109684 tokens/s
    assert by["L11"].iter_time_s == pytest.approx(2048 * 2048 / 109684, rel=1e-4)
    # layout of the config at the commit that added the table (3579cdb3): TP8 PP8, micro-batch 2, SP,
    # selective recompute; 1024 GPUs / 64 = 16 replicas, 2048 / (16 x 2) = 64 micro-batches
    assert (by["L11"].tp, by["L11"].pp, by["L11"].dp, by["L11"].micro_batch, by["L11"].grad_accum,
            by["L11"].recompute, by["L11"].sp, by["L11"].vpp) == (8, 8, 16, 2, 64, "selective", 1, 1)
    # attention kernels named by the sources' configs
    assert by["L11"].attention_kernel == "unfused_dropout" and by["F019"].attention_kernel == "flash_triton"
    assert by["F001"].attention_kernel == "flash" and by["N01"].attention_kernel == "flash"
    # the MPT configs carry the published parameter counts (plus MPT's learned position embedding)
    m = VD.model_spec("mpt-7b")
    assert m.num_params + 2048 * 4096 == pytest.approx(6658859008, rel=5e-4)


def test_prediction_matches_an_independent_query(rows, result):
    """Row N01 rebuilt by hand (documented mapping: one 'reference.train' model-stage, global batch =
    mini-batch, prompt+response = sequence length) gives the benchmark's prediction and APE."""
    r = next(x for x in rows if x.id == "N01")
    wl = WorkloadSpec(algorithm="ppo", prompts_per_step=128, samples_per_prompt=1, prompt_len=2048,
                      response_len=2048, mini_batch_size=128, micro_batch_size=1, recompute="none",
                      reward_model=False, gemm_precision="fp8")  # N01 is an FP8 row
    caps = V.capabilities()
    assert caps["fp8"]
    kw = {}
    if caps["sp"]:
        from nereus.spec.framework import FrameworkSpec

        kw["framework"] = FrameworkSpec(name="validation", zero_stages=(0, 1), overlap_grad_reduce=True,
                                        overlap_tp_comm=False, grad_reduce_bytes=2, sequence_parallel=False)
    job = JobSpec(VD.model_spec("llama-2-7b"), ClusterSpec(get_gpu("h100"), 1, 8), wl, **kw)
    wf = Workflow(algorithm="ppo", model_stages=(ModelStage("reference", "train"),))
    ckw = {"zero": 1} if caps["zero"] else {}
    est = CostModel(job, workflow=wf).estimate_candidate(
        Candidate("reference.train", 1, 1, 8, micro_batch=1, grad_accum=16, **ckw))
    x = next(x for x in result["rows"] if x["id"] == "N01")
    assert x["predicted_s"] == pytest.approx(est.time, rel=1e-12)
    assert x["measured_s"] == pytest.approx(3.8700, abs=1e-4)
    assert x["ape"] == pytest.approx(100 * abs(est.time - r.iter_time_s) / r.iter_time_s, rel=1e-12)
    # GEMM seconds by hand: 6 x GEMM parameters (32 layers of 4h^2 + 3hF, plus the 4096 x 32000
    # head) x 65,536 tokens per GPU at H100's dense FP8 peak (1,979 TFLOP/s), divided by H100's FP8
    # GEMM efficiency 0.75 x 1453.4 / 1979 (the MAMF derate of nereus.spec.hardware); the size curve
    # can only make it slower, and for these GEMMs (>= 1 GFLOP per call) by at most 2x
    n_gemm = 32 * (4 * 4096**2 + 3 * 4096 * 11008) + 4096 * 32000
    assert n_gemm == 6_607_077_376
    eff_fp8 = round(0.75 * 1453.4 / 1979, 3)
    assert EfficiencyTable().get("gemm_fp8", get_gpu("h100")) == eff_fp8
    ideal = 6 * n_gemm * 65536 / 1979e12 / eff_fp8
    assert ideal == pytest.approx(1.3127 / eff_fp8, rel=1e-3)
    assert ideal <= x["breakdown"]["gemm_fp8"] <= 2 * ideal
    assert "gemm" not in x["breakdown"]
    assert "fp8" not in x["not_modelled"]


def test_report_structure(result, tmp_path):
    assert set(result["before"]["by_source"]) == SOURCES
    for s, st in result["before"]["by_source"].items():
        assert st["n"] > 0 and st["median"] >= 0 and st["mean"] >= 0, s
    ov = result["before"]["overall"]
    errs = [x["ape"] for x in result["rows"]]
    assert ov["median"] == pytest.approx(float(np.median(errs)))
    assert ov["mean"] == pytest.approx(float(np.mean(errs)))
    # leave-one-source-out: one fit per source, held-out errors on every other source
    assert set(result["loso"]) == SOURCES
    for s, d in result["loso"].items():
        assert s not in d["held_out_by_source"]
        assert set(d["held_out_by_source"]) == SOURCES - {s}
        assert all(0 < v for v in d["scales"].values())
        assert all(e <= 0.95 + 1e-9 for e in d["efficiencies"].values())  # never at the 1.5 cap
    # the floor: one calibration over all bf16 rows (and per GPU type), judged in-sample
    assert "all bf16" in result["floor"]
    assert result["floor"]["all bf16"]["in_sample"]["n"] == sum(x["precision"] == "bf16" for x in result["rows"])
    # pooled: every row counted once per fit on another source
    n = len(result["rows"])
    counts = {s: sum(1 for x in result["rows"] if x["source"] == s) for s in SOURCES}
    assert result["loso_pooled"]["all"]["n"] == sum(n - c for c in counts.values())
    # rows whose CP the model lacks say so; rank correlations are in [-1, 1]
    a01 = next(x for x in result["rows"] if x["id"] == "A01")
    if not result["capabilities"]["cp"]:
        assert "cp (as dp*cp replicas)" in a01["not_modelled"]
    for d in result["spearman"].values():
        assert -1 <= d["time"] <= 1
    text = VR.report(result)
    for s in SOURCES:
        assert s in text
    png = tmp_path / "v.png"
    VR.plot(result, png)
    assert png.stat().st_size > 10_000


def test_spearman_fallback_matches_scipy():
    a = [3.0, 1.0, 2.0, 2.0, 5.0]
    b = [2.5, 0.5, 1.0, 1.5, 9.0]
    from scipy.stats import spearmanr

    assert V.spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)
    assert math.isnan(V.spearman([1.0, 2.0], [1.0, 2.0]))


def test_bad_rows_are_named(tmp_path):
    with open(CSV, newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames
        first = next(reader)
    for change, needle in (({"tp": "2"}, "tp*pp*cp*dp"), ({"iter_time_s": "1.0"}, "iter_time_s=1.0"),
                           ({"seq_len": "x"}, "'seq_len'='x' must be an integer"),
                           ({"measured_value": "-3"}, "'measured_value'='-3' must be > 0"),
                           ({"source": ""}, "column 'source' is empty")):
        p = tmp_path / "bad.csv"
        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerow(first | change)
        with pytest.raises(ValueError) as e:
            VD.load_rows(p)
        assert needle in str(e.value) and first["id"] in str(e.value)


def test_a_row_the_model_refuses_is_evaluated_without_its_features(rows):
    import dataclasses

    r = next(x for x in rows if x.id == "N02")  # Llama-2-13B, pp 4, vp 10
    bad = dataclasses.replace(r, vpp=3)  # 40 layers do not split into 4 x 3 chunks
    caps = V.capabilities()
    drop, why = V.usable_drop(bad, caps)
    if caps["vpp"]:
        assert drop == V.ALL_FEATURES and "ValueError" in why
    p = V.predict(bad, caps=caps, drop=drop)
    assert p.time > 0
    assert V.usable_drop(r, caps) == (frozenset(), None)
