"""Per-stage staircases of the plan search (:mod:`nereus.planner.search`): the least stage time for
every per-GPU resident bound, at one transient bound τ and GPU budget.

* :class:`_Member`: one model-stage's frontier with its cached (resident, time) staircases;
* :func:`_minmax_levels`: the disjoint placement's min-max knapsack over the members, for every
  resident level at once;
* :func:`_block_member`: one block of a mixed placement as a unit (its members' rows combined one by
  one, dominated combinations dropped, capped by :data:`MIXED_MAX_COMBOS` / :data:`MIXED_MAX_ROWS`);
* :class:`_Group`: one stage over the partitions its framework allows (colocated: Pareto sums;
  disjoint and mixed: the knapsack over singletons or blocks);
* :func:`_convolve`: the min-plus convolution of the stages' staircases under a resident budget;
* :func:`partition_mode`: a partition's placement kind.

The search model and why each step is exact are in :mod:`nereus.planner.search`'s docstring.
"""

from __future__ import annotations

import math

import numpy as np

from nereus.planner.candidates import CandidateSet

#: largest product of its members' row counts for which a block of a mixed placement is built (a
#: stage whose promising mixed partitions exceed it is searched without them: SearchResult.mixed_skipped)
MIXED_MAX_COMBOS = 1_000_000
#: largest number of rows of one block of a mixed placement (its knapsack scans them per resident level)
MIXED_MAX_ROWS = 20_000

def partition_mode(part) -> str:
    """``disjoint`` (all blocks singletons), ``colocated`` (one block of 2+) or ``mixed``."""
    if all(len(b) == 1 for b in part):
        return "disjoint"
    return "colocated" if len(part) == 1 else "mixed"


def _pareto(R: np.ndarray, T: np.ndarray, *tie) -> np.ndarray:
    """Indices of the (R ascending, T strictly descending) staircase of points (R, T); among equal
    (R, T) the first by ``tie`` keys wins."""
    if R.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort(tuple(reversed(tie)) + (T, R)) if tie else np.lexsort((T, R))
    t = T[order]
    keep = np.ones(order.size, dtype=bool)
    keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1]
    return order[keep]


class _Member:
    """One model-stage's frontier with its cached (resident, time) staircases."""

    def __init__(self, fs: CandidateSet):
        self.fs = fs
        self.rt = np.lexsort((fs.t, fs.r))  # rows by resident, then time
        self.xs = np.unique(fs.x)
        self.cache: dict = {}
        self.rnt = None

    def stair(self, tau: float, budget: int) -> np.ndarray:
        """Rows (resident ascending, time strictly descending) with transient ≤ tau, GPUs ≤ budget."""
        key = (int(self.xs.searchsorted(tau, side="right")), budget)
        hit = self.cache.get(key)
        if hit is None:
            fs, o = self.fs, self.rt
            rows = o[(fs.x[o] <= tau) & (fs.n[o] <= budget)]
            if rows.size:
                t = fs.t[rows]
                keep = np.ones(rows.size, dtype=bool)
                keep[1:] = t[1:] < np.minimum.accumulate(t)[:-1]
                rows = rows[keep]
            hit = self.cache[key] = rows
        return hit

    def rows(self, tau: float, budget: int) -> np.ndarray:
        """Rows with transient ≤ tau and GPUs ≤ budget that lie on the (GPUs, time) staircase of
        their resident value (any other row is beaten by one with the same resident bytes at every
        resident bound, so no knapsack needs it), in (GPUs, time) order."""
        key = ("nt", int(self.xs.searchsorted(tau, side="right")), budget)
        hit = self.cache.get(key)
        if hit is None:
            fs = self.fs
            if self.rnt is None:
                self.rnt = np.lexsort((fs.t, fs.n, fs.r))
                span = float(fs.t.max() - fs.t.min()) + 1.0 if len(fs) else 1.0
                r = fs.r[self.rnt]
                gid = np.cumsum(np.r_[True, r[1:] != r[:-1]])
                self.shift = fs.t[self.rnt] - gid * span * 2.0  # segmented running minimum by resident
            o = self.rnt
            ok = np.nonzero((fs.x[o] <= tau) & (fs.n[o] <= budget))[0]
            sh = self.shift[ok]
            keep = np.ones(ok.size, dtype=bool)
            keep[1:] = sh[1:] < np.minimum.accumulate(sh)[:-1]
            sel = o[ok[keep]]
            hit = self.cache[key] = sel[np.lexsort((fs.t[sel], fs.n[sel]))]
        return hit

    def front(self, tau: float, budget: int) -> np.ndarray:
        """:meth:`rows` less the rows another of them beats in GPUs, resident and time (one of the
        first two strictly; :func:`~nereus.planner.candidates._dominated_across_classes`): no
        resident level's (GPUs, time) staircase needs them, and fewer rows bring fewer levels.
        Kept in (GPUs, time) order."""
        key = ("front", int(self.xs.searchsorted(tau, side="right")), budget)
        hit = self.cache.get(key)
        if hit is None:
            o = self.rows(tau, budget)
            if o.size > 1:
                from nereus.planner.candidates import _dominated_across_classes

                fs = self.fs
                _, ri = np.unique(fs.r[o], return_inverse=True)
                o = o[_dominated_across_classes(fs.n[o], fs.t[o], ri, np.zeros(o.size, dtype=np.int64)) == 0]
            hit = self.cache[key] = o
        return hit


