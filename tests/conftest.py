import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: ``tiny_model_dir("llama")`` → directory of a saved 2-block model (built once per session)."""
    from repgeom_eval.testing import make_tiny_model

    cache = {}

    def get(kind: str, n_layers: int = 2):
        key = (kind, n_layers)
        if key not in cache:
            cache[key] = make_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}-{n_layers}"), n_layers=n_layers)
        return str(cache[key])

    return get


@pytest.fixture(scope="session")
def texts():
    """Real English sentences of varied length, read at test time from Python's own documentation."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics)[:40]:
        words = topics[key].split()
        out.append(" ".join(words[: 4 + (len(out) * 7) % 20]))
    return out


@pytest.fixture
def host():
    from repgeom_eval.plugin_host import get_host

    return get_host()
