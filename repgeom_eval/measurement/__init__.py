"""The measurement engine: texts → model inputs → capture → pool → metric states → results."""
