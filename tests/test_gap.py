"""Dispersion gap G (docs/metrics.md#dispersion-gap): the math, token sets, the partial checkpoint read, screening,
`repgeom gap`."""

import argparse
import json
import keyword
import math
import shutil

import pytest
import torch

from repgeom_eval.analyses.gap import (Vocabulary, dispersion_gap, open_output_embeddings, read_output_embeddings,
                                       resolve_token_set, screen, vocabulary_difference)
from repgeom_eval.entrypoints import gap_cmd
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional import gap_distances
from repgeom_eval.functional.stats import rankdata, spearman


# -- fixtures ----------------------------------------------------------------------------------------------------

@pytest.fixture
def gap_host():
    """The process host: the built-in token sets and the `gap` command come through the entry points."""
    from repgeom_eval.plugin_system.host import get_host

    host = get_host()
    assert {"digits", "python_keywords", "general"} <= set(host.token_sets) and "gap" in host.commands
    return host


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints: three sharing one tokenizer (gpt2 tied, llama untied and sharded, gpt_neox with a legacy
    lm_head key), and a llama whose tokenizer was trained with a different vocabulary size."""
    from transformers import AutoModelForCausalLM

    from repgeom_eval.testing import make_tiny_model, make_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("gap")
    out = {"gpt2": str(make_tiny_model("gpt2", root / "gpt2"))}
    tok = make_tokenizer()
    cfg = tiny_config("llama", len(tok) + 16)
    cfg.tie_word_embeddings = False
    torch.manual_seed(1)
    llama = AutoModelForCausalLM.from_config(cfg)
    llama.save_pretrained(root / "llama-untied", max_shard_size="20KB")  # sharded: follows the index
    tok.save_pretrained(root / "llama-untied")
    out["llama_untied"] = str(root / "llama-untied")
    out["neox"] = str(make_tiny_model("gpt_neox", root / "neox", seed=2))
    tok300 = make_tokenizer(vocab_size=300)
    torch.manual_seed(3)
    out["other_vocab"] = _save(AutoModelForCausalLM.from_config(tiny_config("llama", len(tok300) + 16)), tok300,
                               root / "llama-vocab300")
    return out


def _hand_tokenizer(vocab):
    """A word-level tokenizer with exactly the given entries (no decoder: markers stay in the decoded text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


HAND = ["<unk>", "5", "Ġ5", "▁7", "for", "Ġfor", " apple", "banana", "ab", "x1y", "▁cherry", "import", "Ġ55", "Ġ"]


# -- the math ----------------------------------------------------------------------------------------------------

def test_oracle_7():
    W = torch.tensor([[1, 0, 0], [0.8, 0.6, 0], [0, 0, 1], [0, 1, 0], [-1, 0, 0]], dtype=torch.float64)
    out = dispersion_gap(W, [0, 1], [2, 3, 4])
    assert out["within_T"] == pytest.approx(0.2, abs=1e-9)
    assert out["between"] == pytest.approx(1.2, abs=1e-9)
    assert out["G"] == pytest.approx(1.4, abs=1e-9)
    assert out["within_Tbar"] == pytest.approx(1 - (0 + 0 + 0) / 3, abs=1e-9)  # three orthogonal-or-opposite rows
    # float32 storage (as most checkpoints) gives the same numbers: the sums run in float64
    assert dispersion_gap(W.float(), [0, 1], [2, 3, 4])["G"] == pytest.approx(1.4, abs=1e-7)


def _brute(A, B, dist):
    A, B = A.double(), B.double()

    def d(x, y):
        if dist == "cosine":
            ux = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            uy = y / y.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            return 1 - ux @ uy.T
        return (x[:, None, :] - y[None, :, :]).norm(dim=-1)

    within = d(A, A)
    n = A.shape[0]
    within = within[~torch.eye(n, dtype=torch.bool)].mean()
    wb = d(B, B)[~torch.eye(B.shape[0], dtype=torch.bool)].mean()
    between = d(A, B).mean()
    return {"within_T": float(within), "within_Tbar": float(wb), "between": float(between),
            "G": float(within + between)}


@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
def test_brute_force_equality_on_random_data(distance, monkeypatch):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(60, 7, generator=g, dtype=torch.float64) + 0.3
    W[5] = 0  # a zero row: cosine 0 to everything (Q form), distance |w| in Euclidean
    T = [0, 3, 5, 9, 11, 17, 20]
    Tbar = [i for i in range(60) if i not in T][::2]
    expected = _brute(W[T], W[Tbar], distance)
    monkeypatch.setattr(gap_distances, "_chunk_rows", lambda n_cols, budget=0: 4)  # exercise the row chunks
    got = dispersion_gap(W, T, Tbar, distance=distance)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-9), key


