"""Advice is true (issue 37, mechanism 5): an error names only flags of the command the user ran.

Library code names a setting with ``errors.setting(field)``, which the CLI renders as the running command's flag
(quickstart's ``--data-budget`` for prepare's ``regen_budget``), or as the field and the commands that take it where
the running command has none. Two checks keep that so:

* statically, for every command: each ``--flag`` that error text in a module the command can import spells literally
  (a ``SpecdraftError`` message, a flag handed to a helper that words the error, a hint table) is one of that
  command's flags, and no error builds a flag from a name by hand;
* dynamically, every error the hostile sweeps provoke (``sweep_cases.judge`` applies ``untrue_advice``), and here the
  error paths of the bugs that advised foreign flags, run through ``main`` with their stderr read.
"""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from pathlib import Path

import pytest

import specdraft
from specdraft.cli.main import build_parser, command_flags, commands, main
from specdraft.errors import CommandSettings, SpecdraftError, command_settings, setting

SRC = Path(specdraft.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
#: Another command, with its flags: quoted advice (`specdraft prepare --out D`) or the name of what it writes ("a specdraft
#: eval --parity run").
QUOTED = re.compile(r"`specdraft ([a-z][a-z -]*)[^`]*`?|specdraft ([a-z][a-z-]*)(?: --[a-z][a-z0-9-]*)+")
#: Flags of other programs that errors quote (each of them no flag of any specdraft command, so none can mislead).
FOREIGN_FLAGS = {
    "--max-model-len": "vLLM's: restart your vLLM server with it",
    "--no-deps": "pip's, in how bootstrap.sh installs a wheel",
    "--nproc-per-node": "torchrun's, in how a sequence-parallel job is launched",
}
#: Calls whose string arguments are not error text: logs, what is printed on success, argparse, help texts.
NOT_ERRORS = {
    "debug",
    "info",
    "warning",
    "error",
    "exception",
    "print",
    "add_argument",
    "add_parser",
    "add_argument_group",
    "config_field",
    "warn",
    "append",
    "extend",
    "insert",
    "index",
    "startswith",
    "endswith",
    "split",
    "replace",
}


@cache
def parser_table() -> dict[str, tuple[str, frozenset[str]]]:
    """Command -> (the module whose ``run`` it calls, its flags)."""
    parser = build_parser()
    return {
        name: (leaf.get_default("func").__module__, frozenset(o for a in leaf._actions for o in a.option_strings))
        for name, leaf in commands(parser).items()
    }


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in SRC.rglob("*.py")}


@cache
def imports(name: str) -> frozenset[str]:
    """The specdraft modules ``name`` imports anywhere (function-level imports too), with their packages."""
    tree, found = modules()[name], set()
    package = name if SRC.joinpath(*name.split(".")[1:], "__init__.py").is_file() else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update([base] + [f"{base}.{a.name}" for a in node.names])
    out = set()
    for dotted in found:
        parts = dotted.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules())
    return frozenset(out)


def reach(*start: str) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += imports(name)
    return seen


def _call_name(node: ast.Call) -> str | None:
    return getattr(node.func, "id", None) or getattr(node.func, "attr", None)


def _text(node: ast.AST) -> str:
    """A string literal's text, ``{}`` for each value an f-string formats in."""
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return node.value


def _spelled(text: str) -> list[tuple[str, str | None]]:
    """(flag, quoted command) for each flag ``text`` spells: inside a quoted `specdraft COMMAND ...` the flag is
    that command's (advice to run another command, with its flags); elsewhere it is the running command's (None)."""
    quoted, out = [], []
    for m in QUOTED.finditer(text):
        words = (m.group(1) or m.group(2)).split()
        command = " ".join(words[:2]) if " ".join(words[:2]) in parser_table() else words[0]
        quoted.append((m.start(), m.end(), command))
    for m in FLAG.finditer(text):
        out.append((m.group(), next((c for a, b, c in quoted if a <= m.start() < b), None)))
    return out


