"""The facts the README and docs/ state in their prose, checked against the code and the reference data.

tests/test_docs_blocks.py runs the pages' code blocks and checks the commands of their bash blocks; this file checks
what the text says between them:

- every `--option` named anywhere exists: in the `oal` command an inline `oal COMMAND ...` span names, else in some
  `oal` command, a benchmark or script, or on FOREIGN_OPTIONS (pip, torchrun, accelerate, pytest, lm-eval);
- every `OAL_*` variable named is one the code reads, and every one the code reads is in the command-line
  reference's table of switches;
- every dotted name `oal.x.y` / `benchmarks.x` in inline code imports;
- every file the getting-started table says a run directory holds is one `oal run` writes;
- the headline tables (the SmolLM2 frontier, the budget study) quote `benchmarks/reference/*.json` as rounded.

Each check is shown to fail on a page with the error injected.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from test_docs_blocks import PAGES, ROOT, _cli_problems, _command_lines, _name

REFERENCE = ROOT / "benchmarks" / "reference"

# options of other programs that the pages name (pip, torchrun, accelerate, pytest, lm-eval)
FOREIGN_OPTIONS = {"--no-deps", "--dist", "--nproc_per_node", "--nnodes", "--node_rank", "--master_addr",
                   "--master_port", "--config_file", "--cpu", "--multi_gpu", "--num_processes", "--model_args",
                   "--include_path", "--log_samples", "--output_path"}


def _text(page: Path) -> str:
    return page.read_text()


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _spans(text: str) -> list[str]:
    """The inline code spans of a page's prose."""
    return re.findall(r"`([^`\n]+)`", _prose(text))


# ------------------------------------------------------------------------------------------------ options

def _cli_group():
    import typer.main

    from oal.cli import load_commands

    return typer.main.get_command(load_commands())


def _known_options(group) -> set[str]:
    known = {"--help"}
    for command in [group, *group.commands.values()]:
        for p in command.params:
            known |= {*p.opts, *getattr(p, "secondary_opts", [])}
    return known


