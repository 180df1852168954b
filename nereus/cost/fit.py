"""Calibration of op-class efficiencies from measured step or stage totals (issue 13 item 8).

A real run often reports only totals: the seconds of a training step, of one model-stage, or of a
pretraining iteration, not the seconds of each op class. :meth:`EfficiencyTable.update` needs per
class times; fed a total it would pin one class's efficiency until the total matches, which pushes
efficiencies to the table's cap (1.5) when that class is not the one that is off.

This module fits **one multiplicative scale per op-class group** to many totals at once:

* groups (:func:`group_of`): ``gemm``, ``gemm_fp8``, ``attention``, ``memory`` (``memory_bound``) and one per link
  for the collectives (``comm@nvlink``, ``comm@ib``, ...: every ``<collective>@<link>`` class of that
  link), and each engine overhead class (``decode_overhead``, ``engine``, ``launch``, ``framework``,
  :mod:`nereus.cost.engine_terms`) on its own. Everything in a group moves together, so a handful of totals can identify it; a group the
  totals cannot separate from another (e.g. attention in short-sequence rows) stays near its default
  through the prior.
* model: the time of an op class is ``work / (peak · efficiency)`` (:mod:`nereus.cost.latency`), so
  scaling a group's efficiencies by ``s_g`` divides its seconds by ``s_g``. Given each measurement's
  predicted breakdown ``t_ic`` (seconds of op class ``c`` at the base efficiencies), the prediction is
  ``P_i(s) = Σ_c t_ic / s_g(c)`` (exact for the additive cost model; the α latency terms of the
  collectives scale with them, a small error). :func:`fit_table` takes any prediction function of an
  :class:`EfficiencyTable` instead, for cost models whose terms are not additive (overlap ``max``).
* objective (least squares in log space, so a 10% miss weighs the same on a 1 s and a 100 s step):
  ``Σ_i w_i·((log P_i(s) - log M_i)/τ)² + Σ_g (log s_g / σ)²``, the maximum-a-posteriori fit with
  per-total noise ``τ`` (log units; default 0.1: the scatter an analytic model leaves on a total) and a
  Gaussian prior of width ``σ`` (default 0.5 = a factor 1.65 per standard deviation) that pulls each
  group towards the defaults, so a group the data barely touch stays near them instead of wandering.
* bounds: every fitted class efficiency stays inside ``[eff_min, eff_max]`` (default 0.05-0.95), well
  inside the table's ``(0, 1.5]`` and below 1 (no class runs faster than its peak); a result at a
  bound is reported in :attr:`FitResult.at_bound`, never silently clipped afterwards.

Solved with ``scipy.optimize.least_squares`` (trust-region reflective, box bounds).

Sources: the log-space multiplicative fit with a prior is the usual maximum-a-posteriori form of a
calibrated analytic model (Calculon's efficiency factors and AdaptDL/Pollux's fitted throughput model
are fitted the same way from measured totals; cost-model.md §3-§4).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus.cost.efficiency import EfficiencyTable

__all__ = ["FitResult", "group_of", "fit_scales", "fit_table", "EFF_BOUNDS", "PRIOR_SIGMA", "NOISE_SIGMA",
           "deadband_targets"]

#: default box for every fitted class efficiency: well inside EfficiencyTable's (0, 1.5] and below 1
EFF_BOUNDS = (0.05, 0.95)
#: default width of the prior on each group's log-scale (a factor e^0.5 = 1.65 per standard deviation)
PRIOR_SIGMA = 0.5
#: default noise of one measured total against the model, log units (10%)
NOISE_SIGMA = 0.1

_MEMORY = ("memory_bound",)
#: engine overhead classes (nereus.cost.engine_terms), each its own group
_OVERHEADS = ("decode_overhead", "engine", "launch", "framework")


def group_of(op_class: str) -> str | None:
    """The group an op class is fitted in: ``gemm``, ``gemm_fp8``, ``attention``, ``memory``, ``comm@<link>``, or
    None for entries that are not op classes (e.g. ``bubble``, which is derived from the others)."""
    if op_class in ("gemm", "gemm_fp8", "attention"):
        return op_class
    if op_class in _MEMORY:
        return "memory"
    if op_class in _OVERHEADS:
        return op_class
    kind, sep, link = op_class.partition("@")
    if sep and kind and link:
        return f"comm@{link}"
    return None


@dataclass(frozen=True)
class FitResult:
    """Outcome of a fit.

    Attributes:
        table: the calibrated efficiency table (a copy of the base with the fitted classes set).
        scales: group → fitted multiplier on the base efficiencies of its classes (1 = unchanged).
        efficiencies: op class → fitted efficiency, for every class that took part.
        log_residuals_before, log_residuals_after: ``log(predicted / measured)`` per measurement at
            the base efficiencies and after the fit.
        at_bound: classes whose efficiency ended on the ``eff_min``/``eff_max`` box (the data asked
            for more than the bounds allow).
        n: number of measurements.
        success, message: the solver's status.
    """

    table: EfficiencyTable
    scales: dict
    efficiencies: dict
    log_residuals_before: np.ndarray
    log_residuals_after: np.ndarray
    at_bound: tuple = ()
    n: int = 0
    success: bool = True
    message: str = ""
    groups: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line: per-group scales and the median absolute error before and after."""
        mb = 100 * float(np.median(np.abs(np.expm1(self.log_residuals_before))))
        ma = 100 * float(np.median(np.abs(np.expm1(self.log_residuals_after))))
        sc = ", ".join(f"{g} x{s:.3f}" for g, s in sorted(self.scales.items()))
        return f"{self.n} totals; {sc}; median |error| {mb:.1f}% -> {ma:.1f}%"


