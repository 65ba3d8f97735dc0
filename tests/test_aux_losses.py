"""Aux-loss plugins: registered by name, oracles #6, #22-#25 of docs/metrics.md#oracle-values through the plugin
objects, gradcheck in float64, the O(N·d) push-away against the pairwise form, sampling, layer sets and config
errors."""

import math
import sys

import pytest
import torch

from repgeom_eval.modeling.addresses import Address
from repgeom_eval.training.auxloss import AuxLoss, build_aux_loss
from repgeom_eval.spec.errors import RepgeomError, UnknownNameError
from repgeom_eval.functional.losses import push_away_pairwise, subsample_tokens

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

H6 = T([[(1, 0), (0, 1)], [(1, 1), (-1, 0)]])  # oracle #6: B = 2, T = 2, d = 2
Z22 = T([[(1, 0), (0, 1), (-1, 0)]])
Z_COLLAPSED = T([[(1, 0), (1, 0), (1, 0)]])
Z_PAIR = T([[(1, 0), (1, 0.1)]])
Z24 = T([[(1, 0, 0), (0, 1, 0), (1, 1, 0)]])
NAMES = ["push_away", "squeeze", "angular_spread", "decorrelation", "l2_repel", "orthogonalization"]


def make(name, **params):
    return build_aux_loss({"name": name, "weight": 0.1, **params})


def value(loss, h, mask=None, domains=None):
    return loss(h, mask, domains).item()


def test_every_loss_is_registered_by_the_builtin_plugin(host):
    assert set(NAMES) <= set(host.aux_losses.names())
    for name in NAMES:
        entry = host.aux_losses.entry(name)
        assert entry.plugin == "aux_losses" and entry.distribution == "repgeom-eval"
        assert entry.description  # shown by `repgeom plugins`
        assert isinstance(make(name), AuxLoss) and make(name).name == name
    rows = [r for r in host.listing() if r["kind"] == "aux_loss"]
    assert {r["name"] for r in rows} >= set(NAMES)


# -- oracles through the plugin objects -----------------------------------------------------------------------------

def test_push_away_and_squeeze_oracle_6():
    assert value(make("push_away"), H6) == pytest.approx(-1.048816, abs=1e-6)
    assert value(make("squeeze"), H6) == pytest.approx(1.048816, abs=1e-6)
    cross = make("push_away", cross_domain=True)
    assert value(cross, H6, domains=["a", "b"]) == pytest.approx(-0.896447, abs=1e-6)
    assert value(make("squeeze", cross_domain=True), H6, domains=torch.tensor([3, 7])) == pytest.approx(0.896447,
                                                                                                     abs=1e-6)
    # the dict form the trainer passes gives the same
    assert make("push_away")({Address("final"): H6}).item() == pytest.approx(-1.048816, abs=1e-6)


def test_push_away_sequence_granularity():
    # last token of each sequence: (0,1) and (-1,0), orthogonal -> d = 1
    assert value(make("push_away", granularity="sequence"), H6) == pytest.approx(-1.0, abs=1e-12)
    # means (0.5,0.5) and (0,0.5): cosine 1/sqrt(2)
    mean = make("push_away", granularity="sequence", pooling="mean")
    assert value(mean, H6) == pytest.approx(-(1 - 1 / math.sqrt(2)), abs=1e-12)
    # with padding the last *real* token is pooled: row 0 has one real token (1,0)
    mask = torch.tensor([[True, False], [True, True]])
    assert value(make("push_away", granularity="sequence"), H6, mask) == pytest.approx(-2.0, abs=1e-12)  # antipodal
    cross = make("push_away", granularity="sequence", cross_domain=True)
    assert value(cross, H6, mask, ["a", "b"]) == pytest.approx(-2.0, abs=1e-12)


@pytest.mark.parametrize("variant, params, expected", [
    ("paper", {}, -0.640592),
    ("reference", {"clamp": 0.0}, -0.615502),
    ("reference", {"clamp": 0.1}, -0.595298),
    ("reference", {}, -0.572143),  # t = 0.25
    ("paper", {"clamp": 0.1}, -0.605298),
    ("paper", {"clamp": 0.25}, -0.582143),
])
def test_angular_spread_oracle_22(variant, params, expected):
    assert value(make("angular_spread", variant=variant, **params), Z22) == pytest.approx(expected, abs=1e-6)


