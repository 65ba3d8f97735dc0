"""Value tests: the augmented views of the multi-view metrics (infonce, lidar, dime) against nlpaug called directly.

The recipe, as repgeom documents it (repgeom_eval/measurement/augment.py and its ``config()``): nlpaug's
``Sequential([SplitAug, RandomCharAug, KeyboardAug])`` with p = 0.3, one string in, one string out; view v of text i
is drawn with the global ``random`` and ``numpy.random`` generators seeded from (seed, i, v) through
``numpy.random.SeedSequence([seed, i, v]).generate_state(1)[0]``, and a text for which nlpaug returns nothing
is its own view.

nlpaug 1.1.11 draws every random number from those two *global* generators (``random.sample``,
``np.random.random``, ``np.random.randint``), so exact equality is possible: the reference seeds both generators the
same way, then calls nlpaug. It builds the chain with every probability spelled out (``aug_p``, ``aug_char_p``,
``aug_word_p`` = 0.3) rather than relying on nlpaug's defaults, so a change of nlpaug's defaults, of the chain, or
of the seeding shows up as different strings.
"""

import random

import numpy as np
import pytest

import repgeom_eval
import values_reference as ref

import nlpaug.augmenter.char as nac  # noqa: E402 (dev extra: missing must fail, not skip)
import nlpaug.augmenter.word as naw  # noqa: E402
import nlpaug.flow as naf  # noqa: E402


def direct_flow():
    return naf.Sequential([naw.SplitAug(aug_p=0.3),
                           nac.RandomCharAug(aug_char_p=0.3, aug_word_p=0.3),
                           nac.KeyboardAug(aug_char_p=0.3, aug_word_p=0.3)])


def direct_view(flow, text: str, seed: int, index: int, view: int) -> str:
    s = int(np.random.SeedSequence([seed, index, view]).generate_state(1)[0])
    random.seed(s)
    np.random.seed(s)
    out = flow.augment(text, n=1)
    out = out[0] if isinstance(out, list) and out else out
    return out if isinstance(out, str) and out.strip() else text


@pytest.fixture(scope="module")
def augmenter_cls():
    from repgeom_eval.measurement.augment import Augmenter  # the module the pipeline uses for its views

    return Augmenter


@pytest.mark.parametrize("seed", [0, 7, 123456789])
def test_views_equal_nlpaug_called_directly(seed, augmenter_cls):
    texts = ref.corpus(0, 30) + ref.corpus(50, 10, skip_words=20, max_words=40)
    aug, flow = augmenter_cls(seed=seed), direct_flow()
    changed = 0
    for i, text in enumerate(texts):
        for v in range(3):
            got = aug.view(text, index=i, view=v)
            assert got == direct_view(flow, text, seed, i, v), (i, v, text)
            changed += got != text
    assert changed >= 0.9 * 3 * len(texts)  # the chain really changes the texts (p = 0.3 on every word)
    assert aug.config() == {"recipe": "char_chain", "seed": seed, "chain": "SplitAug>RandomCharAug>KeyboardAug",
                            "p": 0.3}


def test_views_do_not_depend_on_call_order_nor_touch_the_global_generators(augmenter_cls):
    texts = ref.corpus(3, 12)
    aug = augmenter_cls(seed=5)
    random.seed(99)
    np.random.seed(99)
    before = random.random(), np.random.random()
    random.seed(99)
    np.random.seed(99)
    forward = {(i, v): aug.view(t, i, v) for i, t in enumerate(texts) for v in range(2)}
    assert (random.random(), np.random.random()) == before  # the caller's random streams are restored
    backward = {(i, v): aug.view(texts[i], i, v) for i, v in reversed(list(forward))}
    assert backward == forward
    assert all(forward[i, 0] != forward[i, 1] for i in range(len(texts)))  # two views of a text differ


def test_texts_nlpaug_cannot_augment_are_their_own_view(augmenter_cls):
    """Words under 4 characters are never touched (nlpaug returns them as they are); whitespace comes back as
    ``['']`` and the empty string as ``[]``: both are their own view, as documented."""
    aug, flow = augmenter_cls(seed=1), direct_flow()
    for i, text in enumerate(["a", "ok", "x y", "!!", "  ", ""]):
        got = aug.view(text, i, 0)
        assert got == direct_view(flow, text, 1, i, 0)
        assert got == text


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_infonce_through_measure_equals_numpy_on_directly_augmented_views(kind, tiny_model_dir):
    """End to end: ``measure(..., metrics=["infonce"])`` equals InfoNCE computed in numpy from the hidden states
    (transformers, float64) of the views made by nlpaug directly: mean-pooled, unit-normalised, logits = a·bᵀ/τ
    with τ = 0.1, loss = mean_i (logsumexp_j logits_ij − logits_ii), bound = 1 − loss / log N."""
    model_dir = tiny_model_dir(kind)
    texts = ref.corpus(20, 16, skip_words=2)
    seed = 31
    result = repgeom_eval.measure(model_dir, texts, layers=["embed", "resid_post:0", "final"], metrics=["infonce"],
                                  seed=seed, dtype="float64", batch_size=6, progress=False)
    flow = direct_flow()
    views = [[direct_view(flow, t, seed, i, v) for v in range(2)] for i, t in enumerate(texts)]
    states_a = ref.hidden_states(model_dir, [v[0] for v in views])
    states_b = ref.hidden_states(model_dir, [v[1] for v in views])
    n = len(texts)
    for addr, k in {"embed": 0, "resid_post:0": 1, "final": -1}.items():
        a = ref.units(ref.pooled(states_a, k, "mean"))
        b = ref.units(ref.pooled(states_b, k, "mean"))
        logits = a @ b.T / 0.1
        top = logits.max(1, keepdims=True)
        lse = (top + np.log(np.exp(logits - top).sum(1, keepdims=True)))[:, 0]
        loss = float(np.mean(lse - np.diag(logits)))
        got = result.results[addr]["infonce"]
        assert got["raw"] == pytest.approx(loss, abs=1e-9), addr
        assert got["mi_lower_bound"] == pytest.approx(1 - loss / np.log(n), abs=1e-9), addr
    # the measured views are the augmented strings, not the originals: InfoNCE of the originals is far off
    plain = ref.hidden_states(model_dir, texts)
    u = ref.units(ref.pooled(plain, -1, "mean"))
    logits = u @ u.T / 0.1
    lse = np.log(np.exp(logits).sum(1))
    assert abs(float(np.mean(lse - np.diag(logits))) - result.results["final"]["infonce"]["raw"]) > 1e-3
