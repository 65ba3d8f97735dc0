"""Named layer selections: ``--layers all`` and friends."""

from __future__ import annotations

from repgeom_eval import hookimpl


def every_hidden_state(info) -> list[str]:
    """Every hidden state: embed, each block output, final (= hidden_states[0..L])."""
    return [str(k) for k in range(info.n_layers + 1)]


def every_block(info) -> list[str]:
    """The raw output of every block (resid_post:*), no final norm."""
    return ["resid_post:*"]


def knn_keys(info) -> list[str]:
    """kNN-LM key candidates of the last block: resid_mid:-1, resid_post:-1, mlp_in:-1 (spec §9.3)."""
    return ["resid_mid:-1", "resid_post:-1", "mlp_in:-1"]


@hookimpl
def repgeom_register_layer_selectors(registry):
    registry.add(every_hidden_state, name="all")
    registry.add(every_block, name="blocks")
    registry.add(knn_keys, name="knn_keys")