def test_gap_rejects_bad_input():
    W = torch.eye(4)
    with pytest.raises(RepgeomError, match="unknown distance 'manhattan'"):
        dispersion_gap(W, [0, 1], [2], distance="manhattan")
    with pytest.raises(RepgeomError, match="non-empty"):
        dispersion_gap(W, [0, 1], [])
    with pytest.raises(RepgeomError, match="out of range for an output embedding with 4 rows"):
        dispersion_gap(W, [0, 9], [2])
    assert math.isnan(dispersion_gap(W, [0], [2, 3])["within_T"])  # N < 2 → NaN (docs/metrics.md#cosine-dispersion)


def test_spearman_average_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3])) and math.isnan(spearman([1], [2]))
    assert rankdata([0.1, 0.3, 0.3, 0.5]).tolist() == [1.0, 2.5, 2.5, 4.0]
    import scipy.stats as stats
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 5, (30,), generator=g).tolist()  # many ties
    y = torch.randn(30, generator=g).tolist()
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)


# -- token sets --------------------------------------------------------------------------------------------------

def test_token_sets_on_a_hand_made_vocabulary(gap_host):
    vocab = Vocabulary(_hand_tokenizer(HAND))
    ids = {t: i for i, t in enumerate(HAND)}

    digits = resolve_token_set("digits", vocab, host=gap_host)
    assert digits.ids == [ids["5"], ids["Ġ5"], ids["▁7"]]  # every variant kept; "Ġ55" is not a digit
    assert digits.tokens == ["5", "Ġ5", "▁7"]
    assert digits.missing == ["0", "1", "2", "3", "4", "6", "8", "9"]

    kw = resolve_token_set("python_keywords", vocab, host=gap_host)
    assert kw.ids == [ids["for"], ids["Ġfor"], ids["import"]]
    assert kw.missing == [k for k in keyword.kwlist if k not in ("for", "import")]

    general = resolve_token_set("general", vocab, host=gap_host, exclude=kw.ids, seed=0, size=1000)
    assert general.ids == [ids[" apple"], ids["banana"], ids["▁cherry"]]  # alphabetic, >= 3, keywords excluded
    assert general.config["n_candidates"] == 3 and general.config["seed"] == 0
    two = resolve_token_set("general", vocab, host=gap_host, exclude=kw.ids, seed=0, size=2)
    assert len(two) == 2 and set(two.ids) < set(general.ids)
    assert two.ids == resolve_token_set("general", vocab, host=gap_host, exclude=kw.ids, seed=0, size=2).ids

    words = resolve_token_set("words:apple, 5,zebra,for,apple", vocab, host=gap_host)
    assert words.ids == [ids["5"], ids["Ġ5"], ids["for"], ids["Ġfor"], ids[" apple"]]
    assert words.missing == ["zebra"]


def test_token_sets_on_the_tiny_bpe_tokenizer(gap_host, models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["gpt2"])
    stripped = {i: tok.decode([i]).strip().lstrip("Ġ▁").strip() for i in tok.get_vocab().values()}
    vocab = Vocabulary(tok)

    digits = resolve_token_set("digits", vocab, host=gap_host)
    assert digits.ids == sorted(i for i, t in stripped.items() if t in set("0123456789"))
    assert set(digits.missing) == set("0123456789") - set(stripped.values())

    kw = resolve_token_set("python_keywords", vocab, host=gap_host)
    assert kw.ids == sorted(i for i, t in stripped.items() if t in keyword.kwlist)
    present = {stripped[i] for i in kw.ids}
    assert kw.missing == [k for k in keyword.kwlist if k not in present]
    assert {"def", "class", "lambda"} <= set(kw.missing)  # this 384-entry BPE vocabulary lacks them
    assert {"in", "for", "and"} <= present and len(kw) > len(present)  # "in" and "Ġin" both kept

    general = resolve_token_set("general", vocab, host=gap_host, exclude=kw.ids)
    assert general.ids and all(stripped[i].isalpha() and len(stripped[i]) >= 3 for i in general.ids)
    assert not set(general.ids) & set(kw.ids)