def _member(shared: dict, fs: CandidateSet) -> _Member:
    """Model-stages with the same frontier (actor.infer and reference.infer) share one member."""
    k = id(fs.t)
    if k not in shared:
        shared[k] = _Member(fs)
    return shared[k]


def _minmax_levels(members: list, budget: int):
    """The min-max knapsack of one disjoint stage at every resident level at once.

    ``members``: per distinct frontier ``(level ids, rows, frontier, multiplicity)``, the rows of
    each level's (GPUs, time) staircase (level-major; GPUs ascending, time descending within a
    level). At level ``j`` the best stage time is the least ``T`` among the members' staircase
    times with ``Σ_i mult_i · N_i(T) ≤ budget``, ``N_i(T)`` the fewest GPUs of member ``i`` at time
    ``≤ T`` (the min-max knapsack's optimum; every member then takes that fewest-GPU row).
    Times are compared through their ranks (exact integer keys).

    Returns ``(levels, times, [rows per member])`` for the levels with a solution, or None."""
    tall = np.concatenate([fs.t[rows] for _, rows, fs, _ in members])
    if tall.size == 0:
        return None
    uniq, inv = np.unique(tall, return_inverse=True)
    K = int(uniq.size)
    keys, ranks, off = [], [], 0
    for jj, rows, _, _ in members:
        rk = inv[off:off + rows.size]
        off += rows.size
        ranks.append(rk)
        keys.append(jj.astype(np.int64) * (K + 1) + (K - rk))  # ascending within each level
    cj = np.concatenate([m[0] for m in members]).astype(np.int64)
    cr = np.concatenate(ranks)
    qkey = cj * (K + 1) + (K - cr)
    need = np.zeros(cj.size)
    for (jj, rows, fs, w), key in zip(members, keys):
        pos = np.searchsorted(key, qkey, side="left")  # first row of the level with time ≤ T
        pc = np.minimum(pos, key.size - 1)
        ok = (pos < key.size) & (jj[pc] == cj)
        need += np.where(ok, fs.n[rows[pc]] * w, np.inf)
    feas = np.nonzero(need <= budget)[0]
    if feas.size == 0:
        return None
    order = feas[np.lexsort((cr[feas], cj[feas]))]
    first = np.ones(order.size, dtype=bool)
    first[1:] = cj[order[1:]] != cj[order[:-1]]
    best = order[first]  # per level, the feasible candidate with the least time
    lv, rk = cj[best], cr[best]
    q = lv * (K + 1) + (K - rk)
    chosen = [rows[np.searchsorted(key, q, side="left")] for (_, rows, _, _), key in zip(members, keys)]
    return lv, uniq[rk], chosen


class _Cols:
    """The (GPUs, time, resident, transient) columns of a block's rows (a :class:`_Member` of them)."""

    def __init__(self, n, t, r, x):
        self.n, self.t, self.r, self.x = n, t, r, x

    def __len__(self) -> int:
        return int(self.n.shape[0])


