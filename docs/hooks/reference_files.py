"""mkdocs hook: the site serves the committed reference figures (`benchmarks/reference/*.png`) from where they live,
as `reference/<name>.png`, so that the README, the benchmarks and the site show the same files (no copy to drift)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "benchmarks"  # its reference/ subfolder becomes the site's reference/


def on_files(files, config):
    for path in sorted((FOLDER / "reference").glob("*.png")):
        files.append(File(f"reference/{path.name}", src_dir=str(FOLDER), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