def flags_in(tree: ast.Module) -> set[tuple[int, str, str | None]]:
    """(line, flag, quoted command or None) for each flag the error text of a module spells, and (line, "BUILT", None)
    for each flag it builds by hand (``f"--{name}"``, ``"--" + name``). Error text: the strings of a
    ``SpecdraftError(...)``; a bare flag passed to a call or as a parameter default (``probe_writable(path, "--store")``,
    ``what="--out"``: the helper words the error); prose naming a flag that is passed to a call or assigned at module
    level (``choices="..."``, hint tables). Docstrings, logs, argparse, and argv lists and comparisons (another
    program's flags) are not error text."""
    quiet: set[int] = set()  # nodes that are not error text
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            quiet.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.Call) and _call_name(node) in NOT_ERRORS:
            quiet.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.keyword) and node.arg in ("help", "description", "epilog"):
            quiet.update(id(n) for n in ast.walk(node.value))
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Compare)):
            quiet.update(id(n) for n in ast.walk(node))
        if isinstance(node, ast.Dict):
            quiet.update(id(k) for k in node.keys if k is not None)
        if isinstance(node, ast.JoinedStr):
            quiet.update(id(v) for v in node.values)  # its pieces: the f-string is read whole

    def strings(node: ast.AST) -> list[ast.AST]:
        return [
            n
            for n in ast.walk(node)
            if (isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str))) and id(n) not in quiet
        ]

    found: set[tuple[int, str, str | None]] = set()
    candidates: list[ast.AST] = []
    argparse_flags = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_flag" for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "SpecdraftError":
            found.update((s.lineno, flag, quoted) for s in strings(node) for flag, quoted in _spelled(_text(s)))
            if any(isinstance(n, ast.Call) and _call_name(n) == "_flag" for n in ast.walk(node)):
                found.add((node.lineno, "BUILT", None))  # utils/config's builder of argparse flags, used in an error
            if any(re.search(r"--\{\}", _text(s)) for s in strings(node)):
                found.add((node.lineno, "BUILT", None))
        elif isinstance(node, ast.Call) and _call_name(node) not in NOT_ERRORS:
            candidates += [
                s
                for a in [*node.args, *(k.value for k in node.keywords)]
                if isinstance(a, (ast.Constant, ast.JoinedStr))
                for s in strings(a)
            ]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            candidates += [s for d in [*node.args.defaults, *node.args.kw_defaults] if isinstance(d, ast.Constant) for s in strings(d)]
        elif isinstance(node, ast.Module):
            candidates += [
                s
                for st in node.body
                if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None
                for s in strings(st.value)
                if " " in _text(s)
            ]
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.left, ast.Constant)
            and node.left.value == "--"
            and id(node) not in argparse_flags
        ):
            found.add((node.lineno, "BUILT", None))
    for s in candidates:
        if " " in _text(s) or re.fullmatch(r"--[a-z][a-z0-9-]*", _text(s)):
            found.update((s.lineno, flag, quoted) for flag, quoted in _spelled(_text(s)))
    return found


@cache
def error_text(name: str) -> frozenset[tuple[int, str, str | None]]:
    return frozenset(flags_in(modules()[name]))


def untrue_flags() -> dict[str, list[str]]:
    """Command -> "module:line --flag" for each flag its errors may spell that it does not take (or that a quoted
    `specdraft COMMAND ...` does not)."""
    table, every = parser_table(), set().union(*(flags for _, flags in parser_table().values()))
    problems: dict[str, list[str]] = {}
    for command, (module, flags) in table.items():
        for name in sorted(reach("specdraft.cli.main", module)):
            if name == "specdraft.errors":
                continue  # setting() itself
            for line, flag, quoted in sorted(error_text(name), key=str):
                if flag == "BUILT":
                    problems.setdefault(command, []).append(f"{name}:{line} builds a flag by hand: name the field with setting()")
                elif quoted is not None:
                    if quoted not in table or flag not in table[quoted][1]:
                        problems.setdefault(command, []).append(f"{name}:{line} `specdraft {quoted} {flag}`")
                elif flag not in flags and not (flag in FOREIGN_FLAGS and flag not in every):
                    problems.setdefault(command, []).append(f"{name}:{line} {flag}")
    return problems


