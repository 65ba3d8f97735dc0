"""The built-in shared statistics (docs/plugins.md#shared-statistics): what several metrics read from the same pooled
vectors, kept once per address and pooling however many metrics read it.

* :class:`UnitSums`: Σu, Σ‖u‖² and the counts of the unit vectors, the O(N·d) identity behind ``dispersion``;
* :class:`PooledGram`: the streamed linear Gram of the rows (unit rows with ``unit=True``, the raw rows otherwise),
  behind ``vendi`` and ``dataset_entropy`` with ``centering="none"`` (unit rows) and ``effective_rank`` (raw rows).

A third-party metric shares one of these by returning an equal instance from ``Metric.statistics()``.
"""

from __future__ import annotations

from repgeom_eval.spec.metric import LayerBatch, Statistic
from repgeom_eval.plugin_system.lazy import lazy

torch = lazy("torch")
unit_rows = lazy("repgeom_eval.functional.dispersion:unit")
linear_gram = lazy("repgeom_eval.functional.entropy:linear_gram")


class UnitSums(Statistic):
    """Σu (D floats), Σ‖u‖², the number of vectors and of zero vectors, over the unit-normalised pooled vectors."""

    name = "unit_sums"

    def __init__(self) -> None:
        super().__init__()
        self.add_state("sum_u", torch.zeros(0, dtype=torch.float64), "sum", shape=("D",))
        self.add_state("sum_sq", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("n_zero", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch: LayerBatch) -> None:
        assert batch.pooled is not None
        u = unit_rows(batch.pooled.double())
        s = u.sum(0)
        self.sum_u = s if self.sum_u.numel() == 0 else self.sum_u + s
        sq = (u * u).sum(-1)
        self.sum_sq = self.sum_sq + sq.sum()
        self.n = self.n + u.shape[0]
        self.n_zero = self.n_zero + (sq == 0).sum()

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)
        n, n_zero, sq, s = state["n"], state["n_zero"], state["sum_sq"], state["sum_u"]
        if not (self.is_count(n) and self.is_count(n_zero) and n_zero <= n):
            return problems + [f"counts n={float(n)}, n_zero={float(n_zero)} are not whole numbers with n_zero ≤ n"]
        tol = 1e-6 * max(float(n), 1.0)
        if abs(float(sq) - float(n - n_zero)) > tol:  # every non-zero unit vector adds exactly 1
            problems.append(f"sum_sq = {float(sq)} but n − n_zero = {float(n - n_zero)} unit vectors were added")
        if s.numel() and float(torch.linalg.vector_norm(s)) > float(sq) + tol:
            problems.append("sum_u is longer than the number of unit vectors summed")
        return problems


class PooledGram(Statistic):
    """The linear Gram of the rows (the pooled vectors, unit-normalised with ``unit=True``), streamed.

    States: ``gram`` (Σ zzᵀ, D×D float64), ``rows`` (rows not folded yet), ``n`` and ``n_zero`` (zero rows). Rows
    are kept as they come while there are at most D of them, so that for N ≤ D the Gram is Z Zᵀ (N×N), the smaller
    form and paper B's branch rule (``ZᵀZ if N > D else ZZᵀ``, docs/metrics.md#dataset_entropy). Past D rows they are
    folded into ``gram`` in place, and from then on every batch is folded as it arrives: the state is D² floats plus
    one batch, with a peak of about 2·D² at the first fold (the rows held and the sum), what ``--dry-run`` counts.
    Shards merge exactly (sums add, row lists concatenate).
    """

    name = "pooled_gram"

    def __init__(self, unit: bool = False) -> None:
        super().__init__()
        self.unit = unit
        self.add_state("gram", torch.zeros(0, dtype=torch.float64), "sum", shape=("D", "D"))
        self.add_state("rows", [], "cat", shape=("N", "D"), max_rows="D")  # folded into gram past D rows
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("n_zero", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch: LayerBatch) -> None:
        assert batch.pooled is not None
        z = batch.pooled.double()
        if self.unit:
            z = unit_rows(z)
        self.n = self.n + z.shape[0]
        self.n_zero = self.n_zero + ((z * z).sum(-1) == 0).sum()
        self.rows.append(z)
        held = sum(r.shape[0] for r in self.rows)
        if self.gram.numel() or held > z.shape[1]:
            if self.gram.numel() == 0:
                self.gram = z.new_zeros((z.shape[1], z.shape[1]))
            fold_rows(self.gram, self.rows)
            self.rows = []

    def gram_matrix(self) -> tuple[torch.Tensor, int, int] | None:
        """(the smaller linear Gram of all rows seen, N, D), or None before any row."""
        r = torch.cat(self.rows) if self.rows else None
        if self.gram.numel() == 0:
            if r is None or r.shape[0] == 0:
                return None
            return linear_gram(r), r.shape[0], r.shape[1]
        g = self.gram if r is None else fold_rows(self.gram.clone(), self.rows)  # one D×D beside the state
        return g, int(self.n), g.shape[0]

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)
        n, n_zero = state["n"], state["n_zero"]
        if not (self.is_count(n) and self.is_count(n_zero) and n_zero <= n):
            problems.append(f"counts n={float(n)}, n_zero={float(n_zero)} are not whole numbers with n_zero ≤ n")
        return problems


FOLD_ROWS = 256  # rows per product when a Gram is folded


def fold_rows(gram: "torch.Tensor", rows: list) -> "torch.Tensor":
    """``gram += Σ rᵀr`` over the rows of ``rows`` (a list of [n_i, D] blocks), in place, in blocks of
    :data:`FOLD_ROWS` consecutive rows of their concatenation: no copy of all the rows and no D×D temporary beside
    the sum. The blocks depend only on the rows, not on how the list splits them, so a run resumed from a
    checkpoint (whose rows come back as one block) folds exactly as the run that was never stopped."""
    pending: list = []
    count = 0
    for r in rows:
        start = 0
        while start < r.shape[0]:
            take = min(FOLD_ROWS - count, r.shape[0] - start)
            pending.append(r[start:start + take])
            count += take
            start += take
            if count == FOLD_ROWS:
                block = pending[0] if len(pending) == 1 else torch.cat(pending)
                gram.addmm_(block.T, block)
                pending, count = [], 0
    if pending:
        block = pending[0] if len(pending) == 1 else torch.cat(pending)
        gram.addmm_(block.T, block)
    return gram
