"""Which page of the documentation site explains each command: `oal --help` and every command's `--help` end with
it (`app._Group` reads this mapping). The pages live in the repository's docs/ folder; `mkdocs serve` shows the
site. tests/test_docs_site.py checks that every command has a page here and that every page and anchor exists."""

from __future__ import annotations

# command -> page of docs/ (with an anchor where one section explains it); "" is `oal --help` itself
PAGES = {
    "": "reference/cli.md",
    "run": "getting-started.md#the-default-run",
    "analyze": "guides/regime.md",
    "calibrate": "guides/convert.md#stage-by-stage",
    "convert": "guides/convert.md#stage-by-stage",
    "generate": "guides/convert.md#stage-by-stage",
    "export": "guides/export.md",
    "evaluate": "guides/evaluation.md",
    "select-layers": "guides/layers-and-methods.md#which-layers-to-convert",
    "adapt": "guides/convert.md#adapting-a-run-again",
    "diagnose": "guides/regime.md#the-papers-diagnostics",
    "demo": "reference/cli.md#the-operator-demo",
    "fetch": "guides/convert.md#from-the-command-line",
    "tune-cpu": "performance/tuning.md",
}


# `oal --help` lists the commands in these panels, in this order (the order of a first session)
PANELS = {
    "The protocol": ("run", "fetch", "generate", "export", "evaluate", "adapt"),
    "Stage by stage": ("analyze", "calibrate", "convert", "select-layers"),
    "Diagnostics and tools": ("diagnose", "demo", "tune-cpu"),
}


# the options of the commands in OPTION_PANEL_COMMANDS (where each name means the same) in these panels, the rest
# under "Options"
OPTION_PANELS = {
    "Data": ("data", "data_dir"),
    "Conversion": ("grouping", "window", "sinks", "tail_fraction", "min_support", "min_ratio", "min_groups",
                   "n_bootstrap"),
    "Adaptation (LoRA and kernels)": ("steps", "val_every", "batch_size", "grad_accum", "lora_dropout"),
    "Zero-shot (PIQA, HellaSwag, ARC-E)": ("zeroshot", "tasks", "limit", "zeroshot_dir", "task_file", "log_samples"),
    "Passkey retrieval": ("passkey", "passkey_depths", "passkey_trials", "lengths", "depths", "trials"),
    "Device and runtime": ("device", "dtype", "threads", "progress"),
}
OPTION_PANEL_COMMANDS = ("run", "evaluate", "adapt", "calibrate", "select-layers")
# a command's own panels, before OPTION_PANELS: `oal calibrate --val-every` is calibration's (it was listed under
# adaptation, beside none of the calibration budgets it goes with)
OWN_PANELS = {"calibrate": {"Calibration budgets": ("paper", "max_steps", "val_every", "patience")}}


def arrange(name: str, command) -> None:
    """Dress `command` for its help: the page that explains it last, one line in `oal --help` under its panel, and
    the options of a long command in panels."""
    command.epilog = docs_line(name)
    command.short_help = command.short_help or short_help(command.help or "")
    command.rich_help_panel = next((p for p, names in PANELS.items() if name in names), None)
    if name in OPTION_PANEL_COMMANDS:
        for param in command.params:
            param.rich_help_panel = next((p for panels in (OWN_PANELS.get(name, {}), OPTION_PANELS)
                                          for p, names in panels.items() if param.name in names), None)


def short_help(text: str) -> str:
    """A command's line in `oal --help`: its help up to the first '. ' or '; ' outside parentheses, on one line."""
    text, depth = " ".join(text.split()), 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and ch in ".;" and text[i + 1 : i + 2] in (" ", ""):
            return text[:i] + "."
    return text


def docs_line(command: str) -> str:
    """The help's last line for `command` ("" for the command line itself)."""
    return f"Docs: docs/{PAGES[command]} in the oal repository (`mkdocs serve` shows the site)."
