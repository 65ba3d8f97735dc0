"""Pure functions of tensors: the math of every metric, testable without a model."""

from .contrastive import dime, dime_exact, infonce, lidar, lidar_from_stats, lidar_stats
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

__all__ = [
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
