"""Named layer selections: ``--layers all`` and friends; and the built-in label-free pick of ``--layer auto``."""

from __future__ import annotations

from repgeom_eval import hookimpl
from repgeom_eval.spec.layer_pick import MinDatasetEntropy


def _n_hidden(info) -> int:
    """Entries of the model's own hidden_states (L + 1 on nearly every model; the load check counts them)."""
    return getattr(info, "n_hidden_states", None) or info.n_layers + 1


def every_hidden_state(info) -> list[str]:
    """Every hidden state: embed, each block output, final (= hidden_states[0..L])."""
    return [str(k) for k in range(_n_hidden(info))]


def every_block(info) -> list[str]:
    """The raw output of every block (resid_post:*), no final norm."""
    return ["resid_post:*"]


def knn_keys(info) -> list[str]:
    """kNN-LM key candidates of the last block: resid_mid:-1, resid_post:-1, mlp_in:-1 (docs/metrics.md#knn-lm-keys);
    those the last block has (a parallel block has no resid_mid)."""
    has = (getattr(info, "layers", None) or {}).get("last_block_sites")
    return [key for key in ("resid_mid:-1", "resid_post:-1", "mlp_in:-1")
            if has is None or key.partition(":")[0] in has]


# Paper C's layer sets for its losses (docs/metrics.md#loss-layers): hidden_states[1..L], skipping the embeddings.

def all_but_embed(info) -> list[str]:
    """hidden_states[1..L]: every block output, the last one after the final norm (paper C's `all`)."""
    return [str(k) for k in range(1, _n_hidden(info))]


def last(info) -> list[str]:
    """The final hidden state (= final, hidden_states[L]; paper C's `last`)."""
    return ["final"]


def early_half(info) -> list[str]:
    """hidden_states[1..⌊L/2⌋] (paper C's `early_half`)."""
    return [str(k) for k in range(1, info.n_layers // 2 + 1)]


def late_half(info) -> list[str]:
    """hidden_states[⌊L/2⌋+1..L] (paper C's `late_half`)."""
    return [str(k) for k in range(info.n_layers // 2 + 1, _n_hidden(info))]


@hookimpl
def repgeom_register_layer_selectors(registry):
    registry.add(every_hidden_state, name="all")
    registry.add(every_block, name="blocks")
    registry.add(knn_keys, name="knn_keys")
    registry.add(all_but_embed, name="all_but_embed")
    registry.add(last, name="last")
    registry.add(early_half, name="early_half")
    registry.add(late_half, name="late_half")


@hookimpl
def repgeom_register_layer_picks(registry):
    # here rather than in a plugin module of its own: a new built-in entry point needs the package reinstalled
    registry.add(MinDatasetEntropy)