def _pareto_sum(parts: list, cap: float):
    """Pareto sums of (resident, time) staircases, one entry from each: ``parts`` as ``(fs,
    rows)``; resident and time add, transient takes the max; sums over ``cap`` resident are dropped.
    Returns ``(R, T, X, rows)`` (rows: one column per part) on the (R, T) staircase."""
    f0, st0 = parts[0]
    R, T, X = f0.r[st0], f0.t[st0], f0.x[st0]
    rows = st0[:, None]
    for fs, st in parts[1:]:
        R2 = (R[:, None] + fs.r[st][None, :]).reshape(-1)
        T2 = (T[:, None] + fs.t[st][None, :]).reshape(-1)
        X2 = np.maximum(X[:, None], fs.x[st][None, :]).reshape(-1)
        ia = np.repeat(np.arange(R.size), st.size)
        ib = np.tile(np.arange(st.size), R.size)
        ok = np.nonzero(R2 <= cap)[0]
        keep = ok[_pareto(R2[ok], T2[ok], X2[ok])]
        R, T, X = R2[keep], T2[keep], X2[keep]
        rows = np.concatenate([rows[ia[keep]], st[ib[keep]][:, None]], axis=1)
    return R, T, X, rows


def _block_member(members: list, tau: float, budget: int, cap: float, limit: int | None = None):
    """One block of a mixed stage (model-stages run one after another on one GPU set of ``g``
    GPUs, ``g`` the largest of theirs) as a :class:`_Member` over its rows: one row of each member,
    GPUs the max, time and resident the sums, transient the max, resident within ``cap``. Built
    member by member; after each step rows dominated in GPUs, resident and time by another row
    are dropped (adding the next member's row keeps the dominance: max and sum are monotone), and
    a member contributes only its rows under ``tau`` and ``budget`` on its (GPUs, resident, time)
    front. Transient bytes are left out of the dominance: every row here is within ``tau``, which
    is all the τ search's relaxation asks (its branch and bound splits on the chosen plan's
    actual transient, as for the members' own staircases).
    ``.map``: the member rows of each block row. None when nothing fits; False when a step would
    combine more than ``limit`` rows."""
    from nereus.planner.candidates import _dominated_across_classes

    def prune(n, t, r, x, extra):  # (GPUs, resident, time) front: every transient is ≤ tau
        if n.size > 1:
            _, ri = np.unique(r, return_inverse=True)
            keep = _dominated_across_classes(n, t, ri, np.zeros(n.size, dtype=np.int64)) == 0
            n, t, r, x, extra = n[keep], t[keep], r[keep], x[keep], extra[keep]
        return n, t, r, x, extra

    cur = None
    for m in members:
        o = m.rows(tau, budget)
        if o.size == 0:
            return None
        fs = m.fs
        if o.size > 1:  # the member's (GPUs, resident, time) front: its transient is ≤ tau anyway
            _, ri = np.unique(fs.r[o], return_inverse=True)
            o = o[_dominated_across_classes(fs.n[o], fs.t[o], ri, np.zeros(o.size, dtype=np.int64)) == 0]
        n, t, r, x = fs.n[o], fs.t[o], fs.r[o], fs.x[o]
        if cur is None:
            cur = (n, t, r, x, o[:, None])
            continue
        cn, ct, cr, cx, cmap = cur
        if limit is not None and cn.size * n.size > limit:
            return False
        ia = np.repeat(np.arange(cn.size), n.size)
        ib = np.tile(np.arange(n.size), cn.size)
        R = cr[ia] + r[ib]
        ok = np.nonzero(R <= cap)[0]
        if ok.size == 0:
            return None
        ia, ib = ia[ok], ib[ok]
        cur = prune(np.maximum(cn[ia], n[ib]), ct[ia] + t[ib], R[ok], np.maximum(cx[ia], x[ib]),
                    np.concatenate([cmap[ia], o[ib][:, None]], axis=1))
    n, t, r, x, mp = cur
    order = np.lexsort((t, n))
    blk = _Member(_Cols(n[order], t[order], r[order], x[order]))
    blk.map = mp[order]
    return blk