def test_angular_spread_batch_and_collapsed_oracles():
    loss = make("angular_spread", variant="reference", clamp=0.1)
    assert value(loss, Z_COLLAPSED) == pytest.approx(-0.133566, abs=1e-6)
    assert value(loss, torch.cat([Z22, Z_COLLAPSED])) == pytest.approx(-0.364432, abs=1e-6)


@pytest.mark.parametrize("variant, params, expected", [
    ("paper", {}, 0.219281),
    ("reference", {"clamp": 0.0}, 0.184353),
    ("reference", {"clamp": 0.1}, 0.127045),
    ("reference", {}, 0.072871),
])
def test_orthogonalization_oracle_23(variant, params, expected):
    assert value(make("orthogonalization", variant=variant, **params), Z_PAIR) == pytest.approx(expected, abs=1e-6)
    assert value(make("orthogonalization", variant=variant, **params), Z22) == pytest.approx(0.0, abs=1e-12)


def test_decorrelation_oracle_24_and_l2_repel_oracle_25():
    assert value(make("decorrelation"), Z24) == pytest.approx(0.25, abs=1e-12)
    assert value(make("l2_repel", variant="reference"), Z22) == pytest.approx(-0.862428, abs=1e-6)
    # the paper variant drops the additive ε = 0.01 inside the logsumexp
    assert value(make("l2_repel"), Z22) == pytest.approx(-0.862428 - 0.01, abs=1e-6)


def test_several_layers_average_and_padding_is_excluded():
    loss = make("angular_spread")
    a, b = Z22, T([[(1, 0), (1, 1), (0, 1)]])
    both = loss({Address("resid_post", 0): a, Address("final"): b}).item()
    assert both == pytest.approx((value(loss, a) + value(loss, b)) / 2, abs=1e-12)
    # a padded batch: each sequence on its own real tokens; garbage at pad positions must not leak in
    padded = torch.zeros(2, 3, 2, dtype=torch.float64)
    padded[0] = Z22[0]
    padded[1, :2] = Z_PAIR[0]
    padded[1, 2] = 1e3
    mask = torch.tensor([[True, True, True], [True, True, False]])
    for name in ("angular_spread", "orthogonalization", "decorrelation", "l2_repel"):
        loss = make(name)
        if name == "decorrelation":  # needs F >= 3 to be informative
            continue
        expected = (value(loss, Z22) + value(loss, Z_PAIR)) / 2
        assert value(loss, padded, mask) == pytest.approx(expected, abs=1e-12), name
    h, m = _random_batch(3)
    assert value(make("push_away"), h, m) == pytest.approx(-push_away_pairwise(h, m).item(), abs=1e-12)


def test_undefined_batches_give_none_not_nan():
    one_domain = make("push_away", cross_domain=True)
    assert one_domain(H6, None, ["a", "a"]) is None
    mask = torch.tensor([[True, False], [False, False]])
    assert make("push_away")(H6, mask) is None  # a single real token
    assert make("angular_spread")(T([[(1, 0)]])) is None
    assert make("angular_spread")(H6, mask) is None
    with pytest.raises(RepgeomError, match="domain label"):
        one_domain(H6)


# -- O(N·d) against the pairwise form, gradients -------------------------------------------------------------------

