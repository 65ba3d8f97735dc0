"""``repgeom train --config FILE.yaml`` end to end on tiny configs (seconds), and its config errors."""

import inspect
import json
import math

import pytest

import accelerate  # noqa: E402,F401  (dev extra: missing must fail, not skip)
import datasets  # noqa: E402,F401  (dev extra: missing must fail, not skip)

from repgeom_eval.entrypoints.cli import main  # noqa: E402
from repgeom_eval.spec.errors import RepgeomError  # noqa: E402
from repgeom_eval.spec.options.train import TrainConfig, parse_config, read_config  # noqa: E402
from repgeom_eval.training.data import split_texts  # noqa: E402


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


@pytest.fixture
def two_domains(tmp_path, texts):
    """Prose (Python's docs) and code (repgeom-eval's own source), read at test time."""
    import repgeom_eval.modeling.addresses
    import repgeom_eval.measurement.texts

    write_jsonl(tmp_path / "prose.jsonl", texts[:30])
    write_jsonl(tmp_path / "prose_test.jsonl", texts[30:])
    code = inspect.getsource(repgeom_eval.modeling.addresses).split("\n\n\n")
    write_jsonl(tmp_path / "code.jsonl", code)
    write_jsonl(tmp_path / "code_test.jsonl", inspect.getsource(repgeom_eval.measurement.texts).split("\n\n\n"))
    return tmp_path


SCRATCH = """
from_scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 320}
data:
  block_size: 24
  balance: true
  domains:
    prose: {train: prose.jsonl, eval: prose_test.jsonl}
    code: {train: code.jsonl, eval: code_test.jsonl}
aux_losses:
  - {name: push_away, weight: 0.01, cross_domain: true}
  - {name: angular_spread, weight: 0.1, layers: last, max_tokens: 8}
training: {max_steps: 4, per_device_train_batch_size: 8, learning_rate: 1.0e-3, use_cpu: true}
evaluate_at: [2]
output_dir: out
torch_threads: 1
"""


