"""`repgeom measure` end to end: the results schema, per-text output, and bad input (clear error, no output)."""

import json
import subprocess
import sys

import pytest

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import NonFiniteError, RepgeomError
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.measurement.engine import measure


@pytest.fixture
def data_file(tmp_path, texts):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": f"doc{i}"}) + "\n" for i, t in enumerate(texts[:12])))
    return path


def cli(*args):
    return main([str(a) for a in args])


def test_measure_writes_the_documented_schema(tmp_path, data_file, tiny_model_dir, capsys):
    out, per_text = tmp_path / "out.json", tmp_path / "scores.jsonl"
    rc = cli("measure", "--model", tiny_model_dir("gpt2"), "--data", data_file, "--layers", "all", "resid_mid:-1",
             "--metrics", "dispersion,token_dispersion", "--output", out, "--per-text", per_text)
    assert rc == 0
    result = json.loads(out.read_text())
    assert set(result) == {"model", "data", "config", "results", "summary", "diagnostics", "timings"}
    assert result["model"]["n_layers"] == 2 and result["model"]["hidden_size"] == 32
    assert result["model"]["dtype"] == "float32" and result["model"]["model_type"] == "gpt2"
    assert result["data"]["n_texts"] == 12 and result["data"]["n_tokens"] > 12 and result["data"]["n_truncated"] == 0
    assert list(result["results"]) == ["embed", "resid_post:0", "resid_mid:1", "final"]  # depth order
    assert isinstance(result["results"]["final"]["dispersion"], float)
    assert 0 < result["results"]["final"]["token_dispersion"] < 2
    config = result["config"]
    assert config["pooling"] is None and config["batch_size"] == 16 and config["max_length"] == 128
    assert config["seed"] == 0 and config["massive_share_warning"] == 0.5
    assert config["layers"] == list(result["results"]) and config["padding_side"] == "right"
    assert config["metrics"] == {"dispersion": {"per_text": True, "pooling": "last"},
                                 "token_dispersion": {"per_text": True}}
    assert {"forward_s", "total_s", "load_model_s"} <= set(result["timings"])
    rows = [json.loads(line) for line in per_text.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"doc{i}" for i in range(12)]
    assert set(rows[0]["scores"]) == set(result["results"])
    assert "dispersion" in capsys.readouterr().out  # the table


def test_txt_input_and_json_stdout(tmp_path, texts, tiny_model_dir, capsys):
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:5]) + "\n\n   \n")
    assert cli("measure", "-m", tiny_model_dir("llama"), "-d", data, "--json", "--pooling", "mean") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data"]["n_texts"] == 5 and result["data"]["n_skipped_empty"] == 2


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


BAD_DATA = [
    ("empty.jsonl", "", "is empty"),
    ("blank.txt", "  \n\t\n \n", r"0 non-empty text\(s\) \(3 empty or whitespace-only skipped\)"),
    ("one.txt", "just one text\n", "at least 2"),
    ("latin1.txt", b"fine line\ncaf\xe9 au lait\n", r"latin1\.txt:2: not valid UTF-8 \(byte 0xe9 at column 4\)"),
    ("broken.jsonl", '{"text": "ok"}\n{"text": oops}\n', r"broken\.jsonl:2: not valid JSON"),
    ("field.jsonl", '{"body": "a"}\n{"body": "b"}\n', r"field\.jsonl:1: no 'text' field \(fields: 'body'\)"),
    ("list.jsonl", '["a"]\n["b"]\n', "expected a JSON object"),
]