class _Group:
    """One stage under the τ search: its (resident, time) staircase at a transient bound, over the
    placements the framework allows, as partitions of its model-stages into blocks (``parts``;
    :func:`~nereus.planner.partitions.stage_partitions`). One block (colocated): Pareto sums of the members' staircases;
    singletons (disjoint): a min-max knapsack per resident level; mixed: the same knapsack over
    the blocks, each block a unit of (GPUs, time, resident) rows (:func:`_block_member`), the
    stage's resident bound the largest block's sum."""

    def __init__(self, name: str, members: list[_Member], parts: list, names: list[str], usable: float = math.inf):
        self.name, self.members, self.parts, self.names = name, members, parts, names
        self.usable = usable  # blocks keep rows up to this resident (the knapsack caps them lower)
        self.cache: dict = {}
        self.blocks: dict = {}  # block units by (block, its members' transient-level counts, budget)
        self.calls = 0

    def affordable(self, parts: list, pool: int) -> bool:
        """Whether every block of ``parts``, built without a transient bound on the whole pool
        (about the largest any bound of the search leaves; kept for the search), combines at most
        :data:`MIXED_MAX_COMBOS` rows at each step and keeps at most :data:`MIXED_MAX_ROWS`."""
        for p in parts:
            for b in p:
                if len(b) < 2:
                    continue
                bkey = (b, tuple(len(self.members[i].xs) for i in b), pool)
                if bkey not in self.blocks:
                    blk = _block_member([self.members[i] for i in b], math.inf, pool, self.usable,
                                        limit=MIXED_MAX_COMBOS)
                    if blk is False or (blk is not None and len(blk.fs) > MIXED_MAX_ROWS):
                        return False
                    self.blocks[bkey] = blk
        return True

    def blocks_of(self, code: int) -> tuple:
        """The blocks (tuples of model-stage names) of partition ``code``."""
        return tuple(tuple(self.names[i] for i in b) for b in self.parts[code])

    def stair(self, tau: float, budget: int, cap: float):
        """``(R, T, X, rows, code)`` arrays of the stage's staircase: R resident bound of the stage,
        T time, X largest transient, rows the members' frontier rows, code the partition (index
        into ``parts``; ties go to the earlier: disjoint, colocated, then mixed)."""
        key = (tuple(int(m.xs.searchsorted(tau, side="right")) for m in self.members), budget)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        parts = []
        k = len(self.members)
        stairs = [m.stair(tau, budget) for m in self.members]
        if any(s.size == 0 for s in stairs):
            hit = self.cache[key] = None
            return None
        counts = key[0]
        seen = None  # (R, T) staircase of the partitions done so far
        for code, part in enumerate(self.parts):
            if len(part) == 1:  # one block (or a model-stage alone): Pareto sums
                R, T, X, rows = _pareto_sum([(m.fs, st) for m, st in zip(self.members, stairs)], cap)
                parts.append((R, T, X, rows, np.full(R.size, code, dtype=np.int64)))
                seen = None
                continue
            if partition_mode(part) == "mixed":
                if seen is None:
                    allr = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
                    allt = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
                    keep = _pareto(allr, allt)
                    seen = (allr[keep], allt[keep])
                if self._no_better(part, stairs, seen, cap):
                    continue
            units = []
            for b in part:
                if len(b) == 1:
                    units.append((self.members[b[0]], b))
                    continue
                bkey = (b, tuple(counts[i] for i in b), budget)
                if bkey not in self.blocks:
                    self.blocks[bkey] = _block_member([self.members[i] for i in b], tau, budget, self.usable)
                if self.blocks[bkey] is None:
                    units = None
                    break
                units.append((self.blocks[bkey], b))
            if units is None:
                continue
            seen = None
            got = self._knapsack(units, tau, budget, cap)
            if got is None:
                continue
            R, T, X, urows = got
            rows = np.zeros((T.size, k), dtype=np.int64)
            for (u, b), ur in zip(units, urows):
                if len(b) == 1:
                    rows[:, b[0]] = ur
                else:
                    rows[:, list(b)] = u.map[ur]
            parts.append((R, T, X, rows, np.full(T.size, code, dtype=np.int64)))
        if not parts:
            hit = self.cache[key] = None
            return None
        R, T, X, rows, mode = (np.concatenate([p[i] for p in parts]) for i in range(5))
        if R.size == 0:
            hit = self.cache[key] = None
            return None
        keep = _pareto(R, T, mode, X)  # ties: the earlier partition, then the smaller transient
        hit = self.cache[key] = (R[keep], T[keep], X[keep], rows[keep], mode[keep])
        return hit

    def _no_better(self, part, stairs, seen, cap) -> bool:
        """Whether mixed partition ``part`` cannot improve the staircase ``seen`` (R ascending, T
        descending) of the partitions before it: with GPUs unlimited (up to the budget each) a
        block's best time at resident bound β is its colocated staircase's, so the partition's is
        at least ``LB(β) = max_block T_block(β)``; when ``seen`` is no slower at every β, every
        row of the partition is matched by an earlier one (ties go to the earlier)."""
        if seen[0].size == 0:
            return False
        bst = []
        for b in part:
            R, T, _, _ = _pareto_sum([(self.members[i].fs, stairs[i]) for i in b], cap)
            if R.size == 0:
                return True
            bst.append((R, T))
        points = np.unique(np.concatenate([R for R, _ in bst]))
        lb = np.full(points.size, -np.inf)
        for R, T in bst:
            j = np.searchsorted(R, points, side="right") - 1
            lb = np.maximum(lb, np.where(j >= 0, T[np.maximum(j, 0)], np.inf))
        j = np.searchsorted(seen[0], points, side="right") - 1
        best = np.where(j >= 0, seen[1][np.maximum(j, 0)], np.inf)
        return bool(np.all(best <= lb))

    def _knapsack(self, units: list, tau: float, budget: int, cap: float):
        """Min-max knapsack of concurrent units (members or blocks) on disjoint GPUs at every
        resident level: ``(R, T, X, [rows per unit])`` or None."""
        fss = [u.fs for u, _ in units]
        allrows = [u.front(tau, budget) for u, _ in units]
        levels = np.unique(np.concatenate([fs.r[st] for fs, st in zip(fss, allrows)]))
        levels = levels[levels <= cap]
        L = levels.size
        # every unit's (GPUs, time) staircase under every resident level at once: rows in
        # (GPUs, time) order, masked by resident ≤ level, running minimum of time per level
        per: dict = {}
        mult: dict = {}
        for (u, _), fs, o in zip(units, fss, allrows):
            mult[id(u)] = mult.get(id(u), 0) + 1
            if id(u) in per:
                continue
            # rows x levels (the running minimum runs down the rows: contiguous, fast)
            t = np.where(fs.r[o][:, None] <= levels[None, :], fs.t[o][:, None], np.inf)
            keep = np.isfinite(t)
            if o.size > 1:
                keep[1:] &= t[1:] < np.minimum.accumulate(t, axis=0)[:-1]
            jj, qq = np.nonzero(keep.T)  # level-major; within a level GPUs ascending, time descending
            per[id(u)] = (jj, o[qq])
        self.calls += L
        uids = list(per)
        fs_of = {id(u): u.fs for u, _ in units}
        got = _minmax_levels([(per[i][0], per[i][1], fs_of[i], mult[i]) for i in uids], budget)
        if got is None:
            return None
        T = got[1]
        urows = [got[2][uids.index(id(u))] for u, _ in units]
        R = np.max(np.stack([fs.r[r] for fs, r in zip(fss, urows)], axis=1), axis=1)
        X = np.max(np.stack([fs.x[r] for fs, r in zip(fss, urows)], axis=1), axis=1)
        return R, T, X, urows


