"""The declarations a plugin builds on: the metric and statistic API, hook specifications, errors and parameter
checks, layer picks and the option-field machinery. Torch-free, so that ``repgeom --help`` and ``repgeom plugins``
import every plugin cheaply (tests/test_import_graph.py checks that importing this package loads no torch)."""