def untrue_advice(args: list[str], text: str) -> list[str]:
    """The flags that ``text``, an error of ``specdraft ARGS``, names and its command does not take (or, inside a
    quoted `specdraft COMMAND ...`, that command does not): what the sweep's judge refuses too."""
    table = parser_table()
    words = [a for a in args if not a.startswith("-")][:2]
    command = " ".join(words) if " ".join(words) in table else words[0]
    return [
        flag if quoted is None else f"`specdraft {quoted} {flag}`"
        for flag, quoted in _spelled(text)
        if flag not in table.get(quoted or command, ("", frozenset()))[1] and not (quoted is None and flag in FOREIGN_FLAGS)
    ]


# ----- the static check -------------------------------------------------------------------------------------


def test_every_flag_an_error_can_name_is_a_flag_of_the_command_that_raises_it():
    """Before the fix quickstart reached calibrate's "raise --val-fraction" and prepare's "raise --regen-budget"
    (neither a quickstart flag), among the other commands' foreign flags."""
    problems = untrue_flags()
    assert not problems, "errors that advise flags the command does not take:\n" + "\n".join(
        f"specdraft {command}: {', '.join(where)}" for command, where in sorted(problems.items())
    )


def test_the_scan_sees_the_ways_an_error_can_spell_a_flag():
    """The forms error text takes are found; docstrings, logs and argv lists (other programs' flags) are not error text."""
    source = '''
from specdraft.errors import SpecdraftError
HINTS = {"late": "raise --regen-budget to keep them"}
ARGV = ["--port", "1"]
def f(what="--dir"):
    """Pass --docstring here."""
    log.warning("a warning about --warned")
    probe(x, "--store")
    check(x, choices=f"choose a new --out {x}")
    cmd = ["serve", "--host"]
    if "--flag" in cmd:
        raise SpecdraftError(f"--val-fraction {1} or --{what}; run `specdraft prepare --out {x}`, `specdraft store start --data`")
    flag = "--" + what
'''
    found = flags_in(ast.parse(source))
    assert {flag for _, flag, _ in found} == {"--regen-budget", "--dir", "--store", "--out", "--val-fraction", "--data", "BUILT"}
    assert {line for line, flag, _ in found if flag == "BUILT"} == {12, 13}
    assert {(flag, quoted) for _, flag, quoted in found if quoted} == {("--out", "prepare"), ("--data", "store start")}


def test_every_setting_an_error_names_is_a_setting_of_some_command():
    """``setting("field")`` must name a field some command takes (a typo would render as a bare word), and ``of=`` a command."""
    table = parser_table()
    fields = {dest for _, leaf in commands(build_parser()).items() for dest in command_flags(leaf)}
    bad = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) == "setting" and node.args and isinstance(node.args[0], ast.Constant):
                if node.args[0].value not in fields:
                    bad.append(f"{name}:{node.lineno} setting({node.args[0].value!r})")
                for k in node.keywords:
                    if k.arg == "of" and isinstance(k.value, ast.Constant) and k.value.value not in table:
                        bad.append(f"{name}:{node.lineno} of={k.value.value!r}")
    assert not bad, bad


# ----- the helper ---------------------------------------------------------------------------------------------


def _settings_of(*argv: str) -> CommandSettings:
    from specdraft.cli.main import settings_for

    parser = build_parser()
    return settings_for(parser, parser.parse_args(list(argv)))