def test_word_file_and_bad_specs(gap_host, tmp_path):
    vocab = Vocabulary(_hand_tokenizer(HAND))
    words = tmp_path / "fruit.txt"
    words.write_text("banana\n\ncherry\ndurian\n", encoding="utf-8")
    ts = resolve_token_set(str(words), vocab, host=gap_host)
    assert ts.tokens == ["banana", "▁cherry"] and ts.missing == ["durian"] and ts.config["kind"] == "file"

    with pytest.raises(RepgeomError, match=r"unknown token set 'digts'; did you mean 'digits'"):
        resolve_token_set("digts", vocab, host=gap_host)
    with pytest.raises(RepgeomError, match="lists no words"):
        resolve_token_set("words: , ,", vocab, host=gap_host)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(RepgeomError, match="has no words"):
        resolve_token_set(str(empty), vocab, host=gap_host)
    with pytest.raises(RepgeomError, match="does not exist"):
        resolve_token_set(str(tmp_path / "nope.txt"), vocab, host=gap_host)


def test_vocabulary_difference_names_the_first_differing_token():
    a, b = _hand_tokenizer(["<unk>", "a", "b"]), _hand_tokenizer(["<unk>", "a", "c"])
    assert vocabulary_difference(a, a) is None
    assert vocabulary_difference(a, b) == "token id 2 is 'b' vs 'c'"
    assert vocabulary_difference(a, _hand_tokenizer(["<unk>", "a"])) == "3 vs 2 entries"


# -- reading W alone ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, tensor, tied", [
    ("gpt2", "transformer.wte.weight", True),
    ("llama_untied", "lm_head.weight", False),
    ("neox", "embed_out.weight", False),  # legacy key, renamed to lm_head by transformers on load
])
def test_partial_read_equals_the_loaded_model(models, name, tensor, tied):
    from transformers import AutoModelForCausalLM

    W, info = read_output_embeddings(models[name])
    expected = AutoModelForCausalLM.from_pretrained(models[name]).get_output_embeddings().weight
    assert torch.equal(W, expected)
    assert info.tensor == tensor and info.tied is tied and info.source == "safetensors"
    assert info.shape == tuple(expected.shape)
    if name == "llama_untied":
        model = AutoModelForCausalLM.from_pretrained(models[name])
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
        assert info.file != "model.safetensors"  # one shard of the index


def test_reading_rows_only(models):
    for name in ("gpt2", "llama_untied"):
        W, _ = read_output_embeddings(models[name])
        source = open_output_embeddings(models[name])
        ids = [7, 3, 4, 5, 399, 3, 0]  # unsorted, a repeat, both ends
        assert torch.equal(source.rows(ids), W[ids])
        assert source.shape == tuple(W.shape)
        with pytest.raises(RepgeomError, match=r"token id 400 is out of range .*\(400 rows\)"):
            source.rows([1, 400])


def test_gap_never_loads_the_model(models, gap_host, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the full model was loaded")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel, transformers.PreTrainedModel):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    result = screen([models["gpt2"], models["llama_untied"]], domain="digits")
    assert [r["n_T"] for r in result.rows] == [10, 10]


def test_read_errors(tmp_path, models):
    with pytest.raises(RepgeomError, match="does not exist"):
        read_output_embeddings(str(tmp_path / "missing-model"))
    bin_only = tmp_path / "bin-only"
    bin_only.mkdir()
    shutil.copy(f"{models['gpt2']}/config.json", bin_only / "config.json")
    torch.save({}, bin_only / "pytorch_model.bin")
    with pytest.raises(RepgeomError, match=r"no \.safetensors weights \(only pytorch_model\.bin\).*convert"):
        read_output_embeddings(str(bin_only))


# -- screening ---------------------------------------------------------------------------------------------------

def test_screen_ranks_and_records_everything(models, gap_host):
    three = [models["gpt2"], models["llama_untied"], models["neox"]]
    result = screen(three, domain="python_keywords", reference="general", size=10, seed=3)
    rows = result.rows
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["G"] for r in rows] == sorted((r["G"] for r in rows), reverse=True)
    for r in rows:
        W, _ = read_output_embeddings(r["model"])
        direct = dispersion_gap(W, r["T"]["ids"], r["Tbar"]["ids"])
        assert r["G"] == pytest.approx(direct["G"], abs=1e-12)
        assert r["n_Tbar"] == 10 and "def" in r["missing_T"] and r["vocab_size"] == 384
        assert set(r["timings"]) >= {"open_s", "read_rows_s", "tokenizer_s", "total_s", "peak_rss_mib"}
        assert r["n_rows_read"] == len(set(r["T"]["ids"]) | set(r["Tbar"]["ids"]))
    assert rows[0]["Tbar"]["ids"] == rows[1]["Tbar"]["ids"]  # one vocabulary, one seed: the same T̄
    cfg = result.config
    assert (cfg["domain"], cfg["reference"], cfg["size"], cfg["seed"], cfg["distance"]) == (
        "python_keywords", "general", 10, 3, "cosine")
    assert cfg["sign"] == "G = within(T) + between(T, T̄)" and result.vocabulary["shared"] is True
    euclid = screen(three[:2], size=10, distance="euclidean")
    assert euclid.config["distance"] == "euclidean" and all(r["G"] > 0 for r in euclid.rows)


