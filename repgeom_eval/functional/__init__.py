"""Pure functions of tensors: the math of every metric, testable without a model."""

from .condensation import condensation, cosine_histogram
from .contrastive import dime, dime_exact, infonce, lidar, lidar_from_stats, lidar_stats
from .curvature import curvature
from .dispersion import (
    cross_dispersion,
    dispersion,
    dispersion_from_sums,
    leave_one_out_dispersion,
    leave_one_out_influence,
    pairwise_dispersion,
    per_sample_scores,
    token_dispersion,
    unit,
)
from .entropy import (
    center_and_unit,
    dataset_entropy,
    gram_spectrum,
    prompt_entropy,
    renyi_entropy,
    repitl_alpha2_shortcut,
)
from .rank import effective_rank, vendi_score
from .losses import (
    angular_spread,
    decorrelation,
    l2_repel,
    orthogonalization,
    perplexity_entropy,
    push_away,
    push_away_pairwise,
    subsample_tokens,
)
from .stats import auroc, kendall_tau_b, pearson, spearman

__all__ = [
    "center_and_unit",
    "condensation",
    "cosine_histogram",
    "curvature",
    "dataset_entropy",
    "effective_rank",
    "gram_spectrum",
    "auroc",
    "kendall_tau_b",
    "prompt_entropy",
    "pearson",
    "renyi_entropy",
    "repitl_alpha2_shortcut",
    "spearman",
    "vendi_score",
    "angular_spread",
    "decorrelation",
    "dime",
    "dime_exact",
    "infonce",
    "l2_repel",
    "lidar",
    "lidar_from_stats",
    "lidar_stats",
    "orthogonalization",
    "perplexity_entropy",
    "push_away",
    "push_away_pairwise",
    "subsample_tokens",
    "cross_dispersion",
    "dispersion",
    "dispersion_from_sums",
    "leave_one_out_dispersion",
    "leave_one_out_influence",
    "pairwise_dispersion",
    "per_sample_scores",
    "token_dispersion",
    "unit",
]