def _convolve(stairs: list, budget_bytes: float):
    """min Σ T over one entry per staircase with Σ R ≤ budget_bytes: ``(value, entries)`` or
    ``(inf, None)``. Pareto sums stage by stage; the last staircase by lookup."""
    mins = [float(s[0][0]) for s in stairs]  # R ascending: the first entry has the least resident
    if sum(mins) > budget_bytes:
        return math.inf, None
    R, T = stairs[0][0], stairs[0][1]
    back = np.arange(R.size)[:, None]
    for i, s in enumerate(stairs[1:-1], start=1):
        cap = budget_bytes - sum(mins[i + 1:])
        R2 = (R[:, None] + s[0][None, :]).reshape(-1)
        T2 = (T[:, None] + s[1][None, :]).reshape(-1)
        ia = np.repeat(np.arange(R.size), s[0].size)
        ib = np.tile(np.arange(s[0].size), R.size)
        ok = np.nonzero(R2 <= cap)[0]
        keep = ok[_pareto(R2[ok], T2[ok])]
        R, T = R2[keep], T2[keep]
        back = np.concatenate([back[ia[keep]], ib[keep][:, None]], axis=1)
    if len(stairs) == 1:
        ok = R <= budget_bytes
        if not ok.any():
            return math.inf, None
        j = int(np.argmin(np.where(ok, T, np.inf)))
        return float(T[j]), [int(back[j, 0])]
    last = stairs[-1]
    j = np.searchsorted(last[0], budget_bytes - R, side="right") - 1
    ok = j >= 0
    if not ok.any():
        return math.inf, None
    tot = np.where(ok, T + last[1][np.maximum(j, 0)], np.inf)
    a = int(np.argmin(tot))
    return float(tot[a]), [int(v) for v in back[a]] + [int(j[a])]