def _random_batch(seed, b=6, t=9, d=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return h + 50 * (~mask).unsqueeze(-1), mask


@pytest.mark.parametrize("seed", range(3))
def test_push_away_plugin_equals_the_pairwise_form(seed):
    h, mask = _random_batch(seed)
    domains = ["x", "y", "z", "x", "x", "y"]
    assert value(make("push_away"), h, mask) == pytest.approx(-push_away_pairwise(h, mask).item(), abs=1e-13)
    cross = make("push_away", cross_domain=True)
    assert value(cross, h, mask, domains) == pytest.approx(-push_away_pairwise(h, mask, domains).item(), abs=1e-13)
    assert value(make("squeeze", cross_domain=True), h, mask, domains) == pytest.approx(
        push_away_pairwise(h, mask, domains).item(), abs=1e-13)


def test_push_away_plugin_on_64x512_tokens_allocates_no_pairwise_matrix():
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    b, t, d = 64, 512, 32
    n = b * t
    h = torch.randn(b, t, d, generator=g, requires_grad=True)
    mask = torch.ones(b, t, dtype=torch.bool)
    domains = torch.arange(b) % 2
    loss = make("push_away", cross_domain=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (loss(h, mask, domains) + make("push_away")(h, mask)).backward()
    per_op = [max(e.self_cpu_memory_usage, 0) for e in prof.key_averages()]
    assert max(per_op) < n * n * 4 / 50, f"an operator allocated {max(per_op)} bytes for {n} tokens"
    assert torch.isfinite(h.grad).all()


def _gradcheck(loss, *shape, seed=0, mask=None, domains=None):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    return torch.autograd.gradcheck(lambda x: loss(x, mask, domains), (z,))


@pytest.mark.parametrize("params", [{}, {"cross_domain": True}, {"granularity": "sequence"},
                                    {"granularity": "sequence", "pooling": "mean", "cross_domain": True}])
def test_push_away_and_squeeze_gradcheck(params):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    for name in ("push_away", "squeeze"):
        assert _gradcheck(make(name, **params), 3, 4, 3, mask=mask, domains=[0, 1, 0])


@pytest.mark.parametrize("name, params", [
    ("angular_spread", {}), ("angular_spread", {"variant": "reference", "tau": 0.5}),
    ("orthogonalization", {}), ("orthogonalization", {"variant": "reference"}),
    ("decorrelation", {}), ("l2_repel", {}), ("l2_repel", {"variant": "reference", "tau": 2.0}),
])
def test_dispersion_family_gradcheck(name, params):
    # These random tokens are far from parallel/antipodal (checked below), so the reference clamp (|cos| < 0.75)
    # is inactive and its straight-through gradient is the true one: the check is exact for both variants.
    loss = make(name, **params)
    g = torch.Generator().manual_seed(8)
    z = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    u = torch.nn.functional.normalize(z, dim=-1)
    cos = u @ u.transpose(-1, -2)
    assert cos.masked_fill(torch.eye(5, dtype=torch.bool), 0).abs().max() < 0.75
    assert torch.autograd.gradcheck(lambda x: loss(x), (z.requires_grad_(),))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda x: loss(x, mask), (z,))


# -- sampling, layers, config ----------------------------------------------------------------------------------------

def test_token_sampling_is_seeded_and_matches_subsample_tokens():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 40, 4, generator=g, dtype=torch.float64)
    a, b = make("angular_spread", max_tokens=8, seed=3), make("angular_spread", max_tokens=8, seed=3)
    first = [value(a, z) for _ in range(3)]
    assert first == [value(b, z) for _ in range(3)]  # same seed, same draws
    assert len(set(first)) == 3  # a fresh subset every call
    ref = torch.Generator().manual_seed(3)
    expected = make("angular_spread", max_tokens=None)(subsample_tokens(z, 8, ref)).item()
    assert first[0] == pytest.approx(expected, abs=1e-12)
    assert value(make("angular_spread", max_tokens=8, seed=4), z) != first[0]
    assert value(make("angular_spread", max_tokens=None), z) == value(make("angular_spread", max_tokens=40), z)


def test_layer_sets_resolve_on_a_model(tiny_model_dir):
    from repgeom_eval.modeling.loading import load_model

    info = load_model(tiny_model_dir("gpt2", n_layers=4)).info
    names = lambda loss: [str(a) for a in loss.addresses(info)]  # noqa: E731
    assert names(make("push_away")) == ["final"]
    assert names(make("angular_spread")) == ["resid_post:0", "resid_post:1", "resid_post:2", "final"]
    assert names(make("decorrelation", layers="all")) == ["embed", "resid_post:0", "resid_post:1", "resid_post:2",
                                                          "final"]
    assert names(make("l2_repel", layers="last")) == ["final"]
    assert names(make("orthogonalization", layers="early_half")) == ["resid_post:0", "resid_post:1"]
    assert names(make("orthogonalization", layers="late_half")) == ["resid_post:2", "final"]
    # every layer request resolves in depth order, as in measure and the analyses
    assert names(make("push_away", layers=["mlp_in:-1", "resid_mid:[0,1]"])) == ["resid_mid:0", "resid_mid:1",
                                                                               "mlp_in:3"]


