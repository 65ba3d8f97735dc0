"""Pure functions of tensors: the math of every metric, testable without a model."""

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

__all__ = [
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
