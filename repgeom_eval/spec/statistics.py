"""The built-in shared statistics (docs/plugins.md#shared-statistics): what several metrics read from the same pooled
vectors, kept once per address and pooling however many metrics read it.

* :class:`UnitSums`: Σu, Σ‖u‖² and the counts of the unit vectors, the O(N·d) identity behind ``dispersion``;
* :class:`PooledGram`: the streamed linear Grams of the rows, raw and unit-normalised, packed in one (D+1)×D array:
  the unit Gram behind ``vendi`` and ``dataset_entropy`` with ``centering="none"``, the raw one behind
  ``effective_rank``.

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
    """The linear Grams of the pooled vectors, streamed: Σ zzᵀ of the raw rows and Σ uuᵀ of the unit rows, together
    in one (D+1)×D float64 array, since each is symmetric and half of it says all (docs/plugins.md#shared-statistics).

    States: ``grams`` (the raw Gram's lower triangle, diagonal included, one row down, in rows 1…D; the unit Gram's
    upper triangle, diagonal included, in rows 0…D−1), ``rows`` (raw rows not folded yet), ``n``, ``n_zero`` (zero
    raw rows) and ``n_zero_unit`` (zero unit rows). Rows are kept as they come while there are at most D of them, so
    that for N ≤ D a Gram is Z Zᵀ (N×N), the smaller form and paper B's branch rule (``ZᵀZ if N > D else ZZᵀ``,
    docs/metrics.md#dataset_entropy). Past D rows they are folded into ``grams`` and from then on every batch is
    folded as it arrives, so an address holds D² + D floats, whether one metric reads one Gram or three metrics read
    both (the rows before the fold sit in one block that is never larger). Folding both triangles costs one D×D
    product a row, as a single full Gram did. Shards merge exactly (sums add, row lists concatenate).
    """

    name = "pooled_gram"
    # a reader's compute: the Gram rebuilt whole, eigvalsh's column-major copy of it, and LAPACK's blocked workspace
    # beside that copy, a few hundred columns of D (eigvalsh alone raised the peak by 1.06-1.23 D² at D = 2048-4096
    # on 1-2 threads; a reader's whole compute by 2.26 D² at D = 2048, benchmarks/bench_state_memory.py)
    compute_temporaries = (("D", "D"), ("D", "D"), ("D", 512))

    def __init__(self) -> None:
        super().__init__()
        self.add_state("grams", torch.zeros(0, dtype=torch.float64), "sum", shape=("D+1", "D"))
        # folded into grams past D rows; the two are both held only while one address folds
        self.add_state("rows", [], "cat", shape=("N", "D"), max_rows="D", folds_into="grams")
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("n_zero", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("n_zero_unit", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch: LayerBatch) -> None:
        assert batch.pooled is not None
        z = batch.pooled.double()
        self.n = self.n + z.shape[0]
        self.n_zero = self.n_zero + ((z * z).sum(-1) == 0).sum()
        u = unit_rows(z)
        self.n_zero_unit = self.n_zero_unit + ((u * u).sum(-1) == 0).sum()
        width = z.shape[1]
        held = sum(r.shape[0] for r in self.rows)
        if self.grams.numel() or held + z.shape[0] > width:
            if self.grams.numel() == 0:
                self.grams = z.new_zeros((width + 1, width))
            fold_rows(self.grams, self.rows + [z])
            self.rows, self._buffer = [], None  # the buffer's memory goes back before the next address folds
        else:
            self._keep(z, held, width)

    def _buffered_rows(self) -> int | None:
        """How many rows the block holds, when the rows are its view (not a merged or loaded list); else None."""
        buffer = getattr(self, "_buffer", None)
        if buffer is not None and len(self.rows) == 1 and self.rows[0].data_ptr() == buffer.data_ptr():
            return self.rows[0].shape[0]
        return None

    def state_bytes(self) -> int:
        """As held: the rows' whole block (its capacity), not only the rows it holds so far."""
        if self._buffered_rows() is None:
            return super().state_bytes()
        return super().state_bytes() - self.rows[0].numel() * 8 + self._buffer.numel() * 8

    def reset(self) -> None:
        super().reset()
        self._buffer = None

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        self._buffer = None  # the loaded rows are their own tensor; the next batch gathers them into a new block

    def to(self, device):
        held = self._buffered_rows()
        super().to(device)
        if held is None:
            self._buffer = None
        else:  # the block moves whole, and the rows stay its view
            self._buffer = self._buffer.to(device)
            self.rows = [self._buffer[:held]]
        return self

    def _keep(self, z: "torch.Tensor", held: int, width: int) -> None:
        """Append ``z`` to the rows, held in one block that doubles as it fills, up to (D+1)×D: the size of the
        Gram it is folded into, so the allocator hands the block freed by one address's fold to the next address's
        Gram (not a new one beside it) and the many batch-sized pieces never pile up."""
        buffer = getattr(self, "_buffer", None)
        mine = self._buffered_rows() is not None and buffer.device == z.device
        if not mine or held + z.shape[0] > buffer.shape[0]:
            rows = self.rows if self.rows else []
            capacity = width + 1 if held + z.shape[0] > width // 2 else max(16, 2 * (held + z.shape[0]))
            buffer = z.new_empty((capacity, width))
            if rows:
                torch.cat(rows, out=buffer[:held]) if len(rows) > 1 else buffer[:held].copy_(rows[0])
            self._buffer = buffer
        buffer[held:held + z.shape[0]] = z
        self.rows = [buffer[:held + z.shape[0]]]

    def gram_matrix(self, unit: bool = False) -> tuple[torch.Tensor, int, int] | None:
        """(the smaller linear Gram of all rows seen, of the unit rows with ``unit=True``, N, D), or None before any
        row. The D×D form is rebuilt whole from its triangle: one D×D beside the state, for one address at a time."""
        r = torch.cat(self.rows) if self.rows else None
        if self.grams.numel() == 0:
            if r is None or r.shape[0] == 0:
                return None
            return linear_gram(unit_rows(r) if unit else r), r.shape[0], r.shape[1]
        g = unpack(self.grams, unit)
        if r is not None and r.shape[0]:  # rows not folded yet (a merged shard, a resumed state)
            z = unit_rows(r) if unit else r
            for start in range(0, z.shape[0], FOLD_ROWS):
                block = z[start:start + FOLD_ROWS]
                g.addmm_(block.T, block)
        return g, int(self.n), g.shape[0]

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)
        n, zeros = state["n"], (state["n_zero"], state["n_zero_unit"])
        if not (self.is_count(n) and all(self.is_count(z) and z <= n for z in zeros)):
            problems.append(f"counts n={float(n)}, n_zero={float(zeros[0])}, n_zero_unit={float(zeros[1])} are not "
                            "whole numbers with n_zero ≤ n")
        g = state.get("grams")
        if isinstance(g, torch.Tensor) and g.ndim == 2 and g.shape[0] == g.shape[1] + 1:
            if (g[1:].diagonal() < 0).any() or (g[:-1].diagonal() < 0).any():
                problems.append("grams has a negative diagonal entry: a sum of squares cannot be negative")
        return problems