def _check_measured(measured) -> np.ndarray:
    m = list(measured) if measured is not None else []
    if len(m) == 0:
        raise ValueError("calibration needs at least one measured total, got 0 (empty 'measured')")
    out = np.empty(len(m))
    for i, v in enumerate(m):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"measured[{i}]={v!r} must be a number of seconds")
        if not (math.isfinite(float(v)) and float(v) > 0):
            raise ValueError(f"measured[{i}]={v!r}: measured times must be finite and > 0 seconds")
        out[i] = float(v)
    return out


def _check_options(prior_sigma: float, eff_bounds, weights, n: int,
                   noise_sigma: float = NOISE_SIGMA) -> tuple[float, float, np.ndarray]:
    for name, v in (("prior_sigma", prior_sigma), ("noise_sigma", noise_sigma)):
        if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r} must be a finite number > 0 (log units)")
    lo, hi = eff_bounds
    if not (0 < lo < hi <= 1.5):
        raise ValueError(f"eff_bounds={tuple(eff_bounds)!r} must satisfy 0 < low < high <= 1.5")
    if weights is None:
        w = np.ones(n)
    else:
        w = np.asarray(list(weights), dtype=float)
        if w.shape != (n,):
            raise ValueError(f"weights has {w.size} entries for {n} measurements")
        bad = np.flatnonzero(~(np.isfinite(w) & (w > 0)))
        if bad.size:
            raise ValueError(f"weights[{int(bad[0])}]={float(w[bad[0]])!r} must be finite and > 0")
    return float(lo), float(hi), w


def _solve(predict_scaled: Callable[[np.ndarray], np.ndarray], groups: list[str], group_classes: dict,
           base: EfficiencyTable, measured: np.ndarray, w: np.ndarray, prior_sigma: float,
           lo: float, hi: float, noise_sigma: float = NOISE_SIGMA, start=None,
           max_nfev: int | None = None, gpu=None) -> tuple[np.ndarray, bool, str]:
    """Least squares over ``x = log s`` per group; returns (x, success, message)."""
    if not groups:
        return np.zeros(0), True, "no op-class group to fit"
    from scipy.optimize import least_squares

    lb, ub = [], []
    for g in groups:
        effs = [base.get(c, gpu) for c in group_classes[g]]
        # every class of the group must stay inside [lo, hi] after scaling
        lb.append(math.log(lo / min(effs)) if min(effs) > 0 else -10.0)
        ub.append(math.log(hi / max(effs)))
    lb, ub = np.array(lb), np.array(ub)
    if np.any(lb > ub):
        # the classes of one group span a wider range than the box allows: fall back to a
        # compromise box around the base (no scaling possible in that group beyond it)
        bad = np.flatnonzero(lb > ub)
        lb[bad] = ub[bad] = np.minimum(0.0, ub[bad])
    x0 = np.zeros(len(groups)) if start is None else np.asarray(start, dtype=float)
    x0 = np.clip(x0, lb, ub)
    sw = np.sqrt(w) / noise_sigma
    lm = np.log(measured)

    def resid(x):
        p = predict_scaled(x)
        data = sw * (np.log(np.maximum(p, 1e-300)) - lm)
        return np.concatenate([data, x / prior_sigma])

    fixed = lb >= ub
    if np.all(fixed):
        return x0, True, "every group fixed by its bounds"
    free = ~fixed

    def resid_free(xf):
        x = x0.copy()
        x[free] = xf
        return resid(x)

    r = least_squares(resid_free, x0[free], bounds=(lb[free], ub[free]), method="trf", x_scale=1.0,
                      ftol=1e-9, xtol=1e-9, gtol=1e-9, diff_step=1e-6,
                      max_nfev=max_nfev if max_nfev is not None else 40 * (int(free.sum()) + 1))
    x = x0.copy()
    x[free] = r.x
    return x, bool(r.success), str(r.message)


