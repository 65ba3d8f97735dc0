"""AuxLossTrainer: hidden states from the same forward pass, push-away raises and squeeze lowers the measured
dispersion, gradient accumulation and bf16 autocast, per-step logs, per-domain perplexity."""

import math

import pytest
import torch

import accelerate  # noqa: E402,F401  (dev extra: missing must fail, not skip)
import datasets  # noqa: E402,F401  (dev extra: missing must fail, not skip)

from transformers import TrainingArguments  # noqa: E402

from repgeom_eval.modeling.addresses import Address, parse_layers, resolve  # noqa: E402
from repgeom_eval.training.auxloss import build_aux_loss  # noqa: E402
from repgeom_eval.modeling.hooks import Capture  # noqa: E402
from repgeom_eval.functional.losses import push_away  # noqa: E402
from repgeom_eval.modeling.loading import load_model  # noqa: E402
from repgeom_eval.training.trainer import AuxLossTrainer  # noqa: E402
from repgeom_eval.training.data import pack_blocks  # noqa: E402


def trainable(path):
    loaded = load_model(path)
    for module in loaded.model.modules():  # dropout off: runs must be comparable step for step
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    loaded.model.train().requires_grad_(True)
    return loaded


@pytest.fixture(scope="module")
def blocks(tiny_model_dir, texts):
    """Two domains of 16-token blocks from real text: Python's docs (0) and Python's own source (1)."""
    import datasets
    import inspect

    tok = load_model(tiny_model_dir("gpt2")).tokenizer
    prose = pack_blocks(texts, tok, 16, 0)
    code = pack_blocks([inspect.getsource(math.__loader__.__class__)] * 2 + [inspect.getsource(Capture)], tok, 16, 1)
    n = min(len(prose), len(code), 24)
    return datasets.concatenate_datasets([prose.select(range(n)), code.select(range(n))])


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                optim="sgd", lr_scheduler_type="constant")
    return TrainingArguments(**{**base, **kw})


def train_logs(trainer):
    trainer.train()
    return [row for row in trainer.state.log_history if "ce" in row]


def test_capture_keep_grad_reads_the_same_forward_pass(tiny_model_dir):
    loaded = trainable(tiny_model_dir("gpt2"))
    model = loaded.model
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    enc = loaded.tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt")
    points = resolve(parse_layers("resid_post:0,final", 2), loaded)
    with Capture(model, points, stop_early=False, keep_grad=True) as cap:
        out = model(**enc, labels=enc["input_ids"], output_hidden_states=True)
        hidden = cap.tensors()
    handle.remove()
    assert len(calls) == 1
    assert torch.equal(hidden[Address("final")], out.hidden_states[-1])
    assert torch.equal(hidden[Address("resid_post", 0)], out.hidden_states[1])
    assert all(t.requires_grad and t.grad_fn is not None for t in hidden.values())
    (out.loss + hidden[Address("final")].square().mean()).backward()
    wte = model.get_input_embeddings().weight
    assert wte.grad is not None and wte.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="stop_early=False"):
        Capture(model, points, keep_grad=True)
    with Capture(model, points) as cap:  # the measuring default is unchanged: detached, inference mode
        assert not any(t.requires_grad for t in cap.run(**enc).values())