def test_config_dict_records_every_hyper_parameter():
    loss = make("angular_spread", tau=0.5, variant="reference", max_tokens=64, seed=7, layers="last")
    assert loss.get_config_dict() == {"name": "angular_spread", "tau": 0.5, "variant": "reference", "clamp": None,
                                      "eps": None, "max_tokens": 64, "seed": 7, "weight": 0.1, "layers": "last"}
    assert make("push_away").get_config_dict() == {"name": "push_away", "granularity": "token", "cross_domain": False,
                                                   "pooling": "last", "eps": 1e-12, "weight": 0.1, "layers": "final"}
    assert "weight=0.1" in repr(loss)


@pytest.mark.parametrize("spec, match", [
    ({"name": "push_awy", "weight": 0.1}, "did you mean 'push_away'"),
    ({"weight": 0.1}, "no `name`"),
    ({"name": "push_away"}, r"explicit `weight`.*0\.1 single-domain, 0\.01 cross-domain"),
    ({"name": "angular_spread"}, r"explicit `weight`.*0\.1"),
    ({"name": "push_away", "weight": 0.1, "temperature": 1}, r"no parameter\(s\) \['temperature'\]"),
    ({"name": "push_away", "weight": -0.1}, "squeeze"),
    ({"name": "push_away", "weight": "big"}, "finite number"),
    ({"name": "push_away", "weight": 0.1, "granularity": "word"}, "granularity"),
    ({"name": "push_away", "weight": 0.1, "pooling": "tokens"}, "granularity 'token'"),
    ({"name": "push_away", "weight": 0.1, "pooling": "max"}, "unknown pooling"),
    ({"name": "angular_spread", "weight": 0.1, "variant": "code"}, "variant"),
    ({"name": "angular_spread", "weight": 0.1, "tau": 0}, "tau"),
    ({"name": "angular_spread", "weight": 0.1, "clamp": 1.5}, "clamp"),
    ({"name": "orthogonalization", "weight": 0.1, "margin": 2}, "margin"),
    ({"name": "decorrelation", "weight": 0.1, "max_tokens": 1}, "max_tokens"),
    ({"name": "l2_repel", "weight": 0.1, "norm_weight": -1}, "norm_weight"),
    ("push_away", "expected a mapping"),
])
def test_bad_configs_are_clean_errors(spec, match):
    with pytest.raises(RepgeomError, match=match):
        build_aux_loss(spec)


def test_unknown_loss_lists_the_registered_ones():
    with pytest.raises(UnknownNameError) as err:
        build_aux_loss({"name": "dispersion", "weight": 0.1})
    assert "angular_spread" in str(err.value) and "push_away" in str(err.value)


def test_a_subclass_without_the_loss_is_refused_when_built():
    import types

    import repgeom_eval as rg

    class Unfinished(AuxLoss):
        name = "unfinished"

    @rg.hookimpl
    def repgeom_register_aux_losses(registry):
        registry.add(Unfinished)

    plugin = types.ModuleType("unfinished_plugin")
    plugin.repgeom_register_aux_losses = repgeom_register_aux_losses
    host = rg.PluginHost(extra_plugins=[("unfinished", plugin)])
    with pytest.raises(RepgeomError, match="aux loss 'unfinished' from plugin 'unfinished' does not implement "
                                           "compute_loss_from_hidden; "):
        build_aux_loss({"name": "unfinished", "weight": 0.1}, host)


def test_importing_the_interface_loads_no_plugin_host_and_no_torch():
    """A plugin module imports AuxLoss while the plugin host loads it: the interface must not import the host back
    (an import cycle) nor torch (`repgeom plugins` stays cheap)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; import repgeom_eval.training.auxloss; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torch', 'repgeom_eval')))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=120).stdout)
    assert "repgeom_eval.plugin_system.host" not in loaded and "repgeom_eval.modeling.addresses" not in loaded
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]


def test_the_training_package_names_load_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from repgeom_eval.training import AuxLoss as New, AuxLossTrainer, build_aux_loss as build, pack_blocks, train

    assert New is AuxLoss and build is build_aux_loss and callable(train) and callable(pack_blocks)
    assert AuxLossTrainer.__module__ == "repgeom_eval.training.trainer"
