"""Model access: loading, architecture tables, layer addresses and the hooks that read them."""