FOLD_ROWS = 256  # rows per product when a Gram is folded


def tile_width(width: int) -> int:
    """Columns folded per product: at least 512 (products large enough to run at full speed), at most 8 tiles a
    side (few products a batch on a GPU); the product's D×tile temporary is at most D²/8."""
    return max(512, -(-width // 8))


def fold_rows(grams: "torch.Tensor", rows: list) -> "torch.Tensor":
    """``grams += `` the triangles of Σ rᵀr (raw rows, below) and Σ uᵀu (their unit rows, above) over the rows of
    ``rows`` (a list of raw [n_i, D] blocks), in place, in blocks of :data:`FOLD_ROWS` consecutive rows of their
    concatenation. The blocks depend only on the rows, not on how the list splits them, so a run resumed from a
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
                fold_block(grams, pending[0] if len(pending) == 1 else torch.cat(pending))
                pending, count = [], 0
    if pending:
        fold_block(grams, pending[0] if len(pending) == 1 else torch.cat(pending))
    return grams


def fold_block(grams: "torch.Tensor", z: "torch.Tensor") -> None:
    """Fold one block of raw rows ``z`` [b, D] into the packed ``grams`` [(D+1), D], one tile of columns at a time:
    each triangle costs half a D×D product, and the only temporaries are the diagonal tiles' products."""
    u = unit_rows(z)
    width = z.shape[1]
    step = tile_width(width)
    for c0 in range(0, width, step):
        c1 = min(c0 + step, width)
        # raw Gram, rows i ≥ j, stored at grams[i + 1, j]
        grams[c0 + 1:c1 + 1, c0:c1] += (z[:, c0:c1].T @ z[:, c0:c1]).tril()
        if c1 < width:
            grams[c1 + 1:, c0:c1].addmm_(z[:, c1:].T, z[:, c0:c1])
        # unit Gram, rows i ≤ j, stored at grams[i, j]
        grams[c0:c1, c0:c1] += (u[:, c0:c1].T @ u[:, c0:c1]).triu()
        if c0:
            grams[:c0, c0:c1].addmm_(u[:, :c0].T, u[:, c0:c1])


def unpack(grams: "torch.Tensor", unit: bool) -> "torch.Tensor":
    """The whole symmetric D×D Gram (of the unit rows with ``unit=True``) from the packed ``grams`` [(D+1), D]: one
    D×D copy, its other triangle filled a tile at a time (no second D×D temporary)."""
    g = (grams[:-1] if unit else grams[1:]).clone()
    width = g.shape[0]
    step = tile_width(width)
    for c0 in range(0, width, step):
        c1 = min(c0 + step, width)
        tile = g[c0:c1, c0:c1]
        if unit:  # the upper triangle is the Gram's: copy it below
            tile.copy_(tile.triu() + tile.triu(1).T)
            g[c1:, c0:c1] = g[c0:c1, c1:].T
        else:  # the lower triangle is the Gram's: copy it above
            tile.copy_(tile.tril() + tile.tril(-1).T)
            g[c0:c1, c1:] = g[c1:, c0:c1].T
    return g