def _result(base: EfficiencyTable, groups: list[str], group_classes: dict, x: np.ndarray,
            before: np.ndarray, after: np.ndarray, lo: float, hi: float, success: bool, message: str,
            gpu=None) -> FitResult:
    table = base.copy()
    scales, effs, at_bound = {}, {}, []
    for g, xg in zip(groups, x):
        s = float(math.exp(xg))
        scales[g] = s
        for c in group_classes[g]:
            e = min(max(base.get(c, gpu) * s, lo), hi)
            table.set(c, e)
            effs[c] = e
            if math.isclose(e, lo, rel_tol=1e-4) or math.isclose(e, hi, rel_tol=1e-4):
                at_bound.append(c)
    return FitResult(table=table, scales=scales, efficiencies=effs, log_residuals_before=before,
                     log_residuals_after=after, at_bound=tuple(sorted(at_bound)), n=len(before),
                     success=success, message=message, groups={g: tuple(group_classes[g]) for g in groups})


def deadband_targets(predicted: Sequence[float], measured: Sequence[float], band: float = NOISE_SIGMA) -> list:
    """Measured totals moved onto the edge of a band of ``±band`` (log units) around each
    prediction: ``P·exp(r - clip(r, -band, band))`` with ``r = log(M/P)``. A total the model already
    predicts within its expected scatter (:data:`NOISE_SIGMA`, 10%) asks for no change; one outside
    asks only for the part beyond it. Fitting these instead of the raw totals keeps calibration from
    chasing step-to-step noise into the efficiencies (which then transfer to the job's other plans).

    Raises:
        ValueError: lengths differ, a non-positive value, or ``band < 0``.
    """
    p, m = list(predicted), list(measured)
    if len(p) != len(m) or not band >= 0:
        raise ValueError(f"deadband_targets needs as many predictions as totals and band >= 0, got {len(p)} "
                         f"predictions, {len(m)} totals, band={band!r}")
    out = []
    for i, (a, b) in enumerate(zip(p, m)):
        if not (a > 0 and b > 0):
            raise ValueError(f"deadband_targets: predicted[{i}]={a!r} and measured[{i}]={b!r} must be > 0")
        r = math.log(b / a)
        out.append(a * math.exp(r - max(-band, min(band, r))))
    return out


def fit_scales(breakdowns: Sequence[Mapping[str, float]], measured: Sequence[float], *,
               base: EfficiencyTable | None = None, prior_sigma: float = PRIOR_SIGMA,
               noise_sigma: float = NOISE_SIGMA, eff_bounds: tuple = EFF_BOUNDS,
               weights: Sequence[float] | None = None, gpu=None) -> FitResult:
    """Fit one efficiency scale per op-class group from measured totals and predicted breakdowns.

    Args:
        breakdowns: per measurement, op class → predicted seconds at ``base`` (e.g.
            :attr:`StageEstimate.breakdown`); entries that are not op classes (``bubble``: idle time
            of a pipeline, a multiple of the other classes) scale with the measurement's compute and
            communication as a whole, i.e. with the time-weighted mean of its classes' scales.
        measured: per measurement, the measured total in seconds (> 0).
        base: the efficiencies the breakdowns were computed with (default table when None).
        prior_sigma: width of the prior on each group's log-scale (log units, > 0).
        noise_sigma: expected scatter of one total against the model (log units, > 0); the
            data term is ``Σ w_i·(log residual / noise_sigma)²``.
        eff_bounds: (low, high) box for every fitted class efficiency, inside (0, 1.5].
        weights: optional positive weight per measurement (default 1).
        gpu: the GPU the measurements ran on (:class:`~nereus.spec.hardware.GPUSpec`): uncalibrated
            classes of ``base`` start from its default efficiencies, as the predictions did; None:
            the GPU-independent defaults.

    Returns:
        :class:`FitResult` with the calibrated table.

    Raises:
        ValueError: no measurements, a non-positive or non-finite time (named by index and value),
            a breakdown count different from the measurement count, a breakdown with no positive
            seconds, or invalid options.
    """
    m = _check_measured(measured)
    bds = list(breakdowns) if breakdowns is not None else []
    if len(bds) != len(m):
        raise ValueError(f"breakdowns has {len(bds)} entries for {len(m)} measured totals; give one per total")
    lo, hi, w = _check_options(prior_sigma, eff_bounds, weights, len(m), noise_sigma)
    base = base if base is not None else EfficiencyTable()
    group_classes: dict = {}
    for i, bd in enumerate(bds):
        if not isinstance(bd, Mapping):
            raise ValueError(f"breakdowns[{i}] must map op class -> seconds, got {type(bd).__name__}")
        tot = 0.0
        for c, t in bd.items():
            t = float(t)
            if not math.isfinite(t) or t < 0:
                raise ValueError(f"breakdowns[{i}][{c!r}]={t!r} must be finite and >= 0 seconds")
            tot += t
            g = group_of(c)
            if g is not None and t > 0:
                group_classes.setdefault(g, [])
                if c not in group_classes[g]:
                    group_classes[g].append(c)
        if not tot > 0:
            raise ValueError(f"breakdowns[{i}] has no positive seconds (predicted total 0)")
    groups = sorted(group_classes)
    gi = {g: k for k, g in enumerate(groups)}
    # T[i, k]: seconds of group k in measurement i; rest[i]: other entries (bubble), scaled with the others
    T = np.zeros((len(m), len(groups)))
    rest = np.zeros(len(m))
    for i, bd in enumerate(bds):
        for c, t in bd.items():
            g = group_of(c)
            if g is None:
                rest[i] += float(t)
            else:
                T[i, gi[g]] += float(t)

    def predict(x):
        inv = np.exp(-x)
        core = T @ inv
        own = T.sum(axis=1)
        ratio = np.where(own > 0, core / np.where(own > 0, own, 1.0), 1.0)
        return core + rest * ratio

    before = np.log(predict(np.zeros(len(groups)))) - np.log(m)
    x, ok, msg = _solve(predict, groups, group_classes, base, m, w, prior_sigma, lo, hi, noise_sigma, gpu=gpu)
    after = np.log(predict(x)) - np.log(m)
    return _result(base, groups, group_classes, x, before, after, lo, hi, ok, msg, gpu)