def test_train_from_scratch_two_domains_end_to_end(two_domains, capsys):
    (two_domains / "train.yaml").write_text(SCRATCH)
    assert main(["train", "--config", str(two_domains / "train.yaml"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "prose" in printed and "code" in printed and "push_away" in printed
    result = json.loads((two_domains / "out" / "results.json").read_text())
    # per-domain perplexity at the requested step and at the end
    assert [e["step"] for e in result["evaluations"]] == [2, 4]
    for e in result["evaluations"]:
        assert set(e["perplexity"]) == {"prose", "code"}
        for d in ("prose", "code"):
            assert e["perplexity"][d] == pytest.approx(math.exp(e["loss"][d]))
            assert 1 < e["perplexity"][d] < 10 * 320
    # one log row per step with CE, both aux losses and the batch dispersion; loss = CE + Σ λ·L_aux
    log = result["train_log"]
    assert [row["step"] for row in log] == [1, 2, 3, 4]
    for row in log:
        assert 0 < row["dispersion"] < 2 and 0 < row["dispersion_cross"] < 2
        expected = row["ce"] + 0.01 * row["aux/push_away"] + 0.1 * row["aux/angular_spread"]
        assert row["loss"] == pytest.approx(expected, rel=1e-5)
    cfg = result["config"]
    assert list(cfg) == ["model", "from_scratch", "source", "data", "aux_losses", "plugins", "objective", "training",
                         "evaluate_at", "geometry_probe", "dispersion_layer", "seed", "torch_threads", "output_dir",
                         "save_model",
                         "versions"]
    assert cfg["from_scratch"] == {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 320, "tokenizer": None}
    assert cfg["data"] == {"block_size": 24, "text_field": "text", "eval_fraction": 0.1, "balance": True,
                           "domains": {d: {"train": str(two_domains / f"{d}.jsonl"),
                                           "eval": str(two_domains / f"{d}_test.jsonl")} for d in ("prose", "code")}}
    assert cfg["aux_losses"][0] == {"name": "push_away", "granularity": "token", "cross_domain": True,
                                    "pooling": "last", "eps": 1e-12, "weight": 0.01, "layers": "final"}
    assert cfg["aux_losses"][1]["max_tokens"] == 8 and cfg["aux_losses"][1]["variant"] == "paper"
    assert cfg["training"]["max_steps"] == 4 and cfg["training"]["logging_steps"] == 1
    assert cfg["source"]["kind"] == "from_scratch" and result["model"]["n_layers"] == 2
    data = result["data"]
    assert data["prose"]["train_blocks_used"] == data["code"]["train_blocks_used"]  # balance: true
    # the trained model and its tokenizer load like any checkpoint
    from repgeom_eval import measure

    measured = measure(str(two_domains / "out" / "model"), ["def f(x): return x", "Some English prose here."],
                       metrics=["dispersion"], progress=False)
    assert 0 <= measured.results["final"]["dispersion"] <= 2


def test_continued_training_of_a_local_model_single_domain(tiny_model_dir, tmp_path, texts):
    write_jsonl(tmp_path / "texts.jsonl", texts)
    (tmp_path / "cfg.yaml").write_text(f"""
model: {tiny_model_dir("gpt2")}
data:
  block_size: 16
  domains: {{text: texts.jsonl}}
aux_losses: [{{name: squeeze, weight: 0.5}}]
training: {{max_steps: 2, per_device_train_batch_size: 4, use_cpu: true}}
output_dir: run
save_model: false
""")
    assert main(["train", "-c", str(tmp_path / "cfg.yaml"), "--no-progress", "--json",
                 "--set", "training.max_steps=3", "--set", "model.allow_random_init=true"]) == 0
    result = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["timings"]["steps"] == 3  # --set applied
    assert result["model"]["options"] == {"allow_random_init": True}  # a model option, recorded as measure does
    assert [e["step"] for e in result["evaluations"]] == [3]  # the held-out 10% of the texts, at the end
    assert result["data"]["text"]["eval_texts"] == 4 and result["data"]["text"]["train_texts"] == 36
    assert result["config"]["source"] == {"kind": "continued", "model": tiny_model_dir("gpt2")}
    assert all(row["aux/squeeze"] == pytest.approx(row["dispersion"]) for row in result["train_log"])
    assert not (tmp_path / "run" / "model").exists()


def test_split_is_seeded_and_disjoint():
    from repgeom_eval.measurement.texts import from_texts

    ts = from_texts([f"text {i}" for i in range(20)])
    a, b = split_texts(ts, 0.2, 0), split_texts(ts, 0.2, 0)
    assert a == b and len(a[1]) == 4 and not set(a[0]) & set(a[1])
    assert split_texts(ts, 0.2, 1) != a


@pytest.mark.parametrize("text, match", [
    ("data: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o", "exactly one of `model`"),
    ("model: m\nfrom_scratch: {}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "exactly one of"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\nevaluate: [1]",
     "unknown key 'evaluate'; did you mean 'evaluate_at'"),
    ("model: m\ndata: {domains: {}}\ntraining: {max_steps: 1}\noutput_dir: o",
     r"data.domains must be a mapping of one or more domains, e\.g\. \{text: \{train: texts.jsonl\}\}, got \{\}"),
    ("model: m\ndata: {domains: {a: {eval: e.jsonl}}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "data.domains.a has no train"),
    ("model: m\ndata: {domains: {a: {train: t.jsonl, evl: e}}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "data.domains.a: unknown key 'evl'; did you mean 'eval'"),
    ("model: m\ndata: {domains: {a: t.jsonl}, block_sze: 8}\ntraining: {max_steps: 1}\noutput_dir: o",
     "data: unknown key 'block_sze'; did you mean 'block_size'"),
    ("model: m\ndata: [1]\ntraining: {max_steps: 1}\noutput_dir: o", "data must be a mapping, got list"),
    ("model: m\ndata: {domains: {a: t.jsonl}, eval_fraction: 1}\ntraining: {max_steps: 1}\noutput_dir: o",
     r"data.eval_fraction must be a number in \[0, 1\), got 1"),
    ("model: m\ndata: {domains: {a: 3}}\ntraining: {max_steps: 1}\noutput_dir: o", "data.domains.a must be a mapping"),
    ("model: m\ndata: {domains: {a: {train: ''}}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "data.domains.a.train must be a file path, got ''"),
    ("from_scratch: {n_layer: 0}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "from_scratch.n_layer must be a positive integer, got 0"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\nseed: '1'",
     "seed must be an integer, got '1'"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\nsave_model: 'no'",
     "save_model must be true or false, got 'no'"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\naux_losses: [3]",
     r"aux_losses must be a list of mappings like \{name: push_away, weight: 0.1\}, got \[3\]"),
    ("model: {name: m, revison: v1}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "model: unknown key 'revison'; did you mean 'revision'"),
    ("model: {revision: v1}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "model has no name"),
    ("model: {name: m, trust_remote_code: 'no'}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\n"
     "output_dir: o", "model.trust_remote_code must be true or false, got 'no'"),
    ("model: {name: m, dtype: float8}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o",
     "model: unknown dtype 'float8'"),
    ("model: m\ndata: {domains: {a: t.jsonl}, block_size: 1}\ntraining: {max_steps: 1}\noutput_dir: o",
     "block_size"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {}\noutput_dir: o", "max_steps"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1, seed: 3}\noutput_dir: o", "top level"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}", "no output_dir"),
    ("from_scratch: {n_embd: 30, n_head: 4}\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\n"
     "output_dir: o", "divisible"),
    ("model: m\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\nevaluate_at: [0]",
     "evaluate_at"),
])
def test_config_errors(text, match, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(RepgeomError, match=match) as err:
        read_config(path)
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_cli_errors_are_one_line_and_write_nothing(two_domains, capsys):
    cases = [
        (SCRATCH.replace("weight: 0.01, ", ""), "explicit `weight`"),
        (SCRATCH.replace("push_away", "push_awy"), "did you mean 'push_away'"),
        (SCRATCH.replace("use_cpu: true", "use_cpu: true, warmup: 3"), "TrainingArguments"),
        (SCRATCH.replace("prose.jsonl", "missing.jsonl"), "does not exist"),
        (SCRATCH.replace("block_size: 24", "block_size: 4000"), "block_size"),
        (SCRATCH.replace("output_dir: out", "output_dir: prose.jsonl/out"), "is a file"),
    ]
    for text, match in cases:
        (two_domains / "bad.yaml").write_text(text)
        assert main(["train", "--config", str(two_domains / "bad.yaml"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (two_domains / "out").exists()
    assert main(["train", "--config", str(two_domains / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (two_domains / "ok.yaml").write_text(SCRATCH)
    assert main(["train", "--config", str(two_domains / "ok.yaml"), "--set", "training.max_steps"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_relative_paths_are_taken_from_the_config_file(tmp_path):
    cfg = parse_config({"model": "./m", "data": {"domains": {"a": "t.jsonl"}}, "training": {"max_steps": 1},
                        "output_dir": "o"}, tmp_path)
    assert cfg.data.domains["a"].train == str(tmp_path / "t.jsonl") and cfg.data.domains["a"].eval is None
    assert cfg.output_dir == tmp_path / "o" and cfg.model == str(tmp_path / "m")
    hub = parse_config({"model": "org/name", "data": {"domains": {"a": "t.jsonl"}}, "training": {"max_steps": 1},
                        "output_dir": "o"}, tmp_path)
    assert hub.model == "org/name"


BASE = {"data": {"domains": {"a": "t.jsonl"}}, "training": {"max_steps": 1}, "output_dir": "o"}


def test_model_options_come_from_the_model_mapping(tmp_path):
    from repgeom_eval.spec.options.model import ModelOptions

    (tmp_path / "adapter").mkdir()
    cfg = parse_config({**BASE, "model": {"name": "org/name", "revision": "v1", "trust_remote_code": True,
                                          "peft": "./adapter"}}, tmp_path)
    assert cfg.model == "org/name"
    assert cfg.model_options == ModelOptions(dtype="float32", revision="v1", trust_remote_code=True,
                                             peft=str(tmp_path / "adapter"))
    # a trained model loads in float32 unless told otherwise (mixed precision is the Trainer's)
    assert parse_config({**BASE, "model": "org/name"}).model_options == ModelOptions(dtype="float32")
    path = tmp_path / "c.yaml"
    path.write_text("model: org/name\ndata: {domains: {a: t.jsonl}}\ntraining: {max_steps: 1}\noutput_dir: o\n")
    cfg = read_config(path, ["model.revision=v2"])  # --set model.KEY on a model named by a string
    assert cfg.model == "org/name" and cfg.model_options.revision == "v2"


def test_the_config_is_one_frozen_typed_object_from_python_too():
    import dataclasses
    from pathlib import Path

    from repgeom_eval.spec.options.train import Domain

    cfg = TrainConfig(model="m", data={"domains": {"a": "t.jsonl"}, "block_size": 16}, training={"max_steps": 2},
                      output_dir="o", evaluate_at=[4, 2, 4], aux_losses={"name": "push_away", "weight": 0.1})
    assert cfg.data.block_size == 16 and cfg.data.domains["a"] == Domain(train="t.jsonl")
    assert cfg.evaluate_at == (2, 4) and cfg.aux_losses == ({"name": "push_away", "weight": 0.1},)
    assert cfg.output_dir == Path("o") and cfg.from_scratch is None and cfg.seed == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1
    with pytest.raises(RepgeomError, match="^data.block_size must be an integer >= 2, got 1$"):
        TrainConfig(model="m", data={"domains": {"a": "t.jsonl"}, "block_size": 1}, training={"max_steps": 2},
                    output_dir="o")
    with pytest.raises(RepgeomError, match="^block_size must be an integer >= 2, got 1$"):  # the group alone
        dataclasses.replace(cfg.data, block_size=1)
    scratch = TrainConfig(from_scratch={"n_layer": 1, "resid_pdrop": 0.0}, **BASE)
    assert scratch.from_scratch.n_layer == 1 and dict(scratch.from_scratch.gpt2) == {"resid_pdrop": 0.0}


def test_help_lists_every_config_key(capsys):
    from repgeom_eval.spec.options.train import DataOptions, Domain, ScratchModel
    from repgeom_eval.spec.options.settings import file_keys

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    keys = (file_keys(TrainConfig) + [f"data.{k}" for k in file_keys(DataOptions)]
            + [f"data.domains.NAME.{k}" for k in file_keys(Domain)]
            + [f"from_scratch.{k}" for k in file_keys(ScratchModel)] + ["model.name", "model.revision", "model.peft"])
    for key in keys:
        assert f"\n  {key} " in out, key
    assert "(default: float32)" in " ".join(out.split()[out.split().index("model.dtype"):])


def test_intermediate_checkpoints_are_model_folders_with_the_tokenizer(two_domains):
    """training.save_strategy: steps writes output_dir/trainer/checkpoint-N; each loads on its own (weights and the
    tokenizer trained from scratch), so `repgeom gap` can screen them; the last one is the final model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from repgeom_eval.analyses.gap import screen

    (two_domains / "train.yaml").write_text(SCRATCH)
    sets = ["training.save_strategy=steps", "training.save_steps=2", "training.save_only_model=true",
            "aux_losses=[]"]
    args = ["train", "--config", str(two_domains / "train.yaml"), "--no-progress"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    out = two_domains / "out"
    checkpoints = sorted((out / "trainer").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert [p.name for p in checkpoints] == ["checkpoint-2", "checkpoint-4"]
    final_tok = AutoTokenizer.from_pretrained(out / "model")
    final = AutoModelForCausalLM.from_pretrained(out / "model")
    for ckpt in checkpoints:
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert tok.get_vocab() == final_tok.get_vocab() and len(tok) == 320
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        ids = tok("def f(x): return x", return_tensors="pt")["input_ids"]
        assert torch.isfinite(model(ids).logits).all()
    last = AutoModelForCausalLM.from_pretrained(checkpoints[-1])
    assert torch.equal(last.get_output_embeddings().weight, final.get_output_embeddings().weight)
    first = AutoModelForCausalLM.from_pretrained(checkpoints[0])
    assert not torch.equal(first.get_output_embeddings().weight, final.get_output_embeddings().weight)
    result = screen([str(p) for p in checkpoints], domain="digits", reference="general", size=20)
    assert result.vocabulary["shared"] and len(result.rows) == 2
    # a training run with no intermediate saves still refuses a rerun into the same output_dir
    assert main(args) == 2


def test_overwrite_removes_the_earlier_runs_checkpoints(two_domains):
    (two_domains / "train.yaml").write_text(SCRATCH)
    base = ["train", "--config", str(two_domains / "train.yaml"), "--no-progress", "--set", "aux_losses=[]",
            "--set", "training.save_strategy=steps", "--set", "training.save_steps=2", "--set", "save_model=false"]
    assert main(base) == 0
    trainer = two_domains / "out" / "trainer"
    assert sorted(p.name for p in trainer.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert main(base + ["--overwrite", "--set", "training.max_steps=2"]) == 0
    assert sorted(p.name for p in trainer.iterdir()) == ["checkpoint-2"]  # not checkpoint-4 of the earlier run
