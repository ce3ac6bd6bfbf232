"""`python -m oal.lm_eval ARGS`: lm-eval's own command line (every option: --include_path, --log_samples,
--output_path, batch sizes, ...) with oal's converted model types registered first, so that

    python -m oal.lm_eval --model hf --model_args pretrained=converted/ --tasks piqa

scores the converted model: lm-eval's HFLM loads the folder with AutoModelForCausalLM, which `import oal` taught the
"oal_<family>" types (the folder's hashes are checked on load). The arguments go to lm-eval's `cli_evaluate` as
they are, with two exceptions: without `--device`, the device is the available one (CUDA when torch sees a GPU,
else the CPU; lm-eval's own default is CUDA), and bad input (a missing `pretrained=` folder, an `oal run` directory
instead of an export, an encoder's export, an unknown task, an export whose files fail their SHA256) is one line,
`Error: ...`, with exit code 2 instead of a traceback (`OAL_DEBUG=1` shows the traceback). A plain transformers
folder (the base model, to score beside its conversion) goes to lm-eval as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import oal  # noqa: F401  (registers the oal_* model types with transformers' Auto classes)
from oal.errors import env_flag


def _option(args: list[str], name: str) -> str | None:
    """The value of `name` in `args` (`--name VALUE` or `--name=VALUE`), or None."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def _check_pretrained(args: list[str]) -> None:
    """Refuse, before lm-eval starts, a `pretrained=` that is a local path but not a converted-model folder."""
    from oal.calibration.kernels import META_FILE as KERNELS_META
    from oal.models.families import is_encoder_type
    from oal.models.pretrained import MANIFEST
    from oal.rundir.claim import is_run_dir

    model_args = _option(args, "--model_args") or ""
    pretrained = next((kv.split("=", 1)[1].strip() for kv in model_args.split(",")
                       if kv.strip().startswith("pretrained=")), None)
    if not pretrained:
        return
    path = Path(pretrained).expanduser()
    # a hub id is "name" or "owner/name": a trailing slash or a deeper path is a folder
    looks_local = (path.is_absolute() or pretrained.startswith(("./", "../", "~")) or path.exists()
                   or pretrained.endswith("/") or pretrained.count("/") > 1)
    if looks_local and not path.is_dir():
        raise ValueError(f"--model_args pretrained={pretrained}: no such folder")
    # a model folder's config.json names its model_type; a run's records its configuration instead
    model_type = _model_type(path) or ""
    run_like = (is_run_dir(path) or (path / KERNELS_META).is_file()) and not model_type
    if path.is_dir() and not (path / MANIFEST).is_file() and run_like:
        raise ValueError(f"--model_args pretrained={pretrained}: a run directory (kernels, no oal.json), not a "
                         f"converted model; write one with `oal export --out {pretrained} --to DIR` and score DIR")
    if model_type.startswith("oal_") and is_encoder_type(model_type):
        raise ValueError(f"--model_args pretrained={pretrained}: an encoder ({model_type}), which lm-eval's causal-LM "
                         f"tasks cannot score; `oal run` measures an encoder's fidelity and embedding agreement")


def _model_type(path: Path) -> str | None:
    """The `model_type` of `path/config.json` (a transformers model folder), or None."""
    import json

    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data.get("model_type") if isinstance(data, dict) else None


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("Error: lm-eval is not installed; install it with `pip install 'oal-attention[eval]'` (or `pip install "
              "lm-eval`)", file=sys.stderr)
        raise SystemExit(2) from None
    if _option(args, "--device") is None and "-h" not in args and "--help" not in args:
        import torch

        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]
    sys.argv = ["python -m oal.lm_eval", *args]
    try:
        _check_pretrained(args)
        cli_evaluate()
    except (ValueError, OSError) as exc:
        if show_traceback():
            raise
        print(f"Error: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(2) from None


def show_traceback() -> bool:
    """`OAL_DEBUG` set to anything but "" or "0" (as the other OAL_ switches, 0 is off)."""
    return env_flag("OAL_DEBUG", False)


if __name__ == "__main__":
    main()
