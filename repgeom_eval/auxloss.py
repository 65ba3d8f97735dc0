"""Deprecated home of the aux-loss interface: ``AuxLoss``, ``build_aux_loss`` and ``parse_addresses`` live in
:mod:`repgeom_eval.training.auxloss` (import them from there, or from :mod:`repgeom_eval.training`). This module
keeps third-party plugins written against the old path working, with a ``DeprecationWarning``, until the next
release."""

from __future__ import annotations

from repgeom_eval.training.moved import moved_names

__getattr__ = moved_names(__name__, dict.fromkeys(("AuxLoss", "build_aux_loss", "parse_addresses"),
                                                  "repgeom_eval.training.auxloss"))
