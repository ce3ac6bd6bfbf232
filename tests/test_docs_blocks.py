"""Every code block of the README and of docs/ (issue 49): run by a test, or on the skip-list below with its reason.

- python blocks run in order, one namespace per page, in a fresh folder (as a reader pastes them one after the
  other). The quick start converts SmolLM2; here it converts the embedded default model, with the substitutions in
  SUBSTITUTIONS (each must apply, so a changed page cannot pass unseen). The README's quick start opens the
  conversion guide too: those two pages are one session, where a block already run is not run again. When
  SmolLM2-135M is fetched, the README's quick start also runs on it (one layer, a short calibration).
- console blocks (the error catalogue) run their `$` commands: the last one must fail with exit code 2 and exactly
  the last line shown; the ones before it must succeed.
- bash blocks run for minutes to hours, on a GPU or over the network: every one is on SKIP_BASH, and every `oal`
  command in them is checked against the CLI (the command and each option exist), every `python -m benchmarks.X`
  and `scripts/X` against the tool's source (the file and each option exist).

A block of another language (yaml, text) is data, not a command.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGUAGES = ("python", "console", "bash")

# (pattern found in a bash block, why the block does not run here)
SKIP_BASH = [
    (r"python3 -m venv", "the install itself: .ci/run runs it on a clean checkout"),
    (r"-m pytest", "the test suite itself (.ci/run)"),
    (r"\boal fetch\b", "downloads a 100 MB wheel from PyPI (network) and dequantises it"),
    (r"\boal (run|adapt|evaluate|export|diagnose|analyze|calibrate|generate)\b",
     "runs or reads an `oal run` directory: minutes to hours of CPU; the command tests run them at small sizes"),
    (r"^(torchrun|accelerate launch)", "several processes or GPUs; tests/test_distributed.py runs 2 CPU processes"),
    (r"-m benchmarks\.|benchmarks/tune_report\.sh", "timings: a quiet machine and minutes; the benchmark tests run "
     "each tool at tiny sizes"),
    (r"scripts/scale_rehearsal\.py", "hours of CPU at Qwen2.5-0.5B's shape; tests/test_scale_rehearsal.py runs it "
     "small"),
    (r"-m oal\.lm_eval", "needs PIQA from the hub; tests/test_lm_eval_export.py runs lm-eval on local tasks"),
    (r"\boal tune-cpu\b", "times this machine for a minute and writes the user's tuning cache"),
]
# (pattern found in a python block, why it does not run here)
SKIP_PYTHON = [
    (r"run\(RunConfig\.from_preset", "the whole protocol on the default model: minutes of CPU (as `oal run`)"),
]


def _default_model() -> str:
    from oal.models.registry import DEFAULT_MODEL_DIR

    return str(DEFAULT_MODEL_DIR)


QUICK_START = 'model = oal.linearize(model, tok, "builtin", layers="auto:15", method="oal-swa")'
SMOLLM2_PATH = 'path = "HuggingFaceTB/SmolLM2-135M-Instruct"'


def _quick_start(path: str, layers: str) -> list[tuple[str, str]]:
    """The quick start on another model: its folder, two of its layers rather than `auto:15` (auto:K calibrates every
    layer: minutes; tests/test_linearize.py runs it), 40 calibration updates per start rather than 200
    (tests/test_linearize.py checks what calibration gives)."""
    return [(SMOLLM2_PATH, f"path = {path!r}"),
            (QUICK_START, QUICK_START.replace('layers="auto:15"', f'layers="{layers}"')
             .replace('method="oal-swa")', 'method="oal-swa", calib={"preset": "tiny"})'))]


# The conversion guide's adaptation sketches on 2 blocks and 2 Trainer updates rather than 8: the same code, each
# update a forward and backward through the model (most of this session's time).
ADAPT_SKETCHES = [("input_ids[0, : 8 * 256].reshape(8, 256)", "input_ids[0, : 2 * 256].reshape(2, 256)"),
                  ("max_steps=8,", "max_steps=2,")]
# page -> (old, new) replacements applied to its python blocks before they run (on the embedded default model)
SUBSTITUTIONS = {
    "README.md": lambda: _quick_start(_default_model(), "2,3"),
    "docs/guides/convert.md": lambda: _quick_start(_default_model(), "2,3") + ADAPT_SKETCHES,
}
# pages whose python blocks run as one session, in this order (their shared blocks run once)
SESSIONS = [("README.md", "docs/guides/convert.md")]


def _converted_folder(cwd: Path) -> None:
    """docs/guides/export.md loads `converted/`, which its bash block exports from a run: the same folder, written
    from the default model converted in two layers (uncalibrated: loading does not care)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import oal

    model = oal.convert(AutoModelForCausalLM.from_pretrained(_default_model()), [1, 2], "oal")
    model.save_pretrained(cwd / "converted")
    AutoTokenizer.from_pretrained(_default_model()).save_pretrained(cwd / "converted")


