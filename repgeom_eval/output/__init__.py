"""Writing results: atomic files, console tables, plots."""
