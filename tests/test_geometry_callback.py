"""GeometryCallback: G and the probe dispersion at every saved checkpoint equal `repgeom gap` and `repgeom measure`
on the saved checkpoint folders; geometry_by_checkpoint.json, the label-free pick, logging, mode restored, and the
geometry_probe block's errors."""

import contextlib
import io
import json
import math

import pytest
import torch

import accelerate  # noqa: F401  (dev extra: missing must fail, not skip)
import datasets  # noqa: F401  (dev extra: missing must fail, not skip)

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.analyses.gap.vocabulary import Vocabulary
from repgeom_eval.training.geometry import FILE_NAME, GeometryCallback, pick_checkpoint

DOMAIN = "words:the,of,and,to,in,is,a"
CONFIG = """
model: {model}
data: {{block_size: 16, domains: {{docs: {{train: train.jsonl, eval: eval.jsonl}}}}}}
training: {{max_steps: 4, per_device_train_batch_size: 4, learning_rate: 1.0e-3, use_cpu: true,
           save_strategy: steps, save_steps: 2, save_only_model: true}}
evaluate_at: [2]
geometry_probe: {{texts: probe.jsonl, layers: [final, 1, "resid_mid:0"], domain: "{domain}", size: 40, seed: 3,
                 burn_in: 0.5}}
output_dir: out
save_model: false
torch_threads: 1
"""


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


@pytest.fixture(scope="module")
def run(tiny_model_dir, texts, tmp_path_factory):
    """`repgeom train` on a tiny GPT-2 with a checkpoint every 2 steps and the geometry probe."""
    folder = tmp_path_factory.mktemp("geometry")
    write_jsonl(folder / "train.jsonl", texts[:30])
    write_jsonl(folder / "eval.jsonl", texts[30:])
    write_jsonl(folder / "probe.jsonl", texts[:9])
    (folder / "train.yaml").write_text(CONFIG.format(model=tiny_model_dir("gpt2"), domain=DOMAIN))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--config", str(folder / "train.yaml"), "--no-progress"]) == 0
    (folder / "printed.txt").write_text(printed.getvalue())
    return folder


def test_values_equal_repgeom_gap_and_measure_on_the_saved_checkpoints(run):
    import repgeom_eval as rg
    from repgeom_eval.analyses.gap import screen

    out = json.loads((run / "out" / FILE_NAME).read_text())
    records = out["checkpoints"]
    assert [r["step"] for r in records] == [2, 4]
    for r in records:
        ckpt = run / "out" / "trainer" / f"checkpoint-{r['step']}"
        assert r["checkpoint"] == str(ckpt) and ckpt.is_dir()
        for distance in ("cosine", "euclidean"):
            row = screen([str(ckpt)], domain=DOMAIN, reference="general", size=40, seed=3,
                         distance=distance).rows[0]
            assert r["G"][distance] == pytest.approx(row["G"], abs=1e-6)
            for part in ("within_T", "within_Tbar", "between"):
                assert r["gap"][distance][part] == pytest.approx(row[part], abs=1e-6)
        measured = rg.measure(str(ckpt), str(run / "probe.jsonl"), layers=["final", "1", "resid_mid:0"],
                              metrics=["dispersion"], pooling="last", progress=False)
        assert set(r["dispersion"]) == set(measured.results) == {"final", "resid_post:0", "resid_mid:0"}
        for addr, value in r["dispersion"].items():
            assert value == pytest.approx(measured.results[addr]["dispersion"], abs=1e-6)


def test_the_file_holds_eval_loss_config_and_the_pick(run):
    out = json.loads((run / "out" / FILE_NAME).read_text())
    results = json.loads((run / "out" / "results.json").read_text())
    evals = {e["step"]: e["loss"]["docs"] for e in results["evaluations"]}
    for r in out["checkpoints"]:  # evaluated at 2 (evaluate_at) and 4 (the end): the loss logged at that step
        assert r["eval_loss"] == {"eval_docs_loss": pytest.approx(evals[r["step"]])}
        assert r["timings"]["total_s"] > 0
    cfg = out["config"]
    assert cfg["domain"] == DOMAIN and cfg["size"] == 40 and cfg["seed"] == 3 and cfg["burn_in"] == 0.5
    assert cfg["addresses"] == ["resid_mid:0", "resid_post:0", "final"] and cfg["n_texts"] == 9  # by depth
    assert cfg["texts"] == str(run / "probe.jsonl") and cfg["pooling"] == "last"
    # burn_in 0.5 of 4 steps: both checkpoints are eligible; the pick is the larger cosine G
    best = max(out["checkpoints"], key=lambda r: (r["G"]["cosine"], r["step"]))
    assert out["pick"]["step"] == best["step"] and out["pick"]["first_eligible_step"] == 2
    assert out["pick"] == pick_checkpoint(out["checkpoints"], 4, 0.5)
    assert results["config"]["geometry_probe"]["layers"] == ["final", "1", "resid_mid:0"]
    printed = " ".join((run / "printed.txt").read_text().split())
    assert f"geometry at 2 checkpoint(s); label-free pick: step {out['pick']['step']}" in printed


