"""Layer-by-layer metrics of paper B and the Vendi score (paper A, A.5); formulas and defaults in docs/metrics.md
(#prompt_entropy, #dataset_entropy, #effective_rank, #curvature, #vendi).

* ``prompt_entropy``  (tokens)  matrix entropy of each prompt's centred, unit token vectors, mean over prompts
* ``dataset_entropy`` (pooled)  matrix entropy of the centred, unit pooled vectors of all prompts
* ``effective_rank``  (pooled)  RankMe, erank and exp(S₁) of the pooled matrix, no centring
* ``curvature``       (tokens)  mean turning angle of each prompt's token trajectory, mean over prompts
* ``vendi``           (pooled)  exp of the entropy of the cosine-similarity kernel of the pooled vectors

The math lives in :mod:`repgeom_eval.functional.entropy` and :mod:`repgeom_eval.functional.curvature`; the classes
here only keep mergeable state.
"""

from __future__ import annotations

from collections import deque

from repgeom_eval import Consumes, LayerBatch, Metric, hookimpl
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.plugin_system.lazy import lazy

from .host_copies import HostCopies
from .token_metric import TokenMetric
from repgeom_eval.spec.names import CURVATURE_VARIANTS, ENTROPY_CENTERINGS, ENTROPY_VARIANTS, PROMPT_ENTROPY_SPECTRA

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")
curvature = lazy("repgeom_eval.functional.curvature:curvature")
dataset_entropy = lazy("repgeom_eval.functional.entropy:dataset_entropy")
effective_rank_from_gram_eigenvalues = lazy("repgeom_eval.functional.rank:effective_rank_from_gram_eigenvalues")
entropy_result = lazy("repgeom_eval.functional.entropy:entropy_result")
gram_entropy = lazy("repgeom_eval.functional.entropy:gram_entropy")
linear_gram = lazy("repgeom_eval.functional.entropy:linear_gram")
prompt_entropy = lazy("repgeom_eval.functional.entropy:prompt_entropy")
spectrum_entropy = lazy("repgeom_eval.functional.entropy:spectrum_entropy")

_NAN = float("nan")
ENTROPY_KEYS = ("raw", "normalized", "logN", "logD")


