"""Layer-address grammar and resolution per architecture."""

import pytest

from repgeom_eval.modeling.addresses import Address, available_addresses, hidden_state_address, parse_layers, resolve
from repgeom_eval.spec.errors import RepgeomError, UnknownNameError
from repgeom_eval.modeling.loading import load_model


def names(spec, n=4, host=None):
    sel, known = None, ()
    if host is not None:
        sel = lambda name: host.layer_selectors.get(name) if name in host.layer_selectors else None  # noqa: E731
        known = host.layer_selectors.names()
    return [str(a) for a in parse_layers(spec, n, sel, model_info=type("I", (), {"n_layers": n})(),
                                         selector_names=known)]


def test_grammar():
    assert names("resid_post:3") == ["resid_post:3"]
    assert names("resid_post:-1") == ["resid_post:3"]
    assert names("mlp_in:*") == ["mlp_in:0", "mlp_in:1", "mlp_in:2", "mlp_in:3"]
    assert names("attn_out:[0, -1]") == ["attn_out:0", "attn_out:3"]
    assert names(["resid_mid:[0,1]", "embed,final"]) == ["resid_mid:0", "resid_mid:1", "embed", "final"]
    assert names("resid_post:1,resid_post:-3") == ["resid_post:1"]  # deduplicated canonical forms


def test_bare_integers_are_hidden_state_indices():
    assert names("0") == ["embed"]
    assert names("1") == ["resid_post:0"]
    assert names("3") == ["resid_post:2"]
    assert names("4") == ["final"]  # hidden_states[L] is the final-normed state, not resid_post:3
    assert names("-1") == ["final"]
    assert names("-2") == ["resid_post:2"]
    assert hidden_state_address(-5, 4) == Address("embed")


def test_selectors(host):
    assert names("all", host=host) == ["embed", "resid_post:0", "resid_post:1", "resid_post:2", "final"]
    assert names("blocks", host=host) == [f"resid_post:{i}" for i in range(4)]
    assert names("knn_keys", host=host) == ["resid_mid:3", "resid_post:3", "mlp_in:3"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("resid_pots:1", "did you mean 'resid_post'"),
        ("resid_post:4", "out of range.*4 blocks.*0..3"),
        ("resid_post:-5", "out of range"),
        ("5", "hidden-state index 5 is out of range"),
        ("resid_post", "needs a layer"),
        ("resid_post:x", "not an integer"),
        ("finale", "did you mean 'final'"),
        ("", "no layer address"),
    ],
)
def test_bad_addresses_name_the_valid_choices(spec, message):
    with pytest.raises(RepgeomError, match=message):
        names(spec)


@pytest.mark.parametrize("typo, suggestion", [("blcoks", "blocks"), ("knn_kyes", "knn_keys"), ("al", "all")])
def test_selector_typos_get_a_suggestion(host, typo, suggestion):
    with pytest.raises(UnknownNameError, match=f"did you mean '{suggestion}'"):
        names(typo, host=host)


def test_unknown_site_lists_valid_sites():
    with pytest.raises(UnknownNameError) as info:
        names("resid:1")
    assert "resid_pre" in str(info.value) and "mlp_in" in str(info.value)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "olmo",
                                  "gpt_neox_sequential", "bert", "roberta", "xlm-roberta"])
def test_every_site_resolves(kind, tiny_model_dir):
    loaded = load_model(tiny_model_dir(kind))
    addrs = available_addresses(loaded)
    assert len(addrs) == 2 + 6 * loaded.info.n_layers
    points = resolve(addrs, loaded)
    modules = dict(loaded.model.named_modules())
    assert all(p.module_name in modules for p in points.values())


def test_parallel_residual_has_no_resid_mid(tiny_model_dir):
    loaded = load_model(tiny_model_dir("gpt_neox"))
    with pytest.raises(RepgeomError, match="resid_mid:0 is not available.*parallel residual"):
        resolve([Address("resid_mid", 0)], loaded)
    assert "resid_mid:0" not in [str(a) for a in available_addresses(loaded)]
