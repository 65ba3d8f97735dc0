"""Matrix-based entropies of representation sets (paper B; docs/metrics.md#matrix-entropy). Effective rank and the
Vendi score, which read the same spectra, are in :mod:`repgeom_eval.functional.rank`.

Everything runs in float64. Notation: ``Z ∈ R^{N×D}`` holds N row vectors; ``K = Z Zᵀ`` (N×N) and ``Zᵀ Z`` (D×D)
share their non-zero eigenvalues, so spectra are always taken from the smaller of the two (:func:`gram_spectrum`).

Matrix-based Rényi entropy of order α (docs/metrics.md#matrix-entropy, repitl ``matrix_itl.py``)::

    p_i = λ_i / Σ_{λ_j > 0} λ_j          (positive eigenvalues only; trace normalisation is implicit)
    S_α = 1/(1−α) · log Σ_i p_i^α        (α ≠ 1)
    S_1 = −Σ_i p_i log p_i               (α = 1, von Neumann; the project default)

Prompt entropy (docs/metrics.md#prompt_entropy) is S_α of the Gram of one prompt's centred, unit-normalised token
vectors; dataset entropy (docs/metrics.md#dataset_entropy) is the same on the pooled vectors of all prompts. The
project default (``variant="paper"``) is the paper's definition with no clamp; ``variant="information_flow"``
reproduces the public code of paper B, which clamps the Gram elementwise at 0 before trace-normalising
(docs/metrics.md#reference-code-variants).
"""

from __future__ import annotations

import math

import torch

from .dispersion import unit

from repgeom_eval.spec.names import ENTROPY_CENTERINGS as CENTERINGS, ENTROPY_VARIANTS as VARIANTS  # declared once
_NAN = float("nan")


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def _safe_ratio(value: float, denominator: float) -> float:
    return value / denominator if denominator > 0 else _NAN