def _check_choice(metric: str, param: str, value, choices) -> None:
    if value not in choices:
        raise RepgeomError(f"{metric}: {param} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_alpha(metric: str, alpha) -> float:
    try:
        alpha = float(alpha)
    except (TypeError, ValueError):
        raise RepgeomError(f"{metric}: alpha must be a number ≥ 0, got {alpha!r}") from None
    if not alpha >= 0:
        raise RepgeomError(f"{metric}: alpha must be a number ≥ 0, got {alpha!r}")
    return alpha


class _GramMetric(Metric):
    """A pooled metric that reads only the linear Gram of its rows: the shared
    :class:`~repgeom_eval.spec.statistics.PooledGram`, which keeps the Grams of the raw and of the unit rows in one
    (D+1)×D array (the unit one read with ``unit_rows = True``), so every such metric of the same pooling shares one
    state (docs/plugins.md#shared-statistics)."""

    unit_rows = False

    def statistics(self):
        from repgeom_eval.spec.statistics import PooledGram

        return {"gram": PooledGram()}

    def _gram(self):
        """(the smaller linear Gram of all rows seen, N, D), or None before any row."""
        return self.stat("gram").gram_matrix(unit=self.unit_rows)

    def diagnostics(self):
        g = self.stat("gram")
        return {"n_vectors": int(g.n), "n_zero_vectors": int(g.n_zero_unit if self.unit_rows else g.n_zero)}


class PromptEntropy(TokenMetric):
    """Prompt entropy (paper B; docs/metrics.md#prompt_entropy), averaged over prompts.

    Per prompt: Z = the prompt's non-pad token vectors, centred over the prompt and unit-normalised; S_α of the
    linear Gram of Z (the smaller of ZZᵀ/ZᵀZ), with p_i = λ_i/Σλ over the positive eigenvalues. Reports the mean
    over prompts of ``raw`` = S_α, ``normalized`` = S_α / log min(N, D) (B's ``maxEntropy``, the value B reports),
    ``logN`` = S_α / log N and ``logD`` = S_α / log D.

    Parameters: ``alpha`` (default 1, von Neumann); ``variant`` = ``"paper"`` (default, no clamp) or
    ``"information_flow"`` (B's code: elementwise clamp(K, 0) on the branch it picks, then trace normalisation);
    ``spectra`` = ``"auto"`` (default: ``"host"`` when the hidden states are on a GPU, else ``"device"``),
    ``"device"`` (solved where the hidden states are) or ``"host"`` (the Grams are copied to the host and solved on
    its cores while the GPU goes on: plugins/host_spectra.py; on an H200 with 16 host cores, at 512 tokens,
    the 8B layer-wise suite's added time per batch was 1.9× the forward this way against 10.8× solved on the GPU,
    benchmarks/results/gpu_profile.json).
    Prompts with fewer than 2 tokens have no value (NaN); they are skipped and counted (``n_skipped``).

    State: the four sums over prompts and the prompt count (plus per-prompt values with ``per_text=True``); with
    ``spectra="host"``, the batches whose spectra are still being solved, folded in order before any state is read.
    """

    name = "prompt_entropy"
    consumes = Consumes.TOKENS

    def __init__(self, alpha: float = 1.0, variant: str = "paper", per_text: bool = False, spectra: str = "auto"):
        super().__init__()
        self.alpha = _check_alpha(self.name, alpha)
        _check_choice(self.name, "variant", variant, ENTROPY_VARIANTS)
        _check_choice(self.name, "spectra", spectra, PROMPT_ENTROPY_SPECTRA)
        self.variant = variant
        self.per_text = per_text
        self.spectra = spectra
        # α = 2 of the paper variant reads two traces: no spectrum to move (collision_entropy)
        self._solves = not (self.alpha == 2 and variant == "paper")
        self._solving: deque = deque()  # (text index, future) of batches on the host's cores, oldest first
        self.add_state("sums", torch.zeros(len(ENTROPY_KEYS), dtype=torch.float64), "sum", shape=(len(ENTROPY_KEYS),))
        self.add_state("count", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("skipped", torch.zeros((), dtype=torch.float64), "sum", shape=())
        if per_text:
            self.add_per_text_states(2)

    def update_tokens(self, index: torch.Tensor, block) -> None:
        """:meth:`update` from a :class:`~repgeom_eval.functional.tokens.TokenBlock`: the Grams of all prompts from one
        batched product, their eigendecompositions in one batched call (:func:`~repgeom_eval.functional.entropy.
        prompt_entropies`)."""
        from repgeom_eval.functional.entropy import prompt_entropies

        if self._on_host(block.hidden.device):
            from .host_spectra import submit

            self._solving.append((index, submit(block, self.alpha, self.variant)))  # bounded in host_spectra
            return
        values = prompt_entropies(block, self.alpha, self.variant)  # columns in ENTROPY_KEYS order
        self.fold_texts(index, values, values[:, :2])

    def _on_host(self, device: "torch.device | None") -> bool:
        """Whether the spectra of hidden states on ``device`` (None: not known yet, as in the dry run) are solved on
        the host's cores."""
        if not self._solves:
            return False
        if self.spectra == "auto":
            return device is not None and device.type != "cpu"
        return self.spectra == "host"

    def _fold_one(self) -> None:
        index, future = self._solving.popleft()
        values = future.result().to(self.sums.device, non_blocking=True)
        self.fold_texts(index, values, values[:, :2])

    def _settle(self) -> None:
        """Fold every batch still being solved on the host, in the order they came."""
        while self._solving:
            self._fold_one()

    def state_dict(self, copy: bool = True):
        self._settle()
        return super().state_dict(copy)

    def merge(self, other):
        self._settle()
        if isinstance(other, PromptEntropy):
            other._settle()
        return super().merge(other)

    def reset(self) -> None:
        self._settle()  # nothing left running to fold into the fresh states later
        super().reset()

    def load_state_dict(self, state) -> None:
        self._settle()  # likewise for the loaded ones
        super().load_state_dict(state)

    def work_note(self, tokens: int, width: int) -> str | None:
        if self.alpha == 2 and self.variant == "paper":
            return None  # S_2 from two traces of the Gram the block already holds (collision_entropy)
        m = min(tokens, width)
        where = ""
        if self.spectra in ("host", "auto"):
            from .host_spectra import workers

            where = (f", solved on the host's {workers()} cores (up to {2 * workers()} batches of Grams, "
                     f"{m}×{m} float64 per text, in host memory at once)")
            if self.spectra == "auto":
                where += " when the hidden states are on a GPU (spectra: auto), else beside them"
        return (f"one float64 eigendecomposition of up to {m}×{m} per text and address{where}: its time grows as "
                f"min(T, D)³ with the context length T (the forward's about as T); alpha: 2 (paper variant) "
                f"needs none, a shorter --max-length shrinks it")

    def compute(self) -> dict[str, float]:
        self._settle()
        if self.count == 0:
            return {k: _NAN for k in ENTROPY_KEYS}
        return {k: float(v) for k, v in zip(ENTROPY_KEYS, self.sums / self.count)}

    def per_text_results(self):
        self._settle()
        kept = self.kept_per_text()
        if kept is None:
            return None
        idx, v = kept
        return {"prompt_entropy": (idx, v[:, 0]), "prompt_entropy_normalized": (idx, v[:, 1])}

    def diagnostics(self):
        self._settle()
        return {"n_texts": int(self.count), "n_skipped": int(self.skipped)}


class DatasetEntropy(HostCopies, _GramMetric):
    """Dataset entropy (paper B; docs/metrics.md#dataset_entropy): S_α of the Gram of one pooled vector per prompt.

    Default pooling ``mean`` (attention-masked). ``centering``:

    * ``"global"`` (default): centre over all N prompts, then unit rows. Centring followed by unit-normalising is
      nonlinear, so no fixed-size sufficient statistic exists: the pooled vectors are kept (a ``"cat"`` state,
      N·D floats, plus each text's index) and the matrix is prepared at compute time.
    * ``"batch"``: B's code, centring each block of ``batch_size`` consecutive prompts (in input order, whatever
      batches the pipeline used), default 2 (B's final setting; it turns each pair into antipodal vectors).
      Same ``"cat"`` state.
    * ``"none"``: unit rows only. Then the Gram Σ uuᵀ *is* sufficient, and the metric streams it (D² + D
      floats, the shared ``PooledGram`` statistic) and diagonalises the smaller form at compute.

    ``variant`` and ``alpha`` as for ``prompt_entropy``. Reports ``raw``, ``normalized`` (= raw / log min(N, D),
    B's ``maxEntropy``), ``logN`` and ``logD``; NaN for fewer than 2 prompts.
    """

    name = "dataset_entropy"
    consumes = Consumes.POOLED
    default_pooling = "mean"

    def __init__(self, alpha: float = 1.0, variant: str = "paper", centering: str = "global", batch_size: int = 2):
        super().__init__()
        self.alpha = _check_alpha(self.name, alpha)
        _check_choice(self.name, "variant", variant, ENTROPY_VARIANTS)
        _check_choice(self.name, "centering", centering, ENTROPY_CENTERINGS)
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise RepgeomError(f"{self.name}: batch_size must be a positive integer, got {batch_size!r}")
        self.variant, self.centering, self.batch_size = variant, centering, batch_size
        if centering != "none":
            self.state_device = "cpu"  # the kept vectors grow with the data: host memory, also after a resume
            self.add_state("vectors", [], "cat", shape=("N", "D"))
            self.add_state("index", [], "cat", shape=("N",))
            # compute: the vectors gathered in text order (one copy, centred in place), their Gram, eigvalsh's copy
            # and workspace (measured at N·D + 2.65 D², benchmarks/bench_state_memory.py)
            self.compute_temporaries = (("N", "D"), ("D", "D"), ("D", "D"), ("D", "D"))

    unit_rows = True

    def statistics(self):
        # Only without centring is the Gram of the unit rows sufficient (shared with vendi at the same pooling).
        return super().statistics() if self.centering == "none" else {}

    def update(self, batch: LayerBatch) -> None:
        assert batch.pooled is not None
        if self.centering == "none":
            super().update(batch)
        else:  # kept in host memory (they grow with the data), copied without waiting for the device
            self.vectors.append(self._to_host(batch.pooled.double()))
            self.index.append(self._to_host(batch.index.to(torch.float64)))

    def compute(self) -> dict[str, float]:
        self._settle()
        if self.centering != "none":
            if not self.vectors:
                return {k: _NAN for k in ENTROPY_KEYS}
            x = self._in_text_order()
            if self.centering == "global" and x.shape[0] >= 2:  # centred in place: no second [N, D] copy
                from repgeom_eval.functional.entropy import center_and_unit_, matrix_entropy

                return matrix_entropy(center_and_unit_(x), self.alpha, self.variant)
            return dataset_entropy(x, self.alpha, self.centering, self.batch_size, self.variant)
        found = self._gram()
        if found is None or found[1] < 2:
            return {k: _NAN for k in ENTROPY_KEYS}
        g, n, d = found
        return entropy_result(float(gram_entropy(g, self.alpha, self.variant)), n, d)

    def _in_text_order(self) -> torch.Tensor:
        """The kept vectors as one [N, D] float64 array in text order (the order a single pass would give, however
        the batches and shards came), written in place: one copy, not a concatenation and then its reordering."""
        index = torch.cat(self.index)
        order = torch.argsort(index, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device)
        x = self.vectors[0].new_empty((len(order), self.vectors[0].shape[1]), dtype=torch.float64)
        start = 0
        for v in self.vectors:
            x[rank[start:start + v.shape[0]]] = v
            start += v.shape[0]
        return x

    def diagnostics(self):
        if self.centering == "none":
            return super().diagnostics()
        return {"n_vectors": sum(int(v.shape[0]) for v in self.vectors)}  # shapes only: no copy needs to land


class EffectiveRank(_GramMetric):
    """Effective rank of the pooled matrix Z (N texts × D), no centring (docs/metrics.md#effective_rank).

    Reports three numbers under their own names, because two different quantities are called "effective rank":

    * ``rankme`` (Garrido et al. 2023; the project's "effective rank"): p_k = σ_k/‖σ‖₁ + 1e-7 over the min(N, D)
      singular values of Z, RankMe = exp(−Σ p_k log p_k);
    * ``erank`` (Roy & Vetterli 2007): the same without ε, over σ > 0;
    * ``exp_entropy``: exp(S₁(ZZᵀ)), the exponential of paper B's von Neumann entropy, which uses σ² (not σ).

    Default pooling ``mean``. Only the singular values are needed and σ² are the eigenvalues of ZᵀZ, so the state
    is the streamed Gram (D² + D floats, the shared ``PooledGram`` statistic); eigenvalues below the solver's
    round-off floor count as zero. A zero matrix gives 0.0 for all three; no data gives NaN.
    """

    name = "effective_rank"
    consumes = Consumes.POOLED
    default_pooling = "mean"

    def compute(self) -> dict[str, float]:
        found = self._gram()
        if found is None:
            return {"rankme": _NAN, "erank": _NAN, "exp_entropy": _NAN}
        from repgeom_eval.functional.entropy import serial_eigvalsh

        g, n, d = found
        return effective_rank_from_gram_eigenvalues(serial_eigvalsh(g), n, d)


class Curvature(TokenMetric):
    """Curvature of each prompt's token trajectory (paper B; docs/metrics.md#curvature), averaged over prompts.

    ``variant="paper"`` (default): on the raw token vectors, with v_k = z_{k+1} − z_k, the mean over k of
    arccos(v_{k+1}·v_k / (‖v_{k+1}‖‖v_k‖)), angles in [0, π]. Angles next to a zero-length difference (a repeated
    token) are skipped; prompts with N ≤ 2 tokens (or no defined angle) have no value and are skipped and counted.
    ``variant="information_flow"``: B's code, on centred, unit-normalised tokens, with |cos| (angles in [0, π/2]),
    undefined angles counted as 0 and N ≤ 2 giving 0 (those prompts are averaged in, as in B's code).

    Reports the means over prompts of ``raw`` (the mean angle, radians, what B reports) and ``logD`` = raw / log D.
    State: the two sums and the prompt count (plus per-prompt values with ``per_text=True``).
    """

    name = "curvature"
    consumes = Consumes.TOKENS

    def __init__(self, variant: str = "paper", per_text: bool = False):
        super().__init__()
        _check_choice(self.name, "variant", variant, CURVATURE_VARIANTS)
        self.variant = variant
        self.per_text = per_text
        self.add_state("sums", torch.zeros(2, dtype=torch.float64), "sum", shape=(2,))
        self.add_state("count", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("skipped", torch.zeros((), dtype=torch.float64), "sum", shape=())
        if per_text:
            self.add_per_text_states()

    def update_tokens(self, index: torch.Tensor, block) -> None:
        """:meth:`update` from a :class:`~repgeom_eval.functional.tokens.TokenBlock`: the angles of all prompts as a
        few batched float64 operations (:func:`~repgeom_eval.functional.curvature.curvature_block`)."""
        from repgeom_eval.functional.curvature import curvature_block

        values = curvature_block(block, self.variant)  # columns raw, logD
        self.fold_texts(index, values, values[:, 0])

    def compute(self) -> dict[str, float]:
        if self.count == 0:
            return {"raw": _NAN, "logD": _NAN}
        mean = self.sums / self.count
        return {"raw": float(mean[0]), "logD": float(mean[1])}

    def per_text_results(self):
        kept = self.kept_per_text()
        return None if kept is None else {"curvature": kept}

    def diagnostics(self):
        return {"n_texts": int(self.count), "n_skipped_short": int(self.skipped)}


class Vendi(_GramMetric):
    """Vendi score of the pooled vectors with cosine similarity (Friedman & Dieng 2023; paper A, appendix A.5).

    U = unit rows (one pooled vector per text; default pooling ``last``, like ``dispersion``), K = UUᵀ,
    Vendi = exp(−Σ λ log λ) over the eigenvalues λ of K/N = exp(S₁(K)). It is an "effective number of distinct
    texts": 1 when all vectors are parallel, N when they are mutually orthogonal. UUᵀ and UᵀU share their non-zero
    spectrum, so the state is the streamed Gram (D² + D floats, the shared ``PooledGram`` statistic). Zero vectors
    have no direction and are ignored (counted in ``n_zero_vectors``). No data, or only zero vectors, gives NaN.
    """

    name = "vendi"
    consumes = Consumes.POOLED
    default_pooling = "last"

    unit_rows = True

    def compute(self) -> float:
        from repgeom_eval.functional.entropy import serial_eigvalsh

        found = self._gram()
        if found is None:
            return _NAN
        return float(torch.exp(spectrum_entropy(serial_eigvalsh(found[0]), 1.0)))


@hookimpl
def repgeom_register_metrics(registry):
    registry.add(PromptEntropy)
    registry.add(DatasetEntropy)
    registry.add(EffectiveRank)
    registry.add(Curvature)
    registry.add(Vendi)
