"""Model types no table knows, on every surface: measure, an analysis (ppl-bins), the lm-eval tasks, the MTEB
encoder and the auxiliary losses in training — each value against the model's own output_hidden_states."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)

import repgeom_eval as rg
from repgeom_eval.functional.dispersion import pairwise_dispersion
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.testing import write_task_data
from repgeom_eval.testing.tiny_models import save_tiny

TYPES = ["opt", "falcon", "gemma2", "qwen3_moe"]  # none of them in plugins/architectures.py
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Short text.", "Layers of a model, read one by one.",
         "Another sentence of ordinary words for the probe."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, str] = {}

    def get(model_type: str) -> str:
        if model_type not in made:
            made[model_type] = str(save_tiny(model_type, tmp_path_factory.mktemp(model_type)))
        return made[model_type]

    return get


def own_hidden_states(loaded, text):
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return loaded.model(input_ids=ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("model_type", TYPES)
def test_measure_equals_brute_force_on_the_models_own_hidden_states(tiny, model_type):
    loaded = load_model(tiny(model_type))
    assert loaded.layout.table is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rg.measure(loaded, TEXTS, layers="all", metrics=["dispersion"], pooling="mean", batch_size=3,
                            progress=False)
    states = [own_hidden_states(loaded, t) for t in TEXTS]
    for k, name in enumerate(loaded.layout.hidden_states):
        pooled = torch.stack([hs[k][0].double().mean(0) for hs in states])
        assert result.results[name]["dispersion"] == pytest.approx(float(pairwise_dispersion(pooled)), abs=1e-6)


def test_ppl_bins_runs_on_a_discovered_model(tiny, tmp_path):
    from repgeom_eval.analyses.ppl_bins import ppl_bins

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(TEXTS * 6) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ppl_bins(tiny("opt"), str(data), layers=["final", "resid_mid:0"], chunk_len=8, n_chunks=12,
                       group_size=3, progress=False)
    assert out.results["layers"] == ["resid_mid:0", "final"] and out.results["pooled"]["n_chunks"] == 12


def test_lm_eval_task_reads_the_final_hidden_state_of_a_discovered_model(tiny, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from repgeom_eval.analyses.queries import decode_vector

    data = write_task_data("mmlu", tmp_path / "mmlu.jsonl", n=12, seed=3)
    lm = HFLM(pretrained=tiny("falcon"), batch_size=4, device="cpu")
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data), "repgeom_slice_size": 4,
                                                       "repgeom_slice_seeds": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = simple_evaluate(model=lm, tasks=["repgeom_hardness_mmlu"], task_manager=tm, log_samples=True,
                              bootstrap_iters=0)
    samples = out["samples"]["repgeom_hardness_mmlu"]
    for sample in samples[:4]:
        ctx, cont = sample["arguments"][0]
        ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
        inp = (ctx_enc + cont_enc)[-(lm.max_length + 1):][:-1]
        tokens = inp[: len(inp) - len(cont_enc) + 1]
        with torch.no_grad():
            want = lm.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -1]
        got = decode_vector(sample["repgeom_slice_spearman"]["vector"])
        np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


def test_mteb_encoder_at_a_middle_layer_of_a_discovered_model(tiny):
    from repgeom_eval.mteb_layers import layer_encoder

    path = tiny("gemma2")
    encoder = layer_encoder(path, 1, pooling="mean")
    got = encoder.sweep.vectors(TEXTS, encoder.address, batch_size=2)
    loaded = load_model(path)
    want = np.stack([own_hidden_states(loaded, t)[1][0].mean(0).numpy() for t in TEXTS])
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_aux_loss_trains_a_discovered_model(tiny, tmp_path):
    import datasets
    from transformers import TrainingArguments

    from repgeom_eval.training.auxloss import build_aux_loss
    from repgeom_eval.training.data import pack_blocks
    from repgeom_eval.training.trainer import AuxLossTrainer

    loaded = load_model(tiny("opt"))
    loaded.model.train().requires_grad_(True)
    blocks = pack_blocks(TEXTS * 8, loaded.tokenizer, 8, 0)
    assert isinstance(blocks, datasets.Dataset)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no",
                             use_cpu=True, disable_tqdm=True, seed=0)
    loss = build_aux_loss({"name": "push_away", "weight": 1.0, "layers": "resid_mid:-1"})
    trainer = AuxLossTrainer(model=loaded.model, args=args, train_dataset=blocks, aux_losses=[loss])
    trainer.train()
    logs = [row for row in trainer.state.log_history if "aux/push_away" in row]
    assert logs and all(np.isfinite(row["aux/push_away"]) for row in logs)