@pytest.mark.parametrize("name, content, message", BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_data_files(name, content, message, tmp_path, tiny_model_dir, capsys):
    data, out = write(tmp_path, name, content), tmp_path / "out.json"
    assert cli("measure", "-m", tiny_model_dir("gpt2"), "-d", data, "-o", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("repgeom: error: ") and err.count("\n") == 1
    assert __import__("re").search(message, err), err
    assert not out.exists() and list(tmp_path.iterdir()) == [data]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--metrics", "dispersoin"], "unknown metric 'dispersoin'; did you mean 'dispersion'"),
        (["--layers", "resid_pots:1"], "did you mean 'resid_post'"),
        (["--layers", "resid_post:9"], "out of range"),
        (["--model", "/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
        (["--model", "no-such-org/no-such-model"], "could not be fetched"),
        (["--data", "/nonexistent.jsonl"], "does not exist"),
        (["--data", "."], "is a directory"),
        (["--output", "/nonexistent-dir/out.json"], "output directory '/nonexistent-dir' does not exist"),
        (["--output", "."], "is a directory"),
        (["--metric-param", "dispersion.bogus=1"], r"metric 'dispersion' has no parameter\(s\) \['bogus'\]"),
        (["--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
    ],
)
def test_bad_arguments(args, message, tmp_path, data_file, tiny_model_dir, capsys):
    base = {"--model": tiny_model_dir("gpt2"), "--data": str(data_file), "--output": str(tmp_path / "out.json")}
    extra = dict(zip(args[::2], args[1::2]))
    merged = {**base, **extra}
    assert cli("measure", *[x for kv in merged.items() for x in kv]) == 2
    err = capsys.readouterr().err
    assert message in err or __import__("re").search(message, err), err
    assert err.count("\n") == 1
    assert not (tmp_path / "out.json").exists()


def test_long_texts_are_truncated_counted_and_warned(tmp_path, tiny_model_dir, texts):
    long_text = " ".join(texts) * 3
    with pytest.warns(UserWarning, match="1 of 3 texts are longer than 128 tokens"):
        result = measure(tiny_model_dir("gpt2"), [long_text, texts[0], texts[1]], progress=False)
    assert result.data["n_truncated"] == 1


def test_nan_hidden_states_name_the_address_and_write_nothing(tmp_path, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("llama"))
    block = loaded.model.model.layers[1]
    handle = block.register_forward_hook(lambda m, a, o: o * float("nan"))
    try:
        with pytest.raises(NonFiniteError, match="NaN or inf in the hidden states at address resid_post:1"):
            measure(loaded, texts[:4], layers="resid_post:[0,1]", progress=False)
    finally:
        handle.remove()


def test_zero_vectors_are_legal(tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("llama"))

    def zero_first_row(module, args, output):
        output = output.clone()
        output[0] = 0
        return output

    handle = loaded.model.model.layers[0].register_forward_hook(zero_first_row)
    try:
        result = measure(loaded, texts[:6], layers="resid_post:0", batch_size=6, progress=False)
    finally:
        handle.remove()
    assert result.diagnostics["resid_post:0"]["dispersion"]["n_zero_vectors"] == 1
    assert 0 < result.results["resid_post:0"]["dispersion"] < 2


def test_subprocess_errors_have_no_traceback(tmp_path, tiny_model_dir):
    bad = write(tmp_path, "bad.txt", b"\xff\xfe\n")
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "measure", "-m", tiny_model_dir("gpt2"), "-d",
                           str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "not valid UTF-8" in proc.stderr


def test_addresses_command(tiny_model_dir, capsys):
    assert cli("addresses", "-m", tiny_model_dir("gpt2"), "--layers", "knn_keys") == 0
    out = capsys.readouterr().out
    assert "resid_mid:1" in out and "input of transformer.h.1.ln_2" in out


def test_texts_without_tokens_are_skipped_and_counted(tiny_model_dir, texts):
    from tokenizers import normalizers

    loaded = load_model(tiny_model_dir("gpt2"))
    loaded.tokenizer.backend_tokenizer.normalizer = normalizers.Replace("\x00", "")  # "\x00" → no tokens
    with pytest.warns(UserWarning, match="1 text\\(s\\) tokenize to no tokens"):
        with_empty = measure(loaded, texts[:5] + ["\x00"], per_text=True, progress=False)
    without = measure(loaded, texts[:5], progress=False)
    assert with_empty.results["final"]["dispersion"] == pytest.approx(without.results["final"]["dispersion"])
    assert with_empty.data["n_skipped_no_tokens"] == 1
    with pytest.warns(UserWarning), pytest.raises(RepgeomError, match="only 1 text"):
        measure(loaded, [texts[0], "\x00", "\x00"], progress=False)


def test_measure_does_not_change_the_callers_tokenizer(tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("gpt2"))
    loaded.tokenizer.padding_side = "left"
    measure(loaded, texts[:3], padding_side="right", progress=False)
    assert loaded.tokenizer.padding_side == "left"


def test_one_tensor_is_reported_under_one_name(tiny_model_dir, texts):
    with pytest.warns(UserWarning, match="resid_post:1 and final are the same tensor on this bert model"):
        r = measure(tiny_model_dir("bert"), texts[:4], layers="final,resid_post:-1,embed,resid_pre:0",
                    progress=False)
    assert list(r.results) == ["embed", "final"]


def test_debug_adds_the_traceback_and_keeps_the_line_and_the_status(capsys):
    # --debug: the traceback first, then the same one-line error (without the hint to use --debug) and status 2
    assert main(["--debug", "measure", "-m", "no/such/model", "-d", "no-such-data.txt"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1] == "repgeom: error: data file 'no-such-data.txt' does not exist"
