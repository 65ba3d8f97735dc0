"""The name lists and defaults the metrics' parameters are checked against, declared once and torch-free: the
built-in metric plugins read them while their classes are defined (listing plugins imports no torch), and the math
in repgeom_eval/functional/ reads the same values (docs/metrics.md gives each one's meaning).
"""

from __future__ import annotations

#: prompt_entropy / dataset_entropy: the paper's (Skean et al.) or the information-flow code's conventions
ENTROPY_VARIANTS = ("paper", "information_flow")
#: what the entropies subtract before the Gram: the dataset mean, each prompt's mean, nothing
ENTROPY_CENTERINGS = ("global", "batch", "none")
#: where prompt_entropy solves its per-text spectra: on the host's cores when the hidden states are on a GPU (auto),
#: beside the hidden states, or on the host's cores
PROMPT_ENTROPY_SPECTRA = ("auto", "device", "host")
#: curvature: the paper's or the information-flow code's conventions
CURVATURE_VARIANTS = ("paper", "information_flow")
#: lidar: Thilak et al.'s or the information-flow code's
LIDAR_VARIANTS = ("thilak", "information_flow")
#: infonce: one direction (paper B) or SimCLR's symmetric NT-Xent
INFONCE_VARIANTS = ("one_directional", "simclr")
#: the dispersion losses' defaults: as paper C states them, or as its reference code runs them
LOSS_VARIANTS = ("paper", "reference")
#: condensation: paper C's max-eps in the cosine (not F.normalize's 1e-12), and the histogram's bins over [-1, 1]
CONDENSATION_EPS = 1e-3
CONDENSATION_BINS = 50