def test_screen_refuses_different_vocabularies_unless_forced(models, gap_host):
    pair = [models["gpt2"], models["other_vocab"]]
    with pytest.raises(RepgeomError, match=r"different vocabularies \(384 vs 300 entries\).*--force"):
        screen(pair)
    with pytest.warns(UserWarning, match="different vocabularies"):
        result = screen(pair, force=True)
    assert result.vocabulary["shared"] is False and result.vocabulary["forced"] is True
    assert {r["vocab_size"] for r in result.rows} == {384, 300}


# -- the command -------------------------------------------------------------------------------------------------

def run_gap(*argv):
    parser = argparse.ArgumentParser(prog="repgeom gap")
    gap_cmd.configure(parser)
    return gap_cmd.run(parser.parse_args([str(a) for a in argv]))


def test_command_end_to_end(models, gap_host, tmp_path, capsys):
    three = [models["gpt2"], models["llama_untied"], models["neox"]]
    out = tmp_path / "gap.json"
    preview = screen(three)  # the ranking the command must reproduce
    acc = {r["model"]: 0.9 - 0.1 * r["rank"] for r in preview.rows}  # accuracy in the order of G
    scores = tmp_path / "acc.csv"
    scores.write_text("model,accuracy\n" + "".join(f"{m.rstrip('/').split('/')[-1]},{a}\n" for m, a in acc.items()))
    assert run_gap("--models", *three, "--output", out, "--scores", scores) == 0
    printed = capsys.readouterr().out
    assert "Spearman ρ(G, accuracy) = 1.0000 over 3 models" in printed and "within(T)" in printed
    data = json.loads(out.read_text())
    assert set(data) == {"config", "vocabulary", "results", "timings", "spearman"}
    assert [r["model"] for r in data["results"]] == [r["model"] for r in preview.rows]
    assert data["spearman"]["rho"] == pytest.approx(1.0)
    cfg = data["config"]
    assert {k: cfg[k] for k in ("domain", "reference", "distance", "size", "seed", "force")} == {
        "domain": "digits", "reference": "general", "distance": "cosine", "size": 1000, "seed": 0, "force": False}
    assert cfg["scores"] == str(scores) and cfg["token_sets"]["reference"]["n_candidates"] >= 1
    assert all(r["missing_T"] == [] and r["accuracy"] == acc[r["model"]] for r in data["results"])

    scores.write_text(json.dumps({m: -a for m, a in acc.items()}))  # a JSON object, reversed order
    assert run_gap("--models", *three, "--scores", scores, "--json") == 0
    assert json.loads(capsys.readouterr().out)["spearman"]["rho"] == pytest.approx(-1.0)