def fit_table(predict: Callable[[EfficiencyTable], Sequence[float]], classes: Sequence[str],
              measured: Sequence[float], *, base: EfficiencyTable | None = None,
              prior_sigma: float = PRIOR_SIGMA, noise_sigma: float = NOISE_SIGMA,
              eff_bounds: tuple = EFF_BOUNDS, weights: Sequence[float] | None = None,
              start: Mapping[str, float] | None = None, max_nfev: int | None = None, gpu=None) -> FitResult:
    """Like :func:`fit_scales`, but re-evaluates ``predict(table)`` (seconds per measurement) for each
    trial table, so cost models whose terms are not additive (overlaps, ``max``) are fitted exactly.

    Args:
        predict: maps an :class:`EfficiencyTable` to the predicted totals, one per measurement.
        classes: the op classes to calibrate (grouped with :func:`group_of`; others are ignored).
        start: optional group → scale to start from (e.g. :attr:`FitResult.scales` of a quick
            :func:`fit_scales`); default 1 for every group.
        gpu: as in :func:`fit_scales`.
        max_nfev: cap on the solver's function evaluations (default ``40·(groups + 1)``); a fit that
            reaches it reports ``success=False`` with the solver's message.

    Raises:
        ValueError: as :func:`fit_scales`; also when ``predict`` returns the wrong number of values
            or a non-positive prediction at the base table.
    """
    m = _check_measured(measured)
    lo, hi, w = _check_options(prior_sigma, eff_bounds, weights, len(m), noise_sigma)
    base = base if base is not None else EfficiencyTable()
    group_classes: dict = {}
    for c in classes:
        g = group_of(c)
        if g is not None:
            group_classes.setdefault(g, [])
            if c not in group_classes[g]:
                group_classes[g].append(c)
    groups = sorted(group_classes)

    def table_for(x):
        t = base.copy()
        for g, xg in zip(groups, x):
            for c in group_classes[g]:
                t.set(c, min(max(base.get(c, gpu) * math.exp(xg), 1e-6), 1.5))
        return t

    def pred(x):
        p = np.asarray(list(predict(table_for(x))), dtype=float)
        if p.shape != m.shape:
            raise ValueError(f"predict returned {p.size} values for {m.size} measured totals")
        return p

    p0 = pred(np.zeros(len(groups)))
    bad = np.flatnonzero(~(np.isfinite(p0) & (p0 > 0)))
    if bad.size:
        raise ValueError(f"predicted[{int(bad[0])}]={float(p0[bad[0]])!r} at the base table must be finite and > 0")
    before = np.log(p0) - np.log(m)
    x_start = None if start is None else [math.log(float(start.get(g, 1.0))) for g in groups]
    x, ok, msg = _solve(pred, groups, group_classes, base, m, w, prior_sigma, lo, hi, noise_sigma, x_start, max_nfev,
                        gpu)
    after = np.log(pred(x)) - np.log(m)
    return _result(base, groups, group_classes, x, before, after, lo, hi, ok, msg, gpu)
