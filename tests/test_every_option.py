"""Every declared option of every command, fed a value its own declaration rules out: one error line that names the
option, exit code 2, no traceback, nothing written. The cases are generated from the parsers and the option
declarations (repgeom_eval/spec/option_fields.py), so a new option is covered the day it is declared:

* an option with ``choices``: a value that is none of them;
* an option of type ``int``/``float``: a word;
* an option with a parser of its own (``KEY=VALUE`` pairs, ``no:NAME`` ...): a value without its separator;
* an option declared with ``check=positive``: 0 and -1 (with the command's required options given, so that the
  check is what fails).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import pytest

from repgeom_eval.entrypoints.cli import build_parser, command_parser, main
from repgeom_eval.spec.option_fields import label, positive
from repgeom_eval.plugin_system.host import get_host


def _subcommands(parser: argparse.ArgumentParser, words: list[str]):
    """(command words, its parser) for a command and its sub-commands (``mteb run`` ...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
        return
    for action in subs:
        for name, sub in action.choices.items():
            if hasattr(action, "configure"):
                sub = action.configure(name)
            yield from _subcommands(sub, words + [name])


def commands():
    host = get_host()
    root = build_parser(host)
    for name in host.commands.names():
        yield from _subcommands(command_parser(root, name), [name])


def _invalid(action: argparse.Action) -> list[str]:
    if not action.option_strings or action.nargs == 0 or action.help == argparse.SUPPRESS:
        return []
    if action.choices is not None:
        return ["zz-none-of-them"]
    if action.type in (int, float):
        return ["not-a-number"]
    if callable(action.type) and action.type not in (str,):
        try:
            action.type("no-separator-here")
        except (argparse.ArgumentTypeError, TypeError, ValueError):
            return ["no-separator-here"]
    return []


def parse_cases() -> list:
    out = []
    for words, parser in commands():
        for action in parser._actions:
            for value in _invalid(action):
                flag = max(action.option_strings, key=len)
                out.append(pytest.param(words, flag, value, id=f"{' '.join(words)} {flag} {value}"))
    return out


def check_cases() -> list:
    out = []
    for words, parser in commands():
        cls = parser.get_default("_options_class")
        if cls is None:
            continue
        required = []  # the options declared without a default, given a placeholder (a check runs before they are read)
        for f in fields(cls):
            flags = f.metadata.get("flags") or ()
            if flags and f.default is MISSING and f.default_factory is MISSING:
                required += [label(f), "x"] if label(f).startswith("-") else ["x"]
        for f in fields(cls):
            if f.metadata.get("check") is positive and f.metadata.get("flags"):
                for value in ("0", "-1"):
                    out.append(pytest.param(words, required, label(f), value,
                                            id=f"{' '.join(words)} {label(f)} {value}"))
    return out


PARSE = parse_cases()
CHECK = check_cases()


def _refused(argv: list[str], flag: str, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 or isinstance(rc, int) and rc != 0, (argv, rc, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("repgeom: warning:")]
    assert len(lines) == 1 and lines[0].startswith("repgeom: error:"), err
    assert flag.lstrip("-") in lines[0], (flag, lines[0])
    assert not list(tmp_path.iterdir()), f"{argv} wrote {list(tmp_path.iterdir())}"


@pytest.mark.fault("refused")
@pytest.mark.parametrize("words, flag, value", PARSE)
def test_a_value_the_declaration_rules_out_is_one_line(words, flag, value, capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as stop:
        _refused([*words, flag, value], flag, capsys, tmp_path, monkeypatch)
    assert stop.value.code == 2
    err = capsys.readouterr().err  # argparse exits from inside main: the line is checked here
    assert "Traceback" not in err


@pytest.mark.fault("refused")
@pytest.mark.parametrize("words, required, flag, value", CHECK)
def test_a_value_the_check_rules_out_is_one_line(words, required, flag, value, capsys, tmp_path, monkeypatch):
    _refused([*words, *required, flag, value], flag, capsys, tmp_path, monkeypatch)


# commands whose options are all paths, names or switches: nothing a declaration rules out (tests/test_bad_input.py
# feeds them bad files); lm-eval passes its arguments to lm-eval
ONLY_PATHS_AND_SWITCHES = {("lm-eval",), ("mteb", "summary"), ("plugins",), ("report",), ("tasks-dir",)}


def test_the_sweep_covers_every_command(request):
    """The size of the enumeration (commands × options × invalid values), and that no command is left out."""
    covered = {tuple(p.values[0]) for p in PARSE} | {tuple(p.values[0]) for p in CHECK}
    everything = {tuple(words) for words, _ in commands()}
    print(f"\n{len(everything)} commands, {len(PARSE) + len(CHECK)} invalid values "
          f"({len(PARSE)} ruled out by a parser, {len(CHECK)} by a check)")
    assert len(PARSE) + len(CHECK) >= 150, (len(PARSE), len(CHECK))
    assert covered | ONLY_PATHS_AND_SWITCHES == everything, sorted(everything - covered - ONLY_PATHS_AND_SWITCHES)


def test_a_short_flag_means_one_long_option_in_every_command():
    """``-l`` is ``--layers`` and ``-b`` ``--batch-size`` wherever they exist (``mteb run`` had them as
    ``--languages`` and ``--benchmarks``): every short flag of every command's parser, the top-level parser's
    included, shares one long option with its other uses."""
    meaning: dict[str, dict[str, set[str]]] = {}  # short flag → command → the long options of its action
    parsers = [(["repgeom"], build_parser(get_host()))] + list(commands())
    for words, parser in parsers:
        for action in parser._actions:
            longs = {s for s in action.option_strings if s.startswith("--")}
            for short in (s for s in action.option_strings if not s.startswith("--")):
                meaning.setdefault(short, {})[" ".join(words)] = longs
    assert {"-l", "-b", "-m", "-o", "-d", "-k"} <= set(meaning)
    for short, by_command in sorted(meaning.items()):
        if len(by_command) > 1:  # one use (the top level's -p no:NAME): nothing to disagree with
            common = set.intersection(*by_command.values())
            assert common, f"{short} means {sorted(by_command.items())}"
    assert "--layers" in meaning["-l"]["mteb run"] and "--batch-size" in meaning["-b"]["mteb run"]