def serial_eigvalsh(matrices: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    """``torch.linalg.eigvalsh`` of one matrix, a batch [R, m, m], or a list of matrices, on one CPU thread.

    On the CPU, LAPACK's ``syevd`` gains little or nothing from more threads at the sizes the metrics diagonalise
    (Grams of up to D×D) and spends up to twice the CPU time synchronising them (2 cores: 8 Grams of 150×150 take
    5.4 ms wall and 9.7 ms CPU on 2 threads, 4.2 ms both on one; one 576×576 Gram 12.7 ms wall and 24 ms CPU against
    13.7 ms both). So the intra-op thread count is set to 1 for the call and restored after it (other threads of the
    process that run torch meanwhile get one thread too). Spreading the matrices over Python threads instead was
    slower inside the pipeline (OpenMP's waiting threads compete with them). Other devices run as they are."""
    threads = torch.get_num_threads()
    single = isinstance(matrices, torch.Tensor)
    items = [matrices] if single else list(matrices)
    if not items:
        return []
    if items[0].device.type != "cpu" or threads == 1:
        out = [torch.linalg.eigvalsh(m) for m in items]
    else:
        torch.set_num_threads(1)
        try:
            out = [torch.linalg.eigvalsh(m) for m in items]
        finally:
            torch.set_num_threads(threads)
    return out[0] if single else out


def spectrum_entropy(eigenvalues: torch.Tensor, alpha: float = 1.0, rtol: float | None = None) -> torch.Tensor:
    """Rényi entropy S_α of a spectrum: p_i = λ_i / Σ λ_j over the positive λ only.

    Negative eigenvalues (round-off, or an indefinite clamped Gram) are dropped, as repitl's ``torch.gt(ek, 0)``.
    Eigenvalues at or below the solver's round-off floor, ``rtol · λ_max`` with default ``rtol = m · 2.2e-16``
    (m = number of eigenvalues), are dropped too: repitl keeps them, which changes S_1 by < 1e-13 but lets noise
    eigenvalues dominate for α < 1 (p^α of 1e-17 is 3e-9 at α = 1/2) and makes the N×N and D×D branches disagree.
    Pass ``rtol=0`` for repitl's exact rule. With no positive eigenvalue (a zero matrix) the entropy is undefined:
    NaN. ``alpha`` must be ≥ 0; α = 1 is the von Neumann (Shannon) limit.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    lam = eigenvalues.double().flatten()
    if rtol is None:
        rtol = lam.numel() * torch.finfo(torch.float64).eps
    top = lam.max() if lam.numel() else torch.tensor(0.0, dtype=torch.float64)
    lam = lam[(lam > 0) & (lam > rtol * top)]
    if lam.numel() == 0:
        return torch.tensor(_NAN, dtype=torch.float64)
    p = lam / lam.sum()
    if alpha == 1:
        h = -(p * torch.log(p)).sum()
    else:
        h = torch.log(torch.exp(alpha * torch.log(p)).sum()) / (1.0 - alpha)
    return h + 0.0  # a single eigenvalue gives -0.0; report +0.0


def renyi_entropy(K: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Matrix-based Rényi entropy S_α(K) of a symmetric matrix K (docs/metrics.md#matrix-entropy).

    The eigenvalues come from ``torch.linalg.eigvalsh``; only the positive ones (above the round-off floor of
    :func:`spectrum_entropy`) are kept and renormalised to sum to one, so K need not be trace-normalised, and an
    indefinite K (B's clamped Gram) is handled the way repitl handles it. α = 1 is the von Neumann entropy.
    Cost O(m³) for an m×m matrix.
    """
    return spectrum_entropy(serial_eigvalsh(K.double()), alpha)


def repitl_alpha2_shortcut(K: torch.Tensor) -> torch.Tensor:
    """repitl's α = 2 "Frobenius" shortcut, reproduced for comparison only (docs/metrics.md#matrix-entropy; oracle 21
    of docs/metrics.md#oracle-values).

    repitl computes the information potential as ``Σ_ij K_ij² / N²`` and returns ``−log`` of it. That equals
    Σ p_i² only when K has unit diagonal (tr K = N); on a trace-normalised K it is off by the factor N², e.g.
    K = I/3 gives log 27 = 3.295837 instead of the true S_2 = log 3. Use :func:`renyi_entropy` for real values.
    """
    K = K.double()
    n = K.shape[0]
    return -torch.log((K * K).sum() / (n * n))


def linear_gram(Z: torch.Tensor) -> torch.Tensor:
    """The smaller linear Gram of the rows of Z [N, D]: Z Zᵀ (N×N) if N ≤ D, else Zᵀ Z (D×D), in float64.

    This is both "the smaller of the two" (same non-zero spectrum) and exactly paper B's branch rule
    (``ZᵀZ if N > D else ZZᵀ``), which matters once an elementwise clamp is applied.
    """
    Z = Z.double()
    n, d = Z.shape
    g = Z @ Z.T if n <= d else Z.T @ Z
    # A BLAS product need not be bitwise symmetric (MKL's AVX-512 kernels are not). eigvalsh reads the lower
    # triangle, so mirroring it gives the same spectrum and one symmetric matrix on every CPU.
    return torch.tril(g).add_(torch.tril(g, -1).T)


def gram_spectrum(Z: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (ascending, float64) of the smaller of Z Zᵀ (N×N) and Zᵀ Z (D×D), via ``eigvalsh``.

    Both matrices have the same non-zero eigenvalues (the squared singular values of Z), so the result has
    min(N, D) entries. N ≤ D uses Z Zᵀ.
    """
    return serial_eigvalsh(linear_gram(Z))


def center_and_unit(Z: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Paper B's ``normalize``: subtract the mean row, then scale every row to unit length.

    ``unit`` uses ``max(‖z‖, eps)`` like ``F.normalize``, so a row that is zero after centring stays zero (cosine 0
    with everything). The B code has **no** eps: such a row (a 1-token prompt, identical vectors) becomes NaN there.
    """
    return center_and_unit_(Z.double().clone(), eps)


def center_and_unit_(Z: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """:func:`center_and_unit` in place, on a float64 ``Z`` the caller owns (no [N, D] copy); returns ``Z``. The
    same operations as ``F.normalize(Z − mean)``, so the same numbers to the bit."""
    Z.sub_(Z.mean(0, keepdim=True))
    return Z.div_(torch.linalg.vector_norm(Z, 2, dim=-1, keepdim=True).clamp_min(eps))


def collision_entropy(grams: torch.Tensor) -> torch.Tensor:
    """S_2 of positive semi-definite Grams [..., m, m] from two traces, with no eigendecomposition
    (docs/metrics.md#matrix-entropy): Σ p_i² = Σ λ_i² / (Σ λ_i)² = ‖K‖_F² / (tr K)², so S_2 = −log(‖K‖_F² / (tr K)²).

    O(m²) instead of the spectrum's O(m³). For a PSD K it equals :func:`spectrum_entropy` at α = 2 up to the
    eigenvalues that rule drops as round-off (below m · eps · λ_max, which move S_2 by about that much relative);
    a zero trace gives NaN as a spectrum with no positive eigenvalue does. Not for an indefinite K (B's clamped
    Gram), whose negative eigenvalues the spectrum rule drops and the Frobenius norm counts."""
    k = grams.double()
    trace = k.diagonal(dim1=-2, dim2=-1).sum(-1)
    ok = trace > 0
    potential = k.square().sum((-2, -1)) / torch.where(ok, trace, torch.ones_like(trace)).square()
    # Σp² ≤ 1 for a PSD K; round-off can put it a few ulps above (a rank-one K), which would give S_2 = −1e-16
    h = (-torch.log(torch.where(ok, potential, torch.ones_like(potential)))).clamp(min=0)
    return torch.where(ok, h, torch.full_like(h, _NAN))


def gram_entropy(K: torch.Tensor, alpha: float = 1.0, variant: str = "paper") -> torch.Tensor:
    """S_α of a linear Gram K, as the paper defines it or as paper B's code computes it
    (docs/metrics.md#prompt_entropy).

    ``variant="paper"``: S_α of K's spectrum, no clamp (α = 2 from two traces, :func:`collision_entropy`).
    ``variant="information_flow"``: ``K = clamp(K, min=0)``
    elementwise, ``K = K / tr K``, then S_α (NaN if the trace is 0). Pass the Gram that B's branch rule picks
    (:func:`linear_gram`): after the clamp, Z Zᵀ and Zᵀ Z no longer share their spectrum.
    """
    _check_variant(variant)
    K = K.double()
    if variant == "paper":
        return collision_entropy(K) if alpha == 2 else spectrum_entropy(serial_eigvalsh(K), alpha)
    K = K.clamp(min=0)
    trace = torch.trace(K)
    if not trace > 0:
        return torch.tensor(_NAN, dtype=torch.float64)
    return renyi_entropy(K / trace, alpha)


def entropy_result(raw: float, n: int, d: int) -> dict[str, float]:
    """``{"raw", "normalized", "logN", "logD"}`` from S_α and the matrix shape (a zero denominator gives NaN)."""
    log_n, log_d = math.log(n) if n > 0 else _NAN, math.log(d) if d > 0 else _NAN
    return {
        "raw": raw,
        "normalized": _safe_ratio(raw, min(log_n, log_d)),
        "logN": _safe_ratio(raw, log_n),
        "logD": _safe_ratio(raw, log_d),
    }


def matrix_entropy(Z: torch.Tensor, alpha: float = 1.0, variant: str = "paper") -> dict[str, float]:
    """Entropy of the linear Gram of rows that are already prepared (centred/unit as the caller wants).

    Returns ``{"raw": S_α, "normalized": S_α / log min(N, D), "logN": S_α / log N, "logD": S_α / log D}``;
    ``normalized`` is B's ``maxEntropy`` (= S_α / min(log N, log D)). A zero denominator gives NaN.
    """
    n, d = Z.shape
    return entropy_result(float(gram_entropy(linear_gram(Z), alpha, variant)), n, d)


def prompt_entropy(tokens: torch.Tensor, alpha: float = 1.0, variant: str = "paper") -> dict[str, float]:
    """Prompt entropy of one prompt's token vectors ``tokens`` [N, D] (docs/metrics.md#prompt_entropy).

    Z = :func:`center_and_unit` (tokens), then S_α of the Gram of Z:

    * ``variant="paper"`` (default): the smaller of ZZᵀ / ZᵀZ, no clamp, so both branches agree and, because
      centring leaves rank ≤ N−1, S_1 ≤ log(N−1).
    * ``variant="information_flow"``: B's code. K = ZᵀZ if N > D else ZZᵀ, ``K = clamp(K, min=0)``, K / tr K, S_α.
      The clamp makes the value depend on the branch and gives every 2-token prompt raw = log 2.

    Returns ``{"raw", "normalized" (= raw / log min(N, D), B's maxEntropy), "logN", "logD"}``. Prompts with N < 2
    tokens give NaN for every value (B's code divides by log 1 = 0 and raises there).
    """
    tokens = tokens.double()
    n, d = tokens.shape
    if n < 2:
        return {"raw": _NAN, "normalized": _NAN, "logN": _NAN, "logD": _NAN}
    return matrix_entropy(center_and_unit(tokens), alpha, variant)


def spectrum_entropies(eigenvalues: torch.Tensor, sizes: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """:func:`spectrum_entropy` of each row of ``eigenvalues`` [R, M] at once (float64 [R]).

    Row r holds the ``sizes[r]`` eigenvalues of an m×m matrix, padded with zeros to M (a block-diagonal padding
    of the matrix adds exact zero eigenvalues, which the positive-only rule drops). The round-off floor is that of
    the unpadded matrix, ``sizes[r] · eps · λ_max``, so each row gives what :func:`spectrum_entropy` gives for it.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    lam = eigenvalues.double()
    if lam.numel() == 0:
        return torch.full((lam.shape[0],), _NAN, dtype=torch.float64, device=lam.device)
    rtol = sizes.to(device=lam.device, dtype=torch.float64, non_blocking=True) * torch.finfo(torch.float64).eps
    top = lam.max(1, keepdim=True).values
    keep = (lam > 0) & (lam > rtol.unsqueeze(1) * top)
    lam = torch.where(keep, lam, torch.zeros_like(lam))
    p = lam / lam.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    logp = torch.log(torch.where(keep, p, torch.ones_like(p)))
    if alpha == 1:
        h = -(p * logp).sum(1)
    else:
        h = torch.log(torch.where(keep, torch.exp(alpha * logp), torch.zeros_like(p)).sum(1)) / (1.0 - alpha)
    return torch.where(keep.any(1), h, torch.full_like(h, _NAN)) + 0.0


def _ratios(raw: torch.Tensor, n: torch.Tensor, d: int) -> torch.Tensor:
    """[R, 4] ``raw, normalized, logN, logD`` (:func:`entropy_result` for many rows; a zero denominator gives NaN)."""
    log_n = torch.log(n.to(torch.float64))
    log_d = torch.full_like(log_n, math.log(d) if d > 0 else _NAN)
    nan = torch.full_like(raw, _NAN)

    def ratio(den: torch.Tensor) -> torch.Tensor:
        return torch.where(den > 0, raw / torch.where(den > 0, den, torch.ones_like(den)), nan)

    return torch.stack([raw, ratio(torch.minimum(log_n, log_d)), ratio(log_n), ratio(log_d)], 1)


def _gram_entropies(grams: torch.Tensor, sizes: list[int], alpha: float, variant: str,
                    real: torch.Tensor | None = None, spans: list | None = None) -> torch.Tensor:
    """S_α of a batch of linear Grams [R, L, L], each zero outside its ``real`` rows and columns (``sizes`` of them),
    as :func:`gram_entropy` computes each one (the ``information_flow`` clamp and trace normalisation included).

    The eigendecompositions run as one batched ``eigvalsh`` when the Grams fill most of L×L; when padding would add
    more than a quarter to the O(L³) work, each Gram is cut to its real rows and columns (a view where ``spans``
    gives them as consecutive ``(start, stop)``) and diagonalised on its own. The ``paper`` variant at α = 2 needs
    no spectrum (:func:`collision_entropy`; pad rows and columns are zero and add nothing to either trace)."""
    if alpha == 2 and variant == "paper":  # a PSD Gram's S_2 is two traces: no eigendecomposition, flat in the length
        return collision_entropy(grams)
    if variant == "information_flow":
        grams = grams.clamp(min=0)
        trace = grams.diagonal(dim1=-2, dim2=-1).sum(-1)
        ok = trace > 0
        grams = grams / torch.where(ok, trace, torch.ones_like(trace)).reshape(-1, 1, 1)
    # A NaN hidden state would stop LAPACK ("failed to converge") before the run's own check names it: on a GPU
    # that check reads every 64 batches (docs/how-to/large-models.md#host-synchronisations). A zero there instead
    # leaves a wrong value that the check refuses to report, with the text and address it names.
    grams = torch.nan_to_num(grams, nan=0.0, posinf=0.0, neginf=0.0)
    n_rows, width = grams.shape[0], grams.shape[-1]
    if real is None or 1.25 * sum(float(k) ** 3 for k in sizes) >= n_rows * float(width) ** 3:
        eig = serial_eigvalsh(grams)
    else:
        spans = spans or [None] * n_rows
        cut = [g[s[0]:s[1], s[0]:s[1]] if s is not None else g[r][:, r] for g, r, s in zip(grams, real, spans)]
        eig = grams.new_zeros((n_rows, max(sizes)))
        for i, lam in enumerate(serial_eigvalsh(cut)):
            eig[i, : lam.shape[0]] = lam  # zeros after it: dropped as non-positive
    raw = spectrum_entropies(eig, torch.tensor(sizes), alpha)
    if variant == "information_flow":
        raw = torch.where(ok.to(raw.device), raw, torch.full_like(raw, _NAN))
    return raw


def prompt_entropies(block, alpha: float = 1.0, variant: str = "paper",
                     max_elements: int = 1 << 22) -> torch.Tensor:
    """:func:`prompt_entropy` of every text of a :class:`~repgeom_eval.functional.tokens.TokenBlock` at once:
    float64 [B, 4] on the block's device, columns ``raw``, ``normalized``, ``logN``, ``logD`` (NaN rows for texts
    with fewer than 2 tokens). Nothing is read back to the host (at α = 1 a GPU's ``eigvalsh`` still waits for its
    own result).

    Texts with N ≤ D tokens (the usual case) take their N×N Grams Z Zᵀ from the block's Gram of centred tokens
    (:meth:`~repgeom_eval.functional.tokens.TokenBlock.centered_gram`, one batched product, shared with the
    condensation histogram), scaled to unit rows, zero-padded (which adds exact zero eigenvalues only; the round-off
    floor is that of each text's own N, see :func:`spectrum_entropies`) and diagonalised by one batched
    ``eigvalsh``. Texts with N > D, and every text when the padded Grams would exceed ``max_elements`` entries, are
    computed one at a time as :func:`prompt_entropy` does (a D×D Gram Zᵀ Z for N > D, paper B's branch rule).
    The two halves are :func:`prompt_grams` (the Grams, where the block is) and :func:`PromptGrams.entropies`
    (their spectra, wherever the Grams are: ``prompt_entropy``'s ``spectra: host`` moves them to the host first).
    """
    _check_variant(variant)
    return prompt_grams(block, max_elements).entropies(alpha, variant)


class PromptGrams:
    """The Grams of one block's texts, ready for their spectra (:func:`prompt_grams`): ``k`` [S, L, L] zero-padded
    unit-row Grams of the ``small`` texts (their ``real`` rows, ``spans`` and ``sizes``), one Gram per text of
    ``alone``, and every text's token count (``lengths``) and the width ``d``."""

    def __init__(self, n_texts: int, d: int, lengths: torch.Tensor, small: list[int], k, real, spans, sizes,
                 alone: list[int], alone_grams: list[torch.Tensor]):
        self.n_texts, self.d, self.lengths = n_texts, d, lengths
        self.small, self.k, self.real, self.spans, self.sizes = small, k, real, spans, sizes
        self.alone, self.alone_grams = alone, alone_grams

    def to(self, device, non_blocking: bool = False) -> "PromptGrams":
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return PromptGrams(self.n_texts, self.d, move(self.lengths), self.small, move(self.k), move(self.real),
                           self.spans, self.sizes, self.alone, [move(g) for g in self.alone_grams])

    def entropies(self, alpha: float, variant: str) -> torch.Tensor:
        """float64 [B, 4] (``raw``, ``normalized``, ``logN``, ``logD``; NaN rows for texts without a value) on the
        Grams' device."""
        out = torch.full((self.n_texts, 4), _NAN, dtype=torch.float64, device=self.lengths.device)
        if self.small:
            idx = torch.tensor(self.small).to(out.device, non_blocking=True)
            raw = _gram_entropies(self.k, self.sizes, alpha, variant, self.real, self.spans)
            out.index_copy_(0, idx, _ratios(raw, self.lengths.index_select(0, idx), self.d))
        for i, gi in zip(self.alone, self.alone_grams):
            raw = _gram_entropies(gi.unsqueeze(0), [gi.shape[0]], alpha, variant)
            out[i] = _ratios(raw, self.lengths[i:i + 1], self.d)[0]
        return out


def prompt_grams(block, max_elements: int = 1 << 22) -> PromptGrams:
    """The first half of :func:`prompt_entropies`: every text's Gram, computed where the block is."""
    b, d = len(block), block.dim
    dev = block.hidden.device
    lengths = torch.tensor(block.lengths).to(dev, non_blocking=True)
    lo, hi = block.span
    batched = b * (hi - lo) ** 2 <= max_elements
    small = [i for i, k in enumerate(block.lengths) if 2 <= k <= d] if batched else []
    alone = [i for i, k in enumerate(block.lengths) if k >= 2 and i not in set(small)]
    k = real = spans = None
    if small:
        g, real = block.centered_gram_only()
        idx = torch.tensor(small).to(dev, non_blocking=True)
        g, real = (g, real) if len(small) == b else (g.index_select(0, idx), real.index_select(0, idx))
        w = 1.0 / g.diagonal(dim1=1, dim2=2).clamp(min=0).sqrt().clamp(min=1e-12)  # 1/‖c_t‖, as unit() scales
        w = torch.where(real, w, torch.zeros_like(w))
        k = (g * w.unsqueeze(2)).mul_(w.unsqueeze(1))  # exactly 0 in the pad rows and columns (w = 0 there)
        local = block.local_spans()
        spans = [local[i] for i in small]
    alone_grams = [linear_gram(center_and_unit(block.row(i))) for i in alone]
    return PromptGrams(b, d, lengths, small, k, real, spans, [block.lengths[i] for i in small], alone, alone_grams)


def prepare_pooled(pooled: torch.Tensor, centering: str = "global", batch_size: int = 2) -> torch.Tensor:
    """The rows dataset entropy takes the Gram of, for each ``centering`` (see :func:`dataset_entropy`)."""
    pooled = pooled.double()
    if centering == "global":
        return center_and_unit(pooled)
    if centering == "batch":
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return torch.cat([center_and_unit(c) for c in pooled.split(batch_size)]) if len(pooled) else pooled
    if centering == "none":
        return unit(pooled)
    raise ValueError(f"centering must be one of {CENTERINGS}, got {centering!r}")


def dataset_entropy(
    pooled: torch.Tensor,
    alpha: float = 1.0,
    centering: str = "global",
    batch_size: int = 2,
    variant: str = "paper",
) -> dict[str, float]:
    """Dataset entropy of one pooled vector per prompt, ``pooled`` [N, D] (docs/metrics.md#dataset_entropy).

    ``centering``:

    * ``"global"`` (default, the definition paper B intends): centre over all N prompts, then unit rows.
    * ``"batch"``: B's code. Centre and unit-normalise each consecutive block of ``batch_size`` rows separately
      (the code's forward mini-batches; ``batch_size=2``, its final setting, turns every pair into ±(p₁−p₂)/‖p₁−p₂‖).
      A trailing block of one row becomes a zero row here (NaN in B's code, which has no eps).
    * ``"none"``: unit rows only, no centring.

    Then the entropy of :func:`prompt_entropy` with N = number of prompts and the same ``variant`` switch as
    :func:`prompt_entropy`. Returns ``{"raw", "normalized", "logN", "logD"}``; N < 2 gives NaN.
    """
    pooled = pooled.double()
    n = pooled.shape[0]
    if n < 2:
        return {"raw": _NAN, "normalized": _NAN, "logN": _NAN, "logD": _NAN}
    return matrix_entropy(prepare_pooled(pooled, centering, batch_size), alpha, variant)
