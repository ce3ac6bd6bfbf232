"""What every section of a report shares: the methods' display names and order, the paper's numbers, and the
formatting of numbers and markdown tables."""

from __future__ import annotations

from pathlib import Path

from oal.pipeline.records import read_record

__all__ = ["DISPLAY", "ORDER", "PAPER_TABLE2_QWEN", "PAPER_TABLE3", "PAPER_TABLE3_LLAMA", "PAPER_TABLE3_QWEN",
           "display_name", "distinct_digits", "fmt", "fmt_pm", "fmt_std", "markdown_table", "ordered", "read_optional"]


DISPLAY = {"softmax": "Softmax (LoRA)", "performer": "Performer", "spectraformer": "SpectraFormer",
           "dijiang": "DiJiang", "taylorshift": "TaylorShift", "global": "Learned global", "oal": "OAL",
           "swa": "Sliding window (SWA)", "global-swa": "Window + learned global", "oal-swa": "Window + OAL (hybrid)"}


ORDER = ("softmax", "performer", "spectraformer", "dijiang", "taylorshift", "global", "oal", "swa", "global-swa",
         "oal-swa")


# Paper Table 3 as printed: per method, the Qwen2.5-0.5B then the Llama-3.2-1B column group, each WikiText-103 test
# PPL and zero-shot normalised accuracy (%) on PIQA, HellaSwag, ARC-E.
_TABLE3 = """
softmax        10.89 70.18 51.38 62.63   8.19 74.92 62.84 59.43
performer      37.03 57.78 30.37 38.93  50.39 57.07 27.42 32.58
spectraformer  34.78 59.19 31.77 41.84  45.09 59.36 30.41 36.49
dijiang        36.05 59.90 31.47 41.41  56.27 58.92 28.75 36.32
taylorshift    39.50 59.90 31.18 40.78  62.67 57.40 28.95 35.77
global         31.71 61.15 32.43 41.41  36.03 57.40 35.02 33.46
oal            27.50 64.69 37.20 50.38  32.99 63.66 35.42 41.67
"""
_ROWS = {m: tuple(float(v) for v in vals) for m, *vals in (line.split() for line in _TABLE3.strip().splitlines())}
PAPER_TABLE3_QWEN = {m: v[:4] for m, v in _ROWS.items()}
PAPER_TABLE3_LLAMA = {m: v[4:] for m, v in _ROWS.items()}

# The backbone each preset follows -> its Table 3 column group; other models are compared with Qwen2.5-0.5B's.
PAPER_TABLE3 = {"qwen2.5-0.5b": ("Qwen2.5-0.5B", PAPER_TABLE3_QWEN),
                "llama-3.2-1b": ("Llama-3.2-1B", PAPER_TABLE3_LLAMA)}


# Paper Table 2 (Qwen2.5-0.5B, all query heads of layers 4, 12, 20, N = 4096): MSE, RelMSE before/after W_o.
PAPER_TABLE2_QWEN = {
    "performer": (0.103, 0.569, 0.038, 0.710),
    "spectraformer": (0.106, 0.585, 0.041, 0.772),
    "dijiang": (0.086, 0.474, 0.033, 0.631),
    "taylorshift": (0.088, 0.490, 0.034, 0.649),
    "oal": (0.078, 0.432, 0.031, 0.595),
}


def read_optional(path: Path) -> dict | None:
    """The JSON object a report reads from `path`, None when there is none; a damaged file is a ValueError naming
    it (a section drawn from a list or a number would fail further on, without saying which file)."""
    return read_record(path, "a JSON object written by oal") if path.exists() else None


def ordered(methods) -> list[str]:
    return [m for m in ORDER if m in methods] + [m for m in methods if m not in ORDER]


def display_name(m: str) -> str:
    return DISPLAY.get(m, m)


def fmt(x, digits=4) -> str:
    """Fixed decimals, or scientific notation for values that would print as 0.0000."""
    if x is None:
        return "-"
    return f"{x:.{digits - 1}e}" if 0 < abs(x) < 10 ** (-digits + 1) else f"{x:.{digits}f}"


def distinct_digits(values, digits: int, most: int = 8) -> int:
    """The fewest decimals (at least `digits`) at which `fmt` tells apart every pair of different values in a
    column, so rounding never shows two methods as equal when they were not (up to `most`)."""
    vals = sorted({v for v in values if v is not None})
    for d in range(digits, most + 1):
        if len({fmt(v, d) for v in vals}) == len(vals):
            return d
    return most


def fmt_std(std, digits=4) -> str:
    """A spread over seeds with two significant digits however small (a std of 3e-06 beside a mean of 0.0649 must
    not print as 0.0000); an exact 0 prints as 0 (the seeds agreed)."""
    if std == 0:
        return "0"
    return f"{std:.2g}" if abs(std) < 10 ** (-digits + 1) else f"{std:.{digits}f}"


def fmt_pm(mean, std, digits=4) -> str:
    """`mean ± std` (`fmt`, `fmt_std`); the mean alone when `std` is None."""
    return fmt(mean, digits) if std is None or mean is None else f"{fmt(mean, digits)} ± {fmt_std(std, digits)}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