def measured_dispersion(model, batch):
    """d (paper A's d_avg) of the final hidden states of a held-out batch, and its within-sequence average."""
    from repgeom_eval.functional import token_dispersion

    model.eval()
    with torch.no_grad():
        h = model(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states[-1].double()
    mask = torch.ones(h.shape[:2], dtype=torch.bool)
    values, _ = token_dispersion(h, mask)
    model.train()
    return push_away(h, mask).item(), values.mean().item()


def test_push_away_raises_and_squeeze_lowers_the_measured_dispersion(tiny_model_dir, blocks, tmp_path):
    # A random init is nearly maximally dispersed (d ≈ 0.95), so start where training leaves a model: after a
    # few CE-only steps its final hidden states have condensed. From that checkpoint, continue with each loss.
    held_out = blocks.select(range(0, len(blocks), 5))[:]
    loaded = trainable(tiny_model_dir("gpt2"))
    ce_only = AuxLossTrainer(model=loaded.model, args=args(tmp_path, max_steps=8, learning_rate=0.05),
                             train_dataset=blocks)
    ce_only.train()
    ce_only.save_model(str(tmp_path / "condensed"))
    loaded.tokenizer.save_pretrained(str(tmp_path / "condensed"))
    results = {}
    for name in ("baseline", "push_away", "squeeze"):
        loaded = trainable(str(tmp_path / "condensed"))
        before = measured_dispersion(loaded.model, held_out)
        losses = [] if name == "baseline" else [build_aux_loss({"name": name, "weight": 1.0})]
        trainer = AuxLossTrainer(model=loaded.model, args=args(tmp_path, max_steps=6, learning_rate=0.05),
                                 train_dataset=blocks, aux_losses=losses)
        logs = train_logs(trainer)
        results[name] = (before, measured_dispersion(loaded.model, held_out), logs)
    (b0, base, _), (p0, push, push_logs), (s0, squeeze, squeeze_logs) = results.values()
    assert b0 == p0 == s0 and b0[0] < 0.6  # the same, condensed, starting model
    for k in range(2):  # both the flattened d and the within-sequence token dispersion move as intended
        assert push[k] > b0[k] + 0.05 and push[k] > base[k] + 0.05, (b0, base, push)
        assert squeeze[k] < b0[k] - 0.05 and squeeze[k] < base[k] - 0.05, (b0, base, squeeze)
    # the logged batch dispersion tracks the aux loss (push_away's L_aux = −d at the same layer)
    assert push_logs[-1]["aux/push_away"] == pytest.approx(-push_logs[-1]["dispersion"], abs=1e-6)
    assert squeeze_logs[-1]["aux/squeeze"] == pytest.approx(squeeze_logs[-1]["dispersion"], abs=1e-6)
    assert push_logs[-1]["dispersion"] > push_logs[0]["dispersion"]
    assert squeeze_logs[-1]["dispersion"] < squeeze_logs[0]["dispersion"]


def test_logged_loss_is_ce_plus_weighted_aux_every_step(tiny_model_dir, blocks, tmp_path):
    loaded = trainable(tiny_model_dir("gpt2"))
    losses = [build_aux_loss({"name": "push_away", "weight": 0.3, "cross_domain": True}),
              build_aux_loss({"name": "angular_spread", "weight": 0.2, "layers": "all_but_embed"})]
    logs = train_logs(AuxLossTrainer(model=loaded.model, args=args(tmp_path, max_steps=3), train_dataset=blocks,
                                     aux_losses=losses))
    assert [row["step"] for row in logs] == [1, 2, 3]
    # step 1's CE is the model's own next-token CE on that batch (targets counted as labels[..., 1:])
    four = blocks.select(range(4))
    fresh = trainable(tiny_model_dir("gpt2")).model
    with torch.no_grad():
        expected_ce = fresh(input_ids=four[:]["input_ids"], labels=four[:]["labels"]).loss.item()
    first = train_logs(AuxLossTrainer(model=fresh, args=args(tmp_path, max_steps=1), train_dataset=four,
                                      aux_losses=losses[1:]))[0]
    assert first["ce"] == pytest.approx(expected_ce, rel=1e-6)
    for row in logs:
        if "aux/push_away/skipped" in row:
            continue
        expected = row["ce"] + 0.3 * row["aux/push_away"] + 0.2 * row["aux/angular_spread"]
        assert row["loss"] == pytest.approx(expected, rel=1e-5)
        assert row["aux/push_away"] == pytest.approx(-row["dispersion_cross"], abs=1e-6)
        assert 0 < row["dispersion"] < 2


@pytest.mark.parametrize("ce_already_scaled", [True, False])
def test_gradient_accumulation_equals_one_big_batch(tiny_model_dir, blocks, tmp_path, ce_already_scaled):
    # angular_spread is a per-sequence mean: over 4 sequences it is the mean of two 2-sequence means, so 2 × 2
    # accumulated must give exactly the update of one batch of 4 (CE: equal token counts per block).
    def run(batch, ga):
        loaded = trainable(tiny_model_dir("gpt2"))
        loss = build_aux_loss({"name": "angular_spread", "weight": 0.5, "max_tokens": None})
        trainer = AuxLossTrainer(model=loaded.model, train_dataset=blocks, aux_losses=[loss],
                                 args=args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=ga))
        if not ce_already_scaled:  # the other path of Trainer.training_step: it divides the whole loss by GA
            trainer.model_accepts_loss_kwargs = False
        logs = train_logs(trainer)
        return [p.detach().clone() for p in loaded.model.parameters()], logs

    big, big_logs = run(4, 1)
    acc, acc_logs = run(2, 2)
    for a, b in zip(big, acc):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(big_logs, acc_logs):
        for key in ("loss", "ce", "aux/angular_spread"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_bf16_autocast_trains_and_aux_runs_in_float32(tiny_model_dir, blocks, tmp_path, monkeypatch):
    seen = []
    loss = build_aux_loss({"name": "push_away", "weight": 0.1, "layers": "mlp_out:0,final"})
    original = type(loss).compute_loss_from_hidden

    def spy(self, hidden, mask, domains):
        out = original(self, hidden, mask, domains)
        seen.append((hidden.dtype, out.dtype, torch.is_autocast_enabled("cpu")))
        return out

    monkeypatch.setattr(type(loss), "compute_loss_from_hidden", spy)
    values = {}
    for bf16 in (False, True):
        seen.clear()
        loaded = trainable(tiny_model_dir("gpt2"))
        logs = train_logs(AuxLossTrainer(model=loaded.model, args=args(tmp_path, bf16=bf16), train_dataset=blocks,
                                         aux_losses=[loss]))
        values[bf16] = logs[0]
        assert all(math.isfinite(row["loss"]) for row in logs)
        assert all(out == torch.float32 and not autocast for _, out, autocast in seen)
        if bf16:
            assert torch.bfloat16 in {h for h, _, _ in seen}  # the MLP output really was bf16 under autocast
    assert values[True]["aux/push_away"] == pytest.approx(values[False]["aux/push_away"], abs=2e-2)
    assert values[True]["ce"] == pytest.approx(values[False]["ce"], abs=5e-2)


def test_domain_column_survives_and_eval_reports_perplexity(tiny_model_dir, blocks, tmp_path):
    loaded = trainable(tiny_model_dir("gpt2"))
    prose = blocks.filter(lambda r: r["domain"] == 0)
    code = blocks.filter(lambda r: r["domain"] == 1)
    cross = build_aux_loss({"name": "push_away", "weight": 0.1, "cross_domain": True})
    trainer = AuxLossTrainer(model=loaded.model, args=args(tmp_path, remove_unused_columns=True),
                             train_dataset=blocks, eval_dataset={"prose": prose, "code": code}, aux_losses=[cross])
    logs = train_logs(trainer)
    assert any("aux/push_away" in row for row in logs)  # the domain labels reached the loss
    metrics = trainer.evaluate()
    for name in ("prose", "code"):
        assert metrics[f"eval_{name}_perplexity"] == pytest.approx(math.exp(metrics[f"eval_{name}_loss"]))
    # evaluation is plain CE: no aux term, no domain passed to the model
    batch = code[:4]
    loaded.model.eval()
    with torch.no_grad():
        ce = loaded.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
    single = trainer.evaluate(eval_dataset=code.select(range(4)), metric_key_prefix="eval_x")
    assert single["eval_x_loss"] == pytest.approx(ce, rel=1e-5)