def test_a_setting_is_spelled_as_the_running_commands_flag_or_named_with_the_commands_that_take_it():
    assert setting("val_fraction") == "--val-fraction"  # library use: the config's own flag
    with command_settings(_settings_of("quickstart")):
        assert setting("regen_budget") == "--data-budget"  # prepare's field, fed by quickstart's own flag
        assert setting("max_samples") == "--samples" and setting("out") == "--out"
        assert setting("val_fraction", of="train") == "val_fraction (a setting of `specdraft train`)"
        assert setting("val_fraction").startswith("val_fraction (a setting of `specdraft train`, `specdraft calibrate`")
    with command_settings(_settings_of("calibrate", "--drafter", "d", "--data", "s")):
        assert setting("val_fraction") == "--val-fraction"
        assert setting("val_fraction", of="train") == "val_fraction (a setting of `specdraft train`)"  # not calibrate's own
    with command_settings(_settings_of("serve", "runs/x")):
        assert setting("drafter") == "DRAFTER"  # a positional
    with command_settings(_settings_of("store", "stop")):
        assert setting("dir") == "--dir" and setting("port").startswith("port (a setting of `specdraft store start`, ")
    assert setting("regen_budget") == "--regen-budget"  # restored after the command


# ----- the error paths of the bugs ------------------------------------------------------------------------------


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"specdraft {command}: error:")]
    assert lines, err
    return lines[-1]


def test_a_lock_holders_command_line_is_quoted_as_its_own_command():
    """A refusal put the holder's command line in unquoted (cut at 200 characters, perhaps inside a flag), so its
    flags read as advice to the refused command: `prepare --out R/sub` "advised" train's --max-steps. Quoted as
    `specdraft train ...`, closed however long, with a flag never cut."""
    from specdraft.utils.lock import describe_holder

    argv = [
        "/venv/bin/specdraft",
        "train",
        "--target",
        "/t/" + "x" * 120,
        "--data",
        "/d/" + "y" * 120,
        "--out",
        "/runs/R",
        "--max-steps",
        "4",
        "--checkpoint-interval",
        "2",
    ]
    for limit_argv in (argv, argv[:8], ["/w/killpoint.py", *argv[1:6]]):
        shown = describe_holder({"pid": 7, "host": "h", "command": "specdraft train", "argv": limit_argv, "started": 0.0})
        refusal = f"/runs/R/sub lies inside /runs/R, which is being written by {shown}; choose another --out"
        assert untrue_advice(["prepare", "--out", "/runs/R/sub"], refusal) == [], refusal
        quoted = re.search(r"`specdraft train [^`]*`", shown)
        assert quoted and shown.count("`") == 2 and len(quoted.group()) <= 302, shown
        assert not re.search(r"--[a-z-]*\.\.\.", shown), shown  # no flag cut short
    assert "(4 argument(s) cut)" in describe_holder({"command": "specdraft train", "argv": argv})
    in_python = describe_holder({"pid": 7, "host": "h", "command": "specdraft train", "argv": ["/x/pytest", "-q", "--max-steps"]})
    assert "specdraft train, run by `pytest`" in in_python and "--max-steps" not in in_python  # not the CLI: no argv as flags


@pytest.mark.parametrize(
    "flags", [["--budget", "0.01"], ["--budget", "-1"], ["--budget", "2", "--data-budget", "5"], ["--budget", "5", "--eval-reserve", "6"]]
)
def test_a_quickstart_budget_that_cannot_hold_a_run_is_refused_before_any_work(tmp_path, capsys, flags):
    """Before the fix each was accepted (the check ran only with a nonzero --eval-reserve): --budget 0.01 spent 14
    minutes preparing data before "no time left for training"."""
    out = tmp_path / "run"
    assert main(["quickstart", "--out", str(out), *flags]) == 2
    line = _error_line(capsys, "quickstart")
    assert not out.exists() and "--budget" in line and not untrue_advice(["quickstart"], line)
    if "or more" in line:  # the budget it names is one that would do
        from specdraft.quickstart import QuickstartConfig

        budget = re.search(r"pass --budget ([0-9.]+) or more", line).group(1)
        values = dict(zip(flags[::2], flags[1::2]))
        QuickstartConfig(
            budget=float(budget),
            data_budget=float(values["--data-budget"]) if "--data-budget" in values else None,
            eval_reserve=float(values.get("--eval-reserve", 0)),
        )