def test_pick_follows_the_documented_rule():
    def rec(step, g):
        return {"step": step, "checkpoint": f"c-{step}", "G": {"cosine": g, "euclidean": 0.0}}

    records = [rec(10, 1.9), rec(20, 1.2), rec(30, 1.5), rec(40, 1.5), rec(50, float("nan"))]
    pick = pick_checkpoint(records, 50, 0.3)  # steps >= 15; 10 has the largest G but is in the burn-in
    assert pick["step"] == 40 and pick["checkpoint"] == "c-40" and pick["G_cosine"] == 1.5  # tie: the later one
    assert pick["n_eligible"] == 3  # NaN is never picked
    assert pick_checkpoint(records, 50, 0.0)["step"] == 10
    none = pick_checkpoint(records[:1], 100, 0.5)
    assert none["step"] is None and none["n_eligible"] == 0


def test_standalone_with_a_plain_trainer_logs_and_restores_the_mode(tiny_model_dir, texts, tmp_path):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.training import pack_blocks

    loaded = load_model(tiny_model_dir("gpt2"))
    model, tok = loaded.model, loaded.tokenizer
    model.train().requires_grad_(True)
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=3, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=1, save_only_model=True, report_to="none",
                             use_cpu=True, disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=pack_blocks(texts, tok, 16, 0),
                      processing_class=tok, data_collator=default_data_collator)
    seen = []

    class Spy(GeometryCallback):
        def measure(self, model, tokenizer=None):
            values = super().measure(model, tokenizer)
            seen.append((model.training, torch.is_grad_enabled()))
            return values

    Spy(texts=texts[:5], layers="final", domain=DOMAIN, size=20, burn_in=0.0).attach(trainer)
    trainer.train()
    assert seen == [(True, True)] * 3  # train mode restored after each probe; grad mode untouched
    rows = [r for r in trainer.state.log_history if "geometry/G_cosine" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    out = json.loads((tmp_path / "o" / FILE_NAME).read_text())
    for row, rec in zip(rows, out["checkpoints"]):
        assert row["geometry/G_cosine"] == rec["G"]["cosine"] and row["geometry/G_euclidean"] == rec["G"]["euclidean"]
        assert row["geometry/dispersion/final"] == rec["dispersion"]["final"]
        assert rec["eval_loss"] is None  # no evaluation in this run
    assert out["pick"]["step"] == max(out["checkpoints"], key=lambda r: (r["G"]["cosine"], r["step"]))["step"]


def test_each_module_keeps_its_mode_and_dropout_is_off_while_probing(tiny_model_dir, texts):
    from repgeom_eval.modeling.loading import load_model

    loaded = load_model(tiny_model_dir("gpt2"))
    model = loaded.model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5  # in train mode every forward would differ
    frozen = model.transformer.h[0].ln_1.eval()  # a submodule the user keeps in eval mode stays so
    cb = GeometryCallback(texts=texts[:6], layers=["final", "resid_post:0"], domain=DOMAIN, size=20)
    first, second = cb.measure(model, loaded.tokenizer), cb.measure(model, loaded.tokenizer)
    assert first["dispersion"] == second["dispersion"] and first["G"] == second["G"]
    assert model.training and model.transformer.h[1].training and not frozen.training
    assert all(p.grad is None for p in model.parameters())


def test_a_tokenizer_without_pad_is_left_as_it_is_and_set_up_once(tiny_model_dir, texts, monkeypatch):
    import repgeom_eval.training.geometry as geometry
    from repgeom_eval.modeling.loading import load_model

    loaded = load_model(tiny_model_dir("gpt2"))
    tok = loaded.tokenizer
    tok.pad_token = None
    built = []
    monkeypatch.setattr(geometry, "Vocabulary", lambda *a, **k: built.append(1) or Vocabulary(*a, **k))
    cb = GeometryCallback(texts=texts[:4], domain=DOMAIN, size=20)
    first, second = cb.measure(loaded.model, tok), cb.measure(loaded.model, tok)
    assert tok.pad_token is None and len(built) == 1 and first["dispersion"] == second["dispersion"]


def test_the_probe_does_not_change_training(tiny_model_dir, texts, tmp_path):
    """Same seed with and without the callback: the same losses (no RNG drawn, no gradient, no weight touched)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.training import pack_blocks

    def losses(with_callback):
        loaded = load_model(tiny_model_dir("gpt2"))
        loaded.model.train().requires_grad_(True)
        args = TrainingArguments(output_dir=str(tmp_path / f"o{with_callback}"), max_steps=3, seed=0,
                                 per_device_train_batch_size=4, save_strategy="steps", save_steps=1,
                                 save_only_model=True, report_to="none", use_cpu=True, disable_tqdm=True,
                                 logging_steps=1)
        trainer = Trainer(model=loaded.model, args=args, train_dataset=pack_blocks(texts, loaded.tokenizer, 16, 0),
                          processing_class=loaded.tokenizer, data_collator=default_data_collator)
        if with_callback:
            GeometryCallback(texts=texts[:5], domain=DOMAIN, size=20).attach(trainer)
        trainer.train()
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    assert losses(True) == losses(False)


def test_a_resumed_run_keeps_the_earlier_records(tiny_model_dir, texts, tmp_path):
    from transformers import Trainer, TrainingArguments, default_data_collator

    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.training import pack_blocks

    def trainer_for(max_steps):
        loaded = load_model(tiny_model_dir("gpt2"))
        loaded.model.train().requires_grad_(True)
        args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=max_steps, per_device_train_batch_size=4,
                                 save_strategy="steps", save_steps=2, report_to="none", use_cpu=True,
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=loaded.model, args=args, train_dataset=pack_blocks(texts, loaded.tokenizer, 16, 0),
                          processing_class=loaded.tokenizer, data_collator=default_data_collator)
        GeometryCallback(texts=texts[:5], domain=DOMAIN, size=20).attach(trainer)
        return trainer

    trainer_for(2).train()
    first = json.loads((tmp_path / "o" / FILE_NAME).read_text())["checkpoints"]
    trainer_for(4).train(resume_from_checkpoint=str(tmp_path / "o" / "checkpoint-2"))
    after = json.loads((tmp_path / "o" / FILE_NAME).read_text())["checkpoints"]
    assert [r["step"] for r in after] == [2, 4] and after[0] == first[0]


@pytest.mark.parametrize("block, match", [
    ("{texts: 3}", "geometry_probe.texts must be a file of texts"),
    ("{texts: [a, b], pooling: max}", "geometry_probe.pooling must be one of last, mean, first, got 'max'"),
    ("{texts: [a, b], burn_in: 1}", r"geometry_probe.burn_in must be a number in \[0, 1\), got 1"),
    ("{texts: [a, b], layer: final}", "geometry_probe: unknown key 'layer'; did you mean 'layers'?"),
    ("{texts: [a, b], size: 0}", "geometry_probe.size must be a positive integer, got 0"),
    ("[a, b]", "geometry_probe must be a mapping"),
])
def test_a_bad_geometry_probe_block_is_one_typed_line(block, match, tmp_path, capsys):
    from repgeom_eval.spec.options.train import read_config

    text = ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1, save_strategy: steps}\n"
            f"output_dir: o\ngeometry_probe: {block}\n")
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(RepgeomError, match=match) as err:
        read_config(tmp_path / "c.yaml")
    assert "\n" not in str(err.value)
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--no-progress"]) == 2
    printed = capsys.readouterr().err
    assert len(printed.strip().splitlines()) == 1 and "Traceback" not in printed


def test_no_saved_checkpoint_and_bad_names_are_refused_before_training(tiny_model_dir, run, capsys):
    from repgeom_eval.spec.options.train import read_config

    (run / "nosave.yaml").write_text("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\n"
                                     "output_dir: o\ngeometry_probe: {texts: [a, b]}\n")
    with pytest.raises(RepgeomError, match="none is saved: set training.save_strategy"):
        read_config(run / "nosave.yaml")
    base = CONFIG.format(model=tiny_model_dir("gpt2"), domain=DOMAIN).replace("output_dir: out", "output_dir: out2")
    for old, new, match in [("layers: [final, 1", "layers: [final, 9", "9"),
                            (f'domain: "{DOMAIN}"', 'domain: "words:zzqx,qqzx"', "matches 0 token"),
                            ("texts: probe.jsonl", "texts: nothere.jsonl", "nothere.jsonl")]:
        (run / "bad.yaml").write_text(base.replace(old, new))
        assert main(["train", "--config", str(run / "bad.yaml"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
        assert not (run / "out2").exists()


def test_a_callback_built_from_a_bad_mapping_names_the_key():
    with pytest.raises(RepgeomError, match="geometry_probe.layers must be a layer address"):
        GeometryCallback(texts=["a", "b"], layers=[])
    assert math.isclose(GeometryCallback(texts=["a", "b"]).probe.burn_in, 0.5)


def test_an_earlier_geometry_file_is_an_earlier_run(tmp_path):
    from repgeom_eval.spec.options.train import parse_config
    from repgeom_eval.training.loop import check_train_outputs

    (tmp_path / "t.jsonl").write_text('{"text": "a b"}\n{"text": "c d"}\n')
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / FILE_NAME).write_text("{}")
    cfg = parse_config({"model": "m", "data": {"domains": {"a": "t.jsonl"}}, "output_dir": "o",
                        "training": {"max_steps": 1, "save_strategy": "steps"},
                        "geometry_probe": {"texts": ["a b", "c d"]}}, tmp_path)
    with pytest.raises(RepgeomError, match=f"already holds a run \\({FILE_NAME}\\)"):
        check_train_outputs(cfg)
    check_train_outputs(cfg, overwrite=True)
