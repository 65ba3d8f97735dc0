"""Multi-view metrics of paper B (Layer by Layer): ``infonce``, ``lidar`` and ``dime`` (docs/metrics.md#infonce,
docs/metrics.md#lidar, docs/metrics.md#dime).

Each consumes augmented views (``Consumes.VIEWS``): the pipeline makes ``n_views`` augmentations of every text,
mean-pools each one over its real tokens (``default_pooling = "mean"``) and hands them over as ``batch.views``
[B, n_views, D] (float64).

View treatment (a project decision, documented here because it changes numbers): each pooled view vector is
**unit-normalized on its own** (v/max(‖v‖, 1e-12)), with **no centring**. Paper B's code instead centres each
forward mini-batch of pooled vectors on its mean before unit-normalizing; with its batch size of 2 that turns
every pair into two antipodal vectors. Centring over the whole data set would need a second pass over the data;
per-view normalization keeps every state streaming and independent of the batch size
(docs/metrics.md#augmented-views).

States and memory:

* ``infonce`` and ``dime`` need every pair of vectors (an N×N matrix at compute time), so they keep all unit
  views as ``"cat"`` states (2·N·D floats) plus each text's index. At compute time the rows are put in text
  order, so the result does not depend on how the data was batched or sharded.
* ``lidar`` keeps O(D²) sufficient statistics (see :class:`LiDAR`), whatever the number of texts.
"""

from __future__ import annotations

from repgeom_eval import Consumes, LayerBatch, Metric, hookimpl
from repgeom_eval.spec.errors import RepgeomError, check_param, is_count, is_real
from repgeom_eval.plugin_system.lazy import lazy
from repgeom_eval.spec.names import INFONCE_VARIANTS, LIDAR_VARIANTS

from .host_copies import HostCopies

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")
dime = lazy("repgeom_eval.functional.contrastive:dime")
infonce = lazy("repgeom_eval.functional.contrastive:infonce")
lidar_from_stats = lazy("repgeom_eval.functional.contrastive:lidar_from_stats")
unit = lazy("repgeom_eval.functional.dispersion:unit")


def _unit_views(metric: Metric, batch: LayerBatch) -> torch.Tensor:
    views = batch.views
    if views is None:
        raise ValueError(f"{metric.name}: the batch carries no views (the metric consumes VIEWS)")
    if views.dim() != 3 or views.shape[1] != metric.n_views:
        raise ValueError(f"{metric.name}: expected views of shape [B, {metric.n_views}, D] "
                         f"(n_views={metric.n_views}), got {tuple(views.shape)}")
    return unit(views.double())  # where the views are: the model's device