def test_a_measured_comparison_reserve_that_leaves_no_training_is_refused_before_the_data_stage(tiny_llama_dir, tmp_path, monkeypatch):
    """The reserve is measured first (seconds), so a budget it leaves no training in costs no data minutes."""
    import specdraft.quickstart as quickstart
    from specdraft.quickstart import stages

    monkeypatch.setattr(stages, "size_eval", lambda *a, **k: {"reserve_s": 600.0})
    config = quickstart.QuickstartConfig(out=str(tmp_path / "run"), target=str(tiny_llama_dir), budget=7, threads=1, engine="hf")
    with pytest.raises(
        SpecdraftError,
        match=r"--budget 7 min is too small for a run after .* the comparison's reserve \(10.00 min, "
        r"measured here.* pass --budget 10\.[0-9]+ or more",  # no --data-budget: the split sizes data to what is left
    ):
        quickstart.run_quickstart(config)
    assert not (tmp_path / "run" / "data").exists()


TINY_RECIPE = """\
method: dspark
model: {num_layers: 1, block_size: 4, markov_rank: 16, max_anchors: 8, intermediate_size: 64}
pack_tokens: 256
val_fraction: 0.05
checkpoint_interval: 0
dtype: fp32
"""


def _quickstart(tmp_path: Path, target: Path, *flags: str) -> list[str]:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    return [
        "quickstart",
        "--out",
        str(tmp_path / "run"),
        "--target",
        str(target),
        "--recipe",
        str(recipe),
        "--max-new-tokens",
        "8",
        "--regen-batch-size",
        "8",
        "--budget",
        "3",
        "--epochs",
        "1",
        "--eval-max-new-tokens",
        "4",
        "--threads",
        "1",
        "--engine",
        "hf",
        "--no-compare-reference",
        *flags,
    ]


def test_a_quickstart_whose_data_budget_keeps_nothing_advises_its_own_flags(tiny_llama_dir, tmp_path, capsys):
    """Before the fix prepare's error advised `--regen-budget` and named `--data`, neither a quickstart flag."""
    assert main(_quickstart(tmp_path, tiny_llama_dir, "--samples", "4", "--data-budget", "1e-6", "--eval-reserve", "1")) == 2
    line = _error_line(capsys, "quickstart")
    assert "raise --data-budget" in line and not untrue_advice(["quickstart"], line), line


@pytest.mark.slow
def test_a_small_quickstart_holds_samples_out_for_calibration(tiny_llama_dir, tmp_path, capsys):
    """``--samples 8``: at the recipe's 5% no sample was held out, and calibrate failed advising `--val-fraction`
    (not a quickstart flag) on every rerun. The split now holds out the component a larger fraction would draw first
    (train/split.py), and the run calibrates on it."""
    assert main(_quickstart(tmp_path, tiny_llama_dir, "--samples", "8", "--data-budget", "1")) == 0, capsys.readouterr().err
    split = json.loads((tmp_path / "run" / "train" / "split.json").read_text())
    assert split["validation_samples"] >= 1 and split["train_samples"] >= 1
    assert (tmp_path / "run" / "train" / "final" / "calibration.json").is_file()


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, tiny_target_factory):
    from sweep_cases import build_pipeline, run_in_process

    return build_pipeline(tmp_path_factory.mktemp("advice"), run_in_process, target=tiny_target_factory("llama", num_layers=4))


def test_calibrate_names_the_split_it_used_and_a_remedy_that_works(pipe, capsys):
    """The run trained with val_fraction 0 (its split.json holds out none); before the fix calibrate said
    "val_fraction 0.9 ... raise --val-fraction", though the recorded split wins over that flag."""
    out = pipe.work / "calibrated"
    assert main(["calibrate", "--drafter", str(pipe.final), "--data", str(pipe.hs), "--out", str(out), "--val-fraction", "0.9"]) == 2
    line = _error_line(capsys, "calibrate")
    assert f"the recorded split ({pipe.run / 'split.json'}: val_fraction 0, seed 0) holds out none" in line, line
    assert "0.9" not in line and "--val-fraction" not in line and "val_fraction (a setting of `specdraft train`)" in line
