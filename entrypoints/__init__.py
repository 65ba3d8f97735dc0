"""Command-line glue: argument parsing and printing around the library (``repgeom`` console script)."""
