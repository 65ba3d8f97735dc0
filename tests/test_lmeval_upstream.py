"""The repgeom tasks send the model exactly the requests lm-eval's own tasks send (same prompts, choices, targets,
few-shot examples), read here from the installed lm-eval's YAML files and run on the same local documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lm_eval  # noqa: E402,F401  (dev extra: missing must fail, not skip)

import lm_eval  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from repgeom_eval.lmeval.documents import load_local  # noqa: E402
from repgeom_eval.testing import task_records, write_task_data  # noqa: E402

UPSTREAM = Path(lm_eval.__file__).parent / "tasks"


def requests_of(task, num_fewshot=0):
    task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(rank=0, world_size=1)
    out = {}
    for inst in task.instances:
        out.setdefault(inst.doc_id, []).append((inst.idx, inst.request_type, inst.arguments))
    return {doc_id: sorted(reqs) for doc_id, reqs in out.items()}


def ours(name, data, **metadata):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data), **metadata})
    return tm.load([name])["tasks"][name]


def upstream(yaml_path, dataset):
    config = load_yaml(yaml_path, resolve_func=True)
    config["custom_dataset"] = lambda **kwargs: dataset
    return ConfigurableTask(config=config)


@pytest.mark.parametrize("name,schema,yaml", [
    ("repgeom_hardness_arc_challenge", "arc_challenge", "arc/arc_challenge.yaml"),
    ("repgeom_hardness_arc_easy", "arc_easy", "arc/arc_easy.yaml"),
    ("repgeom_hardness_hellaswag", "hellaswag", "hellaswag/hellaswag.yaml"),
    ("repgeom_hardness_piqa", "piqa", "piqa/piqa.yaml"),
    ("repgeom_ppl_wikitext", "wikitext", "wikitext/wikitext.yaml"),
])
def test_same_requests_as_upstream(tmp_path, name, schema, yaml):
    data = write_task_data(schema, tmp_path / f"{schema}.jsonl", n=12, seed=3)
    mine = requests_of(ours(name, data))
    theirs = requests_of(upstream(UPSTREAM / yaml, load_local(data, schema)))
    assert mine == theirs
    assert len(mine) == 12


# Every subject task of the installed lm-eval (57 in lm-eval 0.4.13), read from its own folder.
MMLU_SUBJECTS = sorted(p.stem.removeprefix("mmlu_") for p in (UPSTREAM / "mmlu" / "default").glob("mmlu_*.yaml"))


def mmlu_records(n_per_subject: int, seed: int) -> list[dict]:
    """``n_per_subject`` records of every subject, subjects interleaved in a shuffled order."""
    import random

    records = task_records("mmlu", n_per_subject * len(MMLU_SUBJECTS), seed=seed, words=(2, 6))
    subjects = [s for s in MMLU_SUBJECTS for _ in range(n_per_subject)]
    random.Random(seed).shuffle(subjects)
    return [{**record, "subject": subject} for record, subject in zip(records, subjects)]


def test_every_upstream_mmlu_subject_is_covered():
    assert len(MMLU_SUBJECTS) == 57


@pytest.mark.parametrize("shots", [0, 2])
def test_mmlu_one_task_equals_the_57_subject_tasks(tmp_path, shots):
    """All 57 subjects in one task, each document with its subject's description and its subject's first dev
    examples, exactly as lm-eval's per-subject mmlu_<subject> tasks build them (requests only: no model)."""
    import datasets

    folder = tmp_path / "mmlu"
    folder.mkdir()
    split_records = {"test": mmlu_records(2, seed=4), "dev": mmlu_records(2, seed=5)}
    for name, records in split_records.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    mine = requests_of(ours("repgeom_hardness_mmlu", folder), shots)
    expected = {}
    for subject in MMLU_SUBJECTS:
        split = {name: datasets.Dataset.from_list([r for r in records if r["subject"] == subject])
                 for name, records in split_records.items()}
        task = upstream(UPSTREAM / "mmlu" / "default" / f"mmlu_{subject}.yaml", datasets.DatasetDict(split))
        per_subject = requests_of(task, shots)
        ids = [i for i, d in enumerate(split_records["test"]) if d["subject"] == subject]
        assert len(per_subject) == len(ids) == 2
        expected.update({ids[k]: reqs for k, reqs in per_subject.items()})
    assert len(expected) == 2 * 57
    assert mine == expected
    if shots:
        assert "Answer:" in mine[0][0][2][0].split("\n\n")[1]  # a few-shot example precedes the question


def test_mmlu_few_shot_without_a_dev_split_is_a_clear_error(tmp_path):
    from repgeom_eval.spec.errors import RepgeomError

    data = write_task_data("mmlu", tmp_path / "mmlu.jsonl", n=6)
    with pytest.raises(RepgeomError, match="dev split"):
        requests_of(ours("repgeom_hardness_mmlu", data), 2)
