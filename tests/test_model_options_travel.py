"""Model options travel as an argument (issue 34, item 4): every command that loads a model hands its
``--model-arg``/``--revision``/... to ``load_model`` in the call itself, with no process-wide setting between the
command line and the loader. Each command is run with a ``from_pretrained`` keyword that transformers refuses; the
refusal in its one-line error shows the option arrived."""

import json

import pytest

from repgeom_eval.entrypoints.cli import main
from tests.test_every_option import commands

BOGUS = "attn_implementation=bogus_impl"


@pytest.fixture(scope="module")
def files(tmp_path_factory, texts_module):
    tmp = tmp_path_factory.mktemp("travel")
    data = tmp / "texts.txt"
    data.write_text("\n".join(texts_module[:8]) + "\n", encoding="utf-8")
    from repgeom_eval.mteb_layers.examples import write_example_tasks

    tasks = write_example_tasks(tmp / "tasks", source="pydoc", size="small", seed=0)
    return {"data": str(data), "tasks": str(tasks), "out": str(tmp / "out")}


@pytest.fixture(scope="module")
def texts_module():
    from pydoc_data.topics import topics

    return [" ".join(topics[k].split()[:12]) for k in sorted(topics)[:12]]


def _arguments(files, model):
    d = files["data"]
    return {
        "measure": ["-m", model, "-d", d],
        "addresses": ["-m", model],
        "ppl-bins": ["-m", model, "-d", d, "-o", files["out"] + "-ppl.json"],
        "knn-keys": ["-m", model, "-d", d, "-o", files["out"] + "-knn.json"],
        "knnlm": ["-m", model, "--datastore", d, "--eval", d, "-o", files["out"] + "-knnlm.json"],
        "clusters": ["-m", model, "-d", d, "-o", files["out"] + "-clusters.json"],
        "condensation": ["-m", model, "-d", d, "-o", files["out"] + "-cond.json"],
        "perturb": ["-m", model, "-d", d, "-o", files["out"] + "-perturb.json"],
        "mteb run": ["-m", model, "--tasks-file", files["tasks"], "--output-folder", files["out"] + "-mteb"],
    }


def _loading_commands():
    return sorted(" ".join(words) for words, parser in commands()
                  if any("--model-arg" in a.option_strings for a in parser._actions))


def test_every_command_that_loads_a_model_is_covered(files):
    assert sorted(_arguments(files, "M")) == _loading_commands()


@pytest.mark.parametrize("command", ["measure", "addresses", "ppl-bins", "knn-keys", "knnlm", "clusters",
                                     "condensation", "perturb", "mteb run"])
def test_model_args_reach_the_loader(command, files, tiny_model_dir, capsys):
    args = _arguments(files, tiny_model_dir("llama"))[command]
    assert main(command.split() + args + ["--model-arg", BOGUS]) == 2
    err = capsys.readouterr().err
    assert "bogus_impl" in err and err.count("\n") == 1, err


def test_no_process_wide_model_options():
    import repgeom_eval.modeling.loading as loading

    assert not hasattr(loading, "loading_policy") and not hasattr(loading, "use_model_options")


def test_run_layers_takes_one_checked_config(tiny_model_dir, files):
    from repgeom_eval.mteb_layers import make_task, run_layers
    from repgeom_eval.spec.options.mteb import SweepConfig
    from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents
    from repgeom_eval.spec.errors import RepgeomError

    spec = build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)["PydocSTS"]
    task = make_task({"name": "PydocSTS", **spec})
    config = SweepConfig(layers="resid_post:[0,1]", pooling="mean", output_folder=None, progress=False, batch_size=8)
    whole = run_layers(tiny_model_dir("llama"), [task], config)
    keywords = run_layers(tiny_model_dir("llama"), [task], "resid_post:[0,1]", pooling="mean", output_folder=None,
                          progress=False, batch_size=8)
    assert whole.layers == keywords.layers == ["resid_post:0", "resid_post:1"]
    assert json.dumps(whole.rows, sort_keys=True, default=str) == json.dumps(keywords.rows, sort_keys=True,
                                                                           default=str)
    with pytest.raises(RepgeomError, match="either as a SweepConfig or as keywords"):
        run_layers(tiny_model_dir("llama"), [task], config, pooling="mean")
    with pytest.raises(RepgeomError, match="needs --layer auto"):
        SweepConfig(layers="final", layer_pick="min_dataset_entropy")
