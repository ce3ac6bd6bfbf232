"""What every section of a report shares: the methods' display names and order, the paper's numbers, and the
formatting of numbers and markdown tables."""

from __future__ import annotations

from pathlib import Path

from oal.pipeline.records import read_record

__all__ = ["DISPLAY", "ORDER", "PAPER_TABLE2_QWEN", "PAPER_TABLE3_QWEN", "display_name", "fmt", "markdown_table",
           "ordered", "read_optional"]


DISPLAY = {"softmax": "Softmax (LoRA)", "performer": "Performer", "spectraformer": "SpectraFormer",
           "dijiang": "DiJiang", "taylorshift": "TaylorShift", "global": "Learned global", "oal": "OAL",
           "swa": "Sliding window (SWA)", "global-swa": "Window + learned global", "oal-swa": "Window + OAL (hybrid)"}


ORDER = ("softmax", "performer", "spectraformer", "dijiang", "taylorshift", "global", "oal", "swa", "global-swa",
         "oal-swa")


# Paper Table 3, Qwen2.5-0.5B column group: WikiText-103 test PPL and zero-shot normalised accuracy (%).
PAPER_TABLE3_QWEN = {
    "softmax": (10.89, 70.18, 51.38, 62.63),
    "performer": (37.03, 57.78, 30.37, 38.93),
    "spectraformer": (34.78, 59.19, 31.77, 41.84),
    "dijiang": (36.05, 59.90, 31.47, 41.41),
    "taylorshift": (39.50, 59.90, 31.18, 40.78),
    "global": (31.71, 61.15, 32.43, 41.41),
    "oal": (27.50, 64.69, 37.20, 50.38),
}


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


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
