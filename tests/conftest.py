import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "repgeom-example-metric"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Converted GGUF models are cached outside the user's ~/.cache, shared by the test processes of a run.
# The load check's disk cache is tested on its own (tests/test_layout_cache.py); elsewhere every load probes, so that
# a test's deliberately broken model is never served a layout found on another one.
os.environ.setdefault("REPGEOM_LAYOUT_CACHE", "0")
os.environ.setdefault("REPGEOM_CACHE", str(Path(tempfile.gettempdir()) / f"repgeom-test-cache-{os.getuid()}"))


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
def realistic(tmp_path_factory):
    """Factory: ``realistic("t5")`` → a saved tiny model of that type with realistic norm gains and one massive
    dimension (``repgeom_eval.testing.tiny_models.make_realistic``), built once per session; encoder types (t5, bert,
    roberta-prelayernorm) as encoders, the others as causal LMs."""
    from repgeom_eval.testing.tiny_models import save_tiny

    made: dict[str, str] = {}

    def get(model_type: str) -> str:
        if model_type not in made:
            kind = "encoder" if model_type in ("t5", "bert", "roberta-prelayernorm") else "causal"
            made[model_type] = str(save_tiny(model_type, tmp_path_factory.mktemp(model_type), kind, realistic=True))
        return made[model_type]

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
    from repgeom_eval.plugin_system.host import get_host

    return get_host()


@pytest.fixture(scope="session")
def example_plugin_site(tmp_path_factory) -> Path:
    """examples/repgeom-example-metric really installed (metadata and entry point included) into a --target dir,
    once per session; put it on PYTHONPATH / sys.path to use it."""
    base = tmp_path_factory.getbasetemp()
    site, source = base / "example-plugin-site", base / "example-plugin-src"
    if (site / ".installed").exists():
        return site
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(site, ignore_errors=True)
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    shutil.copytree(EXAMPLE_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    if importlib.util.find_spec("setuptools") is not None:
        cmd += ["--no-build-isolation", "--no-index"]  # offline: build with the environment's setuptools
    proc = subprocess.run([*cmd, "--target", str(site), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip could not install the example plugin:\n{proc.stdout}\n{proc.stderr}"
    (site / ".installed").touch()
    return site


# -- the fault-injection count (tests marked @pytest.mark.fault(category); docs/reference/outputs.md) -

FAULT_CATEGORIES = ("clean", "refused", "exact")


@pytest.fixture(autouse=True)
def _fault_category(request):
    marker = request.node.get_closest_marker("fault")
    if marker is not None:
        category = marker.args[0]
        assert category in FAULT_CATEGORIES, f"unknown fault category {category!r} (valid: {FAULT_CATEGORIES})"
        request.node.user_properties.append(("fault", category))


def fault_counts(reports) -> dict[str, dict[str, int]]:
    """{category: {"passed": cases, "failed": cases}} over the call-phase reports of marked tests; a test that checks
    several cases in a loop says how many with the user property ``fault_cases``."""
    out: dict[str, dict[str, int]] = {c: {"passed": 0, "failed": 0} for c in FAULT_CATEGORIES}
    for rep in reports:
        props = dict(rep.user_properties)
        if rep.when == "call" and "fault" in props:
            out[props["fault"]]["passed" if rep.passed else "failed"] += int(props.get("fault_cases", 1))
    return out


def pytest_terminal_summary(terminalreporter):
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])]
    counts = fault_counts(reports)
    total = sum(c["passed"] + c["failed"] for c in counts.values())
    if total:
        parts = " · ".join(f"{cat} {c['passed']}" + (f" ({c['failed']} FAILED)" if c["failed"] else "")
                           for cat, c in counts.items())
        terminalreporter.write_line(f"fault-injection cases: {total} — {parts}")