def _tool_sources() -> str:
    files = [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.sh"),
             *(ROOT / "scripts").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh")]
    return "".join(p.read_text() for p in files)


def option_problems(text: str, group, known: set[str], tools: str) -> list[str]:
    """The options a page names that do not exist (see the module docstring)."""
    problems = []
    for span in _spans(text):  # `oal COMMAND --opt ...`: the option must be that command's
        if re.match(r"(\.venv/bin/)?oal [a-z]", span):
            for command in _command_lines(span.replace("/--", " --")):
                problems += _cli_problems(command, group)
    for option in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", text))):
        if option not in known and option not in FOREIGN_OPTIONS and f'"{option}"' not in tools:
            problems.append(f"no command, benchmark or script has {option}")
    return problems


def test_every_option_named_in_the_docs_exists():
    group = _cli_group()
    known, tools = _known_options(group), _tool_sources()
    problems = [f"{_name(page)}: {p}" for page in PAGES for p in option_problems(_text(page), group, known, tools)]
    assert problems == []


def test_the_option_check_can_fail():
    group = _cli_group()
    known, tools = _known_options(group), _tool_sources()
    assert option_problems("Pass `--stepz 3` to train longer.", group, known, tools)
    assert option_problems("`oal export --out RUN --steps 3`", group, known, tools)  # another command's option
    assert option_problems("`oal adapt --window/--sinkz`", group, known, tools)
    assert not option_problems("`oal adapt --window/--sinks` and `--select-by` and `--no-tune`", group, known, tools)


# ------------------------------------------------------------------------------------------------ environment

def _env_read_by_code() -> set[str]:
    """Every `OAL_*` name the package spells as a string: the switches it reads (env_flag, os.environ)."""
    names = set()
    for path in (ROOT / "src" / "oal").rglob("*.py"):
        names |= set(re.findall(r"[\"'](OAL_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def _env_table() -> set[str]:
    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    section = text.split("## Switches in the environment", 1)[1]
    return set(re.findall(r"^\| `(OAL_[A-Z0-9_]+)` \|", section, re.M))


def env_problems(text: str, code: set[str]) -> list[str]:
    return [f"{name} is read nowhere in src/oal" for name in sorted(set(re.findall(r"\bOAL_[A-Z0-9_]+", text)) - code)]


def test_every_environment_variable_named_is_read_and_every_switch_is_listed():
    code = _env_read_by_code()
    assert "OAL_CPU_KERNEL" in code and "OAL_CACHE_DIR" in code  # the scan finds them
    problems = [f"{_name(page)}: {p}" for page in PAGES for p in env_problems(_text(page), code)]
    assert problems == []
    assert _env_table() == code, "docs/reference/cli.md's table of switches lists every OAL_ variable the code reads"


def test_the_environment_check_can_fail():
    assert env_problems("set `OAL_CPU_KERNELS=0`", _env_read_by_code())


# ------------------------------------------------------------------------------------------------ Python names

def resolve(name: str):
    """The object a dotted name `oal.x.y` names (modules imported as far as they go, then attributes)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue
            raise
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(name)


def dotted_names(text: str) -> set[str]:
    """`oal.x.y` and `benchmarks.x` in inline code, less file names (`oal.json`), JSON keys ("oal.lora") and
    placeholders (`benchmarks.NAME`)."""
    names = set()
    for span in _spans(text):
        for name in re.findall(r"(?<![\w./\"-])((?:oal|benchmarks)(?:\.[A-Za-z_]\w*)+)", span):
            file_or_key = re.search(r"\.(json|md|py|sh|txt|png|safetensors|lora)$", name)
            if not file_or_key and not name.split(".")[-1].isupper():
                names.add(name)
    return names


def name_problems(text: str) -> list[str]:
    problems = []
    for name in sorted(dotted_names(text)):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return problems


def test_every_python_name_in_the_docs_imports():
    names = set().union(*(dotted_names(_text(page)) for page in PAGES))
    assert len(names) > 50 and "oal.evaluate.retrieval.needle_attention" in names
    problems = [f"{_name(page)}: {p}" for page in PAGES for p in name_problems(_text(page))]
    assert problems == []


def test_the_name_check_can_fail():
    assert name_problems("`oal.evaluate.retrieval.needle_attentions` measures it")
    assert name_problems("`oal.no_such_module.f`")
    assert not name_problems("`oal.json`, `\"oal.lora\"`, `benchmarks.NAME`, `oal.ops.oal_attention`")


# ------------------------------------------------------------------------------------------------ run directory

def run_dir_problems(text: str) -> list[str]:
    """The files of getting-started's table that `oal run` does not write (oal.rundir.claim.RUN_ENTRIES)."""
    from oal.rundir.claim import RUN_ENTRIES

    section = text.split("## What a run directory holds", 1)[1].split("\n## ", 1)[0]
    rows = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    tops = {re.split(r"/", name, maxsplit=1)[0] or name for row in rows for name in re.findall(r"`([^`]+)`", row)}
    return sorted(t for t in tops if t not in RUN_ENTRIES)


def test_the_files_a_run_directory_holds_are_the_ones_oal_run_writes():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    assert run_dir_problems(text) == []
    assert run_dir_problems(text.replace("| `calibration.json` |", "| `calibrations.json` |"))


# ------------------------------------------------------------------------------------------------ quoted numbers

def _table(text: str, header_start: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table whose header starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*") for cell in line.strip().strip("|").split("|")])
    return rows


def _fmt(x: float, places: int) -> str:
    return f"{x:.{places}f}"


def frontier_problems(text: str) -> list[str]:
    """The frontier table (README, results/smollm2.md) against frontier_smollm2_retimed.json: PPL, passkey, decode
    and prefill times, as rounded on the page."""
    data = json.loads((REFERENCE / "frontier_smollm2_retimed.json").read_text())
    arms = {("softmax", None): data["softmax"]}
    for row in data["rows"]:
        arms[(row["method"], row["select_by"])] = row
    problems = []
    for cells in _table(text, "| arm (64 LoRA updates each)"):
        label = cells[0]
        method = label.split(" ")[0].rstrip(",")
        select = None if method == "softmax" else "fidelity+recall" if "recall" in label else "fidelity"
        arm = arms[(method, select)]
        want = [_fmt(arm["ppl"], 2),
                " / ".join(_fmt(arm["passkey"][n], 2) for n in ("1024", "2048", "4096")),
                " / ".join(str(round(arm["decode_ms"][n])) for n in ("2048", "4096", "8192")),
                _fmt(arm["prefill_s"]["8192"], 1)]
        if cells[2:6] != want:
            problems.append(f"{label}: the page has {cells[2:6]}, the JSON {want}")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/results/smollm2.md"])
def test_the_frontier_table_quotes_its_json(page):
    text = (ROOT / page).read_text()
    assert len(_table(text, "| arm (64 LoRA updates each)")) == 5
    assert frontier_problems(text) == []
    assert frontier_problems(text.replace("| 12.61 |", "| 12.16 |", 1))


def budget_problems(text: str) -> list[str]:
    """The budget study's adaptation table against smollm2_budget.json."""
    data = json.loads((REFERENCE / "smollm2_budget.json").read_text())
    problems = []
    for cells in _table(text, "| updates (tokens) | softmax test PPL"):
        steps = cells[0].split(" ")[0]
        if steps == "0,":
            arms = data["arms"]
            want = [_fmt(arms["softmax"]["test_ppl_calibrated"], 2), _fmt(arms["oal"]["test_ppl_calibrated"], 1),
                    _fmt(arms["global"]["test_ppl_calibrated"], 1),
                    _fmt(data["gap_ratio"]["test_calibrated"]["oal"], 2)]
        else:
            budget = data["budgets"][steps]
            val = dict(data["gap_ratio"]["val"]["oal"])[int(steps)]  # the 256-update run's curve at that step
            want = [_fmt(budget["test_ppl"]["softmax"], 2), _fmt(budget["test_ppl"]["oal"], 1),
                    _fmt(budget["test_ppl"]["global"], 1), _fmt(budget["gap_ratio"]["test"]["oal"], 2),
                    _fmt(val, 2)]
        if cells[1:1 + len(want)] != want:
            problems.append(f"{cells[0]}: the page has {cells[1:1 + len(want)]}, the JSON {want}")
    return problems


def test_the_budget_table_quotes_its_json():
    text = (ROOT / "docs" / "results" / "smollm2-budget.md").read_text()
    assert len(_table(text, "| updates (tokens) | softmax test PPL")) == 4
    assert budget_problems(text) == []
    assert budget_problems(text.replace("| 95.7 |", "| 95.1 |"))


def test_the_quoted_goals_are_the_json_goals():
    """The budget study's two goals, as README, index.md and the results pages quote them."""
    goals = json.loads((REFERENCE / "smollm2_budget.json").read_text())["goals"]
    frozen, gap = _fmt(goals["frozen_ratio"]["value"], 2), _fmt(goals["gap_ratio"]["value"], 2)
    assert not goals["frozen_ratio"]["met"] and not goals["gap_ratio"]["met"]
    for page in ("README.md", "docs/results/smollm2.md", "docs/results/smollm2-budget.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert f"{frozen}x SpectraFormer's" in text, page
        assert f"{gap}" in text, page

