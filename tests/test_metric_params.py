"""Bad metric parameters are a user error: a RepgeomError naming the metric and the parameter, never a traceback."""

import pytest

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.plugin_system.host import get_host

BAD_PARAMS = [
    ("massive_activations", {"top_k": 0}, "top_k"),
    ("massive_activations", {"top_k": 2.5}, "top_k"),
    ("infonce", {"tau": 0.0}, "tau"),
    ("infonce", {"tau": -1}, "tau"),
    ("infonce", {"tau": float("inf")}, "tau"),
    ("dime", {"n_iters": 0}, "n_iters"),
    ("dime", {"seed": -1}, "seed"),
    ("dime", {"alpha": float("nan")}, "alpha"),
    ("lidar", {"delta": 0.0}, "delta"),
    ("lidar", {"eps": -1e-7}, "eps"),
    ("condensation", {"bins": -1}, "bins"),
    ("condensation", {"eps": 0}, "eps"),
    ("dataset_entropy", {"batch_size": 0}, "batch_size"),
]


@pytest.mark.parametrize("metric, params, culprit", BAD_PARAMS, ids=lambda v: str(v))
def test_bad_parameter_names_metric_and_parameter(metric, params, culprit):
    cls = get_host().metrics.get(metric)
    with pytest.raises(RepgeomError, match=culprit):
        cls(**params)


@pytest.mark.parametrize("metric", get_host().metrics.names())
def test_good_defaults_still_construct(metric):
    get_host().metrics.get(metric)()


def test_cli_reports_a_bad_parameter_in_one_line(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "t.txt"
    data.write_text("one text here\nanother text there\n")
    out = tmp_path / "out.json"
    rc = main(["measure", "-m", tiny_model_dir("gpt2"), "-d", str(data), "--metrics", "lidar",
               "--metric-param", "lidar.delta=0", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists()
    assert "lidar" in err and "delta=0" in err and "Traceback" not in err and len(err.splitlines()) == 1
