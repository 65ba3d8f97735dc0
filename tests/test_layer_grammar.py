"""One grammar for "which layer" (docs/metrics.md#layer-addresses): ``repgeom_eval.spec.layer_request.layer_request``
splits every surface's request, so ``resid_post:[0,1]`` is the same two layers in ``measure --layers``,
``mteb run --layer``, ``repgeom-hf``'s ``repgeom_layers`` (lm-eval's command line and its Python API's model-argument
string) and the Python keywords, and every output records the request under one name, ``layer_request``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.layer_request import REQUEST_KEY, layer_request

BRACKETS = "resid_post:[0,1]"
BOTH = ["resid_post:0", "resid_post:1"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")  # 2 blocks and a final norm: resid_post:1 is not `final`


@pytest.fixture
def splits(monkeypatch):
    """How many times each request is split in this test: an instrumented ``_split_items`` (issue 34: one parse
    per door; a request that travels through several checks and config copies is split once per process)."""
    from collections import Counter

    from repgeom_eval.spec import layer_request as grammar

    grammar._split_once.cache_clear()
    counts: Counter = Counter()
    split = grammar._split_items

    def counted(parts):
        counts[tuple(parts)] += 1
        return split(parts)

    monkeypatch.setattr(grammar, "_split_items", counted)
    yield counts
    grammar._split_once.cache_clear()


def _texts(folder: Path, texts) -> Path:
    path = folder / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:6]))
    return path


# -- the grammar ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, items", [
    (BRACKETS, (BRACKETS,)),
    ([BRACKETS], (BRACKETS,)),
    (f"{BRACKETS},final", (BRACKETS, "final")),
    ([f"{BRACKETS}, final", "3"], (BRACKETS, "final", "3")),
    (3, ("3",)),
    ("auto", ("auto",)),
])
def test_one_split(given, items):
    assert layer_request(given).items == items
    assert layer_request(layer_request(given)) == layer_request(given)


@pytest.mark.parametrize("given, message", [
    ("resid_post:[0", "brackets are unbalanced"),
    (["resid_post:[0", "1]"], "brackets are unbalanced"),  # what a comma split of the bracket case gave
    ("", "no layer address"),
    ([], "no layer address"),
    ("auto,final", "cannot be combined"),
    (True, "a layer request is"),
    ({"final": 1}, "a layer request is"),
])
def test_what_the_grammar_refuses(given, message):
    with pytest.raises(RepgeomError, match=message):
        layer_request(given)


def test_the_split_lives_in_one_module():
    sources = [p for p in (ROOT / "repgeom_eval").rglob("*.py")] + list((ROOT / "entrypoints").glob("*.py"))
    users = sorted(str(p.relative_to(ROOT)) for p in sources if "_split_items(" in p.read_text(encoding="utf-8"))
    assert users == ["repgeom_eval/spec/layer_request.py"]


# -- the bracket case through every surface ---------------------------------------------------------------------------

def test_measure_cli(llama, tmp_path, texts, splits):
    out = tmp_path / "m.json"
    assert main(["measure", "-m", llama, "-d", str(_texts(tmp_path, texts)), "-l", BRACKETS, "-o", str(out),
                 "--no-progress"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["layers"] == BOTH and config[REQUEST_KEY] == [BRACKETS]
    assert splits == {(BRACKETS,): 1}  # the command line's check, the config copies, the engine: one split


def test_python_api(llama, texts):
    import repgeom_eval as rg
    from repgeom_eval.mteb_layers import LayerEmbedder

    result = rg.measure(llama, texts[:6], layers=BRACKETS, progress=False)
    assert list(result.results) == BOTH and result.config[REQUEST_KEY] == [BRACKETS]
    assert [str(a) for a in LayerEmbedder(llama).addresses(BRACKETS)] == BOTH


def test_mteb_run_cli(llama, tmp_path, splits, capsys):
    from repgeom_eval.mteb_layers.examples import write_example_tasks

    tasks_file = write_example_tasks(tmp_path / "ex", size="small")
    out = tmp_path / "results"
    assert main(["mteb", "run", "-m", llama, "--layer", BRACKETS, "--tasks-file", str(tasks_file), "-t", "PydocSTS",
                 "--output-folder", str(out), "-b", "8", "--no-progress", "--no-summary"]) == 0
    layers = sorted(json.loads(meta.read_text())["loader_kwargs"]["layer"] for meta in out.rglob("model_meta.json"))
    assert layers == BOTH
    assert splits[(BRACKETS,)] == 1
    assert f"layer_request: {BRACKETS} → resid_post:0, resid_post:1" in capsys.readouterr().out


def test_mteb_python_api(llama):
    from repgeom_eval.mteb_layers import make_task, run_layers

    pairs = [("a cat sat", "a cat sits", 5), ("dogs ran far", "birds sang", 0), ("the sun rose", "sunrise came", 4),
             ("old towns", "green hills", 1)]
    task = make_task({"name": "GrammarSTS", "type": "STS", "data": [
        {"sentence1": a, "sentence2": b, "score": s} for a, b, s in pairs]})
    sweep = run_layers(llama, [task], BRACKETS, output_folder=None, progress=False)
    assert sweep.layers == BOTH and sweep.layer_request == [BRACKETS]
    assert {r["layer"] for r in sweep.rows} == set(BOTH)


@pytest.mark.parametrize("route", ["command line", "python string"])
def test_repgeom_hf_model_args(llama, tmp_path, route, splits):
    """lm-eval's command line splits ``--model_args`` at the commas outside brackets; its Python API's string goes
    through ``simple_parse_args_string``, which splits at every comma: both reach the two layers."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.testing import write_lm_eval_task

    import repgeom_eval.lmeval.model  # noqa: F401  (registers repgeom-hf)

    args = f"pretrained={llama},repgeom_metrics=dispersion,repgeom_layers={BRACKETS},device=cpu,batch_size=4"
    if route == "command line":
        from lm_eval._cli.utils import key_val_to_dict

        args = key_val_to_dict(args)
    folder = write_lm_eval_task(tmp_path / "tasks", "grammar_task", [("the cat sat on the", "mat"),
                                                                     ("dogs ran over the", "hill"),
                                                                     ("birds sang in the", "trees")])
    out = simple_evaluate(model="repgeom-hf", model_args=args, tasks=["grammar_task"], bootstrap_iters=0,
                          task_manager=TaskManager(include_defaults=False, include_path=str(folder)))
    results = out["results"]["grammar_task"]
    assert {k for k in results if k.startswith("repgeom:dispersion@") and "_stderr" not in k} == {
        f"repgeom:dispersion@{a},none" for a in BOTH}
    record = out["configs"]["grammar_task"]["metadata"]["repgeom"]
    assert record[REQUEST_KEY] == [BRACKETS] and record["metric_addresses"] == BOTH
    # the start-up check, the model, the task and the feeding all read repgeom_layers: it is split once
    assert splits[(BRACKETS,)] == 1