class _TwoViewMetric(HostCopies, Metric):
    """Shared state of the two-view metrics: the unit views of every text (``"cat"``) and the text indices."""

    state_device = "cpu"  # the unit views grow with the data: host memory, copied without waiting (host_copies.py)

    consumes = Consumes.VIEWS
    default_pooling = "mean"

    def _init_views(self) -> None:
        self.add_state("view_a", [], "cat", shape=("N", "D"))
        self.add_state("view_b", [], "cat", shape=("N", "D"))
        self.add_state("index", [], "cat", shape=("N",))

    def update(self, batch: LayerBatch) -> None:
        u = _unit_views(self, batch)
        self.view_a.append(self._to_host(u[:, 0]))
        self.view_b.append(self._to_host(u[:, 1]))
        self.index.append(self._to_host(batch.index.detach().to(torch.float64).reshape(-1)))

    def _ordered(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._settle()
        if not self.view_a:
            return None
        a, b = torch.cat(self.view_a), torch.cat(self.view_b)
        order = torch.argsort(torch.cat(self.index), stable=True)
        return a[order], b[order]

    def diagnostics(self):
        return {"n_texts": int(sum(x.shape[0] for x in self.view_a))}


class InfoNCE(_TwoViewMetric):
    """InfoNCE between two augmented views of each text (paper B, docs/metrics.md#infonce).

    ``raw`` = L = mean_i −log softmax_j(a_i·b_j/τ)_i over the N texts (one direction A→B, τ = 0.1) and
    ``mi_lower_bound`` = 1 − L/log N (NaN for one text). ``variant="simclr"`` gives B's older 2N×2N form.
    Needs all vectors (N×N logits): the state is the two unit-normalized views of every text (``"cat"``) and the
    text indices, so memory grows as 2·N·D.
    """

    name = "infonce"

    def __init__(self, n_views: int = 2, tau: float = 0.1, variant: str = "one_directional"):
        super().__init__()
        if n_views != 2:
            raise RepgeomError(f"infonce uses exactly 2 views per text, got n_views={n_views}")
        if variant not in INFONCE_VARIANTS:
            raise RepgeomError(f"variant must be one of {INFONCE_VARIANTS}, got {variant!r}")
        check_param("infonce", "tau", tau, is_real(tau) and tau > 0, "a finite number > 0")
        self.n_views, self.tau, self.variant = n_views, tau, variant
        self._init_views()

    def compute(self) -> dict[str, float]:
        views = self._ordered()
        if views is None:
            return {"raw": float("nan"), "mi_lower_bound": float("nan")}
        return infonce(*views, tau=self.tau, variant=self.variant, normalize=False)


class DiME(_TwoViewMetric):
    """DiME between two augmented views of each text (paper B, docs/metrics.md#dime).

    DiME = mean_t S_1(K_A ∘ P_t K_B P_tᵀ) − S_1(K_A ∘ K_B) with linear kernels K = Z Zᵀ of the unit views,
    always the N×N Gram, and ``n_iters`` (default 10) permutations drawn from a generator seeded with ``seed``
    (default 0). Returns ``raw`` and ``normalized`` = raw / min(log N, log D) (B's ``maxEntropy``). Needs all
    vectors: the state is the two unit views of every text (``"cat"``, 2·N·D floats); the N×N Grams are built at
    compute time, with the texts in index order so the permutations, hence the value, do not depend on batching.
    """

    name = "dime"

    def __init__(self, n_views: int = 2, n_iters: int = 10, seed: int = 0, alpha: float = 1.0):
        super().__init__()
        if n_views != 2:
            raise RepgeomError(f"dime uses exactly 2 views per text, got n_views={n_views}")
        check_param("dime", "n_iters", n_iters, is_count(n_iters), "an integer ≥ 1")
        check_param("dime", "seed", seed, is_count(seed, 0), "an integer ≥ 0")
        check_param("dime", "alpha", alpha, is_real(alpha) and alpha > 0, "a finite number > 0")
        self.n_views, self.n_iters, self.seed, self.alpha = n_views, n_iters, seed, alpha
        self._init_views()

    def compute(self) -> dict[str, float]:
        views = self._ordered()
        if views is None:
            return {"raw": float("nan"), "normalized": float("nan")}
        return dime(*views, n_iters=self.n_iters, seed=self.seed, alpha=self.alpha, normalize=False)


class LiDAR(Metric):
    """LiDAR: the entropy of the linear-discriminant spectrum of views, each text being its own class.

    Default ``variant="thilak"`` (the original, docs/metrics.md#lidar): q = ``n_views`` = 16 views per text, δ = 1e-4,
    ε = 1e-7, S_b with 1/(n−1) and S_w with 1/(n(q−1)); returns ``lidar`` = exp(entropy) ∈ [1, min(D, n−1)] and
    ``log`` = the entropy. ``variant="information_flow"`` is paper B's code (1/n, 1/(nq), un-exponentiated
    von Neumann entropy, no ε): returns ``raw`` and ``normalized`` = raw / min(log n, log D) (B's ``maxEntropy``).

    State (all ``"sum"``, so memory is O(D²) for any number of texts). For text i with unit views x_i1..x_iq and
    mean μ_i = (1/q) Σ_j x_ij::

        n,   Σ_i μ_i [D],   Σ_i μ_i μ_iᵀ [D, D],   Σ_ij x_ij x_ijᵀ [D, D]

    Derivation: with μ = Σ_i μ_i / n (= the mean of all views, as q is the same for every text),
    Σ_i (μ_i−μ)(μ_i−μ)ᵀ = Σ_i μ_i μ_iᵀ − n μμᵀ and Σ_ij (x_ij−μ_i)(x_ij−μ_i)ᵀ = Σ_ij x_ij x_ijᵀ − q Σ_i μ_i μ_iᵀ, so
    S_b and S_w (hence Σ = S_w^{−½} S_b S_w^{−½}) follow from the four sums. Compute is O(D³).
    """

    name = "lidar"
    consumes = Consumes.VIEWS
    default_pooling = "mean"

    def __init__(self, n_views: int = 16, delta: float = 1e-4, eps: float = 1e-7, variant: str = "thilak"):
        super().__init__()
        if variant not in LIDAR_VARIANTS:
            raise RepgeomError(f"variant must be one of {LIDAR_VARIANTS}, got {variant!r}")
        if not isinstance(n_views, int) or isinstance(n_views, bool) or n_views < (2 if variant == "thilak" else 1):
            raise RepgeomError(f"lidar needs an integer n_views ≥ 1 (≥ 2 for the thilak variant), got {n_views!r}")
        check_param("lidar", "delta", delta, is_real(delta) and delta > 0, "a finite number > 0")
        check_param("lidar", "eps", eps, is_real(eps) and eps >= 0, "a finite number ≥ 0")
        self.n_views, self.delta, self.eps, self.variant = n_views, delta, eps, variant
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum", shape=())
        # Sizes depend on D, known at the first update: empty defaults (merge treats an empty sum as zero).
        self.add_state("sum_mean", torch.zeros(0, dtype=torch.float64), "sum", shape=("D",))
        self.add_state("sum_outer_mean", torch.zeros(0, dtype=torch.float64), "sum", shape=("D", "D"))
        self.add_state("scatter", torch.zeros(0, dtype=torch.float64), "sum", shape=("D", "D"))

    def update(self, batch: LayerBatch) -> None:
        x = _unit_views(self, batch)
        b, q, d = x.shape
        mu = x.mean(1)
        flat = x.reshape(b * q, d)
        stats = {"sum_mean": mu.sum(0), "sum_outer_mean": mu.T @ mu, "scatter": flat.T @ flat}
        for key, value in stats.items():
            old = getattr(self, key)
            setattr(self, key, value if old.numel() == 0 else old + value)
        self.n = self.n + b

    def compute(self) -> dict[str, float]:
        if self.sum_mean.numel() == 0:
            keys = ("lidar", "log") if self.variant == "thilak" else ("raw", "normalized")
            return {k: float("nan") for k in keys}
        return lidar_from_stats(int(self.n), self.n_views, self.sum_mean, self.sum_outer_mean, self.scatter,
                                delta=self.delta, eps=self.eps, variant=self.variant)

    def diagnostics(self):
        return {"n_texts": int(self.n)}


@hookimpl
def repgeom_register_metrics(registry):
    registry.add(InfoNCE)
    registry.add(LiDAR)
    registry.add(DiME)
