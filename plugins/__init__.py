"""Built-in plugins. Each module registers through the ``repgeom_eval`` entry points (see pyproject.toml),
exactly like a third-party plugin would."""
