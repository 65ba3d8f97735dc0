"""Every command's options and settings, declared once on the torch-free floor (docs/configuration.md): the model
options (``model``), the groups the commands share (``groups``: model, texts, layers, run, outputs), ``measure``,
the analyses (``analyses``), ``mteb`` (``repgeom mteb run``), ``lmeval`` (the ``repgeom_*`` settings), and
``repgeom train`` (``train``, read through the mapping groups of ``settings``). The machinery they are declared with
is repgeom_eval/spec/option_fields.py.
"""
