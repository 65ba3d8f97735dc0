"""Training with auxiliary losses on hidden states."""