SETUP = {"docs/guides/export.md": _converted_folder}


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, text, line) of every fenced code block of a markdown page."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _skip_reason(language: str, text: str) -> str | None:
    rules = SKIP_BASH if language == "bash" else SKIP_PYTHON if language == "python" else []
    for line in _command_lines(text) if language == "bash" else [text]:
        for pattern, why in rules:
            if re.search(pattern, line, re.M):
                return why
    return None


def _python_sessions() -> list[tuple[str, ...]]:
    """The pages with python blocks to run, as sessions: SESSIONS, then every other page on its own."""
    pages = [_name(p) for p in PAGES
             if any(lang == "python" and not _skip_reason(lang, text) for lang, text, _ in blocks(p))]
    grouped = {page for session in SESSIONS for page in session}
    return [*SESSIONS, *((page,) for page in pages if page not in grouped)]


# ------------------------------------------------------------------------------------------------ every block

def test_every_block_runs_or_is_skipped_with_a_reason():
    unrun = [(_name(p), line) for p in PAGES for lang, text, line in blocks(p)
             if lang == "bash" and not _skip_reason(lang, text)]
    assert unrun == []  # a bash block that is not on SKIP_BASH: add a test that runs it, or a skip with its reason
    languages = {lang for p in PAGES for lang, _, _ in blocks(p)}
    assert languages <= {*RUN_LANGUAGES, "yaml", "text", ""}, languages


def test_every_skip_rule_is_used():
    used = {pattern for p in PAGES for lang, text, _ in blocks(p)
            for pattern, _ in (SKIP_BASH if lang == "bash" else SKIP_PYTHON if lang == "python" else [])
            for line in (_command_lines(text) if lang == "bash" else [text]) if re.search(pattern, line, re.M)}
    assert {p for p, _ in SKIP_BASH + SKIP_PYTHON} - used == set()