def test_command_scores_of_two_models_give_nan(models, gap_host, tmp_path, capsys):
    """Two points correlate ±1 whatever the data, so ρ needs 3 models (before the shared statistics module: ±1)."""
    two = [models["gpt2"], models["neox"]]
    scores = tmp_path / "acc.json"
    scores.write_text(json.dumps(dict(zip(two, (0.3, 0.6)))))
    assert run_gap("--models", *two, "--scores", scores, "--json") == 0
    assert json.loads(capsys.readouterr().out)["spearman"] | {"scores_file": None} == {
        "rho": None, "n": 2, "between": "G and accuracy", "ties": "average ranks", "scores_file": None}  # NaN → null
    assert run_gap("--models", *two, "--scores", scores) == 0
    assert "Spearman ρ(G, accuracy) = nan over 2 models" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--models", "/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
    (["--domain", "digts"], "did you mean 'digits'"),
    (["--domain", "words:,"], "lists no words"),
    (["--reference", "words:qqqq,zzzz"], "matches no token"),
    (["--output", "/nonexistent-dir/out.json"], "output directory '/nonexistent-dir' does not exist"),
    (["--scores", "/nonexistent/acc.csv"], "scores file '/nonexistent/acc.csv' does not exist"),
])
def test_command_bad_input(args, message, models, gap_host, tmp_path):
    base = {"--models": [models["gpt2"], models["neox"]], "--output": [str(tmp_path / "out.json")]}
    base.update({args[0]: args[1:]})
    argv = [x for k, v in base.items() for x in [k, *v]]
    with pytest.raises(RepgeomError, match=message) as info:
        run_gap(*argv)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out.json").exists()


def test_command_refuses_different_vocabularies_and_scores_without_a_model(models, gap_host, tmp_path, capsys):
    with pytest.raises(RepgeomError, match="different vocabularies"):
        run_gap("--models", models["gpt2"], models["other_vocab"])
    with pytest.warns(UserWarning):
        assert run_gap("--models", models["gpt2"], models["other_vocab"], "--force") == 0
    assert "vocabularies differ" in capsys.readouterr().out
    scores = tmp_path / "acc.tsv"
    scores.write_text("gpt2\t0.5\n")
    with pytest.raises(RepgeomError, match=r"no accuracy for model .*neox.*add a line neox,ACCURACY"):
        run_gap("--models", models["gpt2"], models["neox"], "--scores", scores)


def test_through_the_repgeom_cli(models, gap_host, tmp_path, capsys):
    from repgeom_eval.entrypoints.cli import main

    out = tmp_path / "out.json"
    assert main(["gap", "--models", models["gpt2"], models["neox"], "--domain", "python_keywords",
                 "--distance", "euclidean", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["distance"] == "euclidean"
    assert "not in the vocabulary: False, None, True" in capsys.readouterr().out
    assert main(["gap", "--models", models["gpt2"], "--domain", "python_keywrods"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("repgeom: error: unknown token set 'python_keywrods'; did you mean 'python_keywords'")
    assert err.count("\n") == 1


def test_scores_files(tmp_path):
    f = tmp_path / "s.tsv"
    f.write_text("model\taccuracy\nA\t0.5\n\nB\t0.25\n")
    assert gap_cmd.read_scores(str(f)) == {"A": 0.5, "B": 0.25}
    f.write_text("A,0.5\nB,0.25,extra\n")
    assert gap_cmd.read_scores(str(f)) == {"A": 0.5, "B": 0.25}
    for content, message in [("A,0.5\nB,high\n", r"s\.tsv'?:2: accuracy must be a number, got 'high'"),
                             ("A,0.5\nA,0.6\n", "listed twice"),
                             ("[1, 2]", "expected a JSON object"),
                             ('{"A": true}', "must be a number"),
                             ("", "is empty")]:
        f.write_text(content)
        with pytest.raises(RepgeomError, match=message):
            gap_cmd.read_scores(str(f))
    assert gap_cmd.match_scores(["/x/y/modelA/", "modelB"], {"modelA": 1.0, "./modelB": 2.0}, "f") == {
        "/x/y/modelA/": 1.0, "modelB": 2.0}


# -- the real checkpoint (GGUF) ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_gguf_output_embedding_of_smollm2():
    from repgeom_eval.testing.demo import smollm2_path

    try:
        path = smollm2_path()
    except RepgeomError as exc:
        pytest.skip(str(exc))
    import gguf  # noqa: F401
    source = open_output_embeddings(str(path))  # parsing the GGUF header takes seconds: open it once
    W, info = source.full(), source.info
    assert tuple(W.shape) == (49152, 576) and W.dtype == torch.float32 and torch.isfinite(W).all()
    assert info.source == "gguf" and info.tensor == "token_embd.weight" and info.tied is True
    ids = [41, 32, 33, 34, 1000, 49151, 33]
    assert torch.equal(source.rows(ids), W[ids])  # rows de-quantized alone
    # digits 0-9 are ids 32-41 in SmolLM2's vocabulary; the gap of the real matrix is a finite, positive number
    values = dispersion_gap(W, list(range(32, 42)), list(range(1000, 2000)))
    assert 0 < values["within_T"] < 1 < values["G"] < 3