@pytest.mark.parametrize("session", _python_sessions(), ids="+".join)
def test_the_python_blocks_of_a_page_run_in_order(session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    done = set()  # blocks already run in this session (the README's quick start opens the conversion guide too)
    for name in session:
        if name in SETUP:
            SETUP[name](tmp_path)
        substitutions = SUBSTITUTIONS.get(name, lambda: [])()
        used = set()
        for lang, text, line in blocks(ROOT / name):
            if lang != "python" or _skip_reason(lang, text):
                continue
            for old, new in substitutions:
                if old in text:
                    text, _ = text.replace(old, new), used.add(old)
            if text not in done:
                exec(compile(text, f"{name}:{line}", "exec"), namespace)  # noqa: S102  (the page's own code)
                done.add(text)
        assert used == {old for old, _ in substitutions}, f"{name}: a substitution no longer applies"


def test_the_python_quick_start_converts_in_five_lines():
    first = next(text for lang, text, _ in blocks(ROOT / "README.md") if lang == "python")
    lines = [row for row in first.splitlines() if row.strip()]
    assert len(lines) <= 5 and QUICK_START in first and SMOLLM2_PATH in first
    convert_guide = [text for lang, text, _ in blocks(ROOT / "docs" / "guides" / "convert.md") if lang == "python"]
    assert convert_guide[0] == first  # the guide opens with the same lines


def _smollm2_folder() -> Path | None:
    """The fetched SmolLM2-135M's safetensors folder, or None when it was never fetched (no download here)."""
    import torch

    from oal.models.fetch import LOCAL_MODELS
    from oal.models.gguf import materialize_gguf
    from oal.rundir.user_cache import cache_root

    spec = LOCAL_MODELS["smollm2-135m"]
    gguf = cache_root("models") / Path(spec["member"]).name
    return materialize_gguf(gguf, torch.float32, source=spec) if gguf.is_file() else None


@pytest.mark.slow
def test_the_readme_quick_start_converts_smollm2(tmp_path, monkeypatch):
    folder = _smollm2_folder()
    if folder is None:
        pytest.skip("SmolLM2-135M is not fetched (`oal fetch smollm2-135m` downloads it)")
    monkeypatch.chdir(tmp_path)
    code = [text for lang, text, _ in blocks(ROOT / "README.md") if lang == "python"]
    namespace: dict = {"__name__": "__main__"}
    for old, new in _quick_start(str(folder), "14"):
        assert old in code[0]
        code[0] = code[0].replace(old, new)
    for text in code:
        exec(compile(text, "README.md", "exec"), namespace)  # noqa: S102
    from oal.models.attention import converted_methods

    assert sorted(converted_methods(namespace["model"])) == [14]
    assert type(namespace["model"]).__name__ == "OALLlamaForCausalLM"


# ------------------------------------------------------------------------------------------------ console blocks

def _console_cases() -> list[tuple[str, int, list[tuple[str, list[str]]]]]:
    out = []
    for page in PAGES:
        for lang, text, line in blocks(page):
            if lang == "console":
                steps: list[tuple[str, list[str]]] = []
                for row in text.splitlines():
                    if row.startswith("$ "):
                        steps.append((row[2:], []))
                    elif row.strip():
                        steps[-1][1].append(row)
                out.append((_name(page), line, steps))
    return out


@pytest.mark.parametrize("page,line,steps", _console_cases(), ids=lambda x: str(x) if isinstance(x, int) else None)
def test_a_console_block_prints_what_it_shows(page, line, steps, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    monkeypatch.chdir(tmp_path)
    for i, (command, shown) in enumerate(steps):
        last = i == len(steps) - 1
        if command.startswith("oal "):
            result = CliRunner().invoke(load_commands(), shlex.split(command)[1:], prog_name="oal")
            code, output = result.exit_code, result.output
        else:
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path)
            code, output = done.returncode, done.stdout + done.stderr
        if not last:
            assert code == 0 and not shown, (page, line, command, output)
            continue
        lines = [row for row in output.splitlines() if row.strip()]
        assert code == 2 and lines and lines[-1] == shown[-1], (page, line, command, output[-2000:])


# ------------------------------------------------------------------------------------------------ bash: static checks

def _command_lines(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped, `&&` and `;` split."""
    joined = text.replace("\\\n", " ")
    out = []
    for row in joined.splitlines():
        try:
            tokens = shlex.split(row, comments=True)
        except ValueError:
            tokens = row.split()
        command: list[str] = []
        for token in [*tokens, "&&"]:
            if token in ("&&", ";", "||"):
                if command:
                    out.append(shlex.join(command))
                command = []
            else:
                command.append(token)
    return out


def _oal_parts(tokens: list[str]) -> list[str] | None:
    """The arguments after the `oal` program in a command line (`oal`, `.venv/bin/oal`, `$(which oal)`, `-m oal`)."""
    for i, token in enumerate(tokens):
        if token in ("oal", ".venv/bin/oal", "oal)") and (i == 0 or token == "oal)" or tokens[i - 1] == "-m"):
            return tokens[i + 1:]
        if token.endswith("/oal") and i == 0:
            return tokens[i + 1:]
    return None


def _cli_problems(command: str, group) -> list[str]:
    tokens = shlex.split(command)
    args = _oal_parts(tokens)
    if args is None:
        return []
    root = {o for p in group.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    while args and args[0].startswith("-"):
        if args[0] not in root:
            return [f"{command}: oal has no option {args[0]}"]
        args = args[1:]
    if not args or args[0] not in group.commands:
        return [f"{command}: no command {args[:1]}"]
    sub = group.commands[args[0]]
    known = {o for p in sub.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    return [f"{command}: oal {args[0]} has no option {a}" for a in args[1:]
            if a.startswith("--") and a.split("=")[0] not in known]


def _tool_problems(command: str) -> list[str]:
    """`python -m benchmarks.X --opt` and `scripts/X.py --opt`: the tool exists and names each option."""
    tokens = shlex.split(command)
    source = None
    for i, token in enumerate(tokens):
        if token == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("benchmarks."):
            source = ROOT / (tokens[i + 1].replace(".", "/") + ".py")
        elif re.match(r"(scripts|benchmarks)/[\w.]+\.(py|sh)$", token):
            source = ROOT / token
        if source is not None:
            if not source.is_file():
                return [f"{command}: no {source.relative_to(ROOT)}"]
            texts = source.read_text() + "".join(p.read_text() for p in source.parent.glob("_*.py"))
            return [f"{command}: {source.name} has no option {a}" for a in tokens[i + 1:]
                    if a.startswith("--") and f'"{a.split("=")[0]}"' not in texts]
    return []


def test_every_command_of_a_bash_block_exists_with_its_options():
    import typer.main

    from oal.cli import load_commands

    group = typer.main.get_command(load_commands())
    problems, checked = [], 0
    for page in PAGES:
        for lang, text, line in blocks(page):
            if lang != "bash":
                continue
            for command in _command_lines(text):
                found = _cli_problems(command, group) + _tool_problems(command)
                checked += 1
                problems += [f"{_name(page)}:{line}: {p}" for p in found]
    assert checked > 30 and problems == []


def test_the_static_check_can_fail():
    import typer.main

    from oal.cli import load_commands

    group = typer.main.get_command(load_commands())
    assert _cli_problems("oal run --out x --no-such-option 1", group)
    assert _cli_problems(".venv/bin/oal frobnicate --out x", group)
    assert _cli_problems("torchrun --nproc_per_node 2 $(which oal) adapt --stepz 3", group)
    assert not _cli_problems("torchrun --nproc_per_node 2 $(which oal) adapt --steps 3", group)
    assert _tool_problems(".venv/bin/python -m benchmarks.operator --no-such-flag")
    assert _tool_problems(".venv/bin/python -m benchmarks.nothing")
    assert not _tool_problems(".venv/bin/python -m benchmarks.operator --no-tune")
