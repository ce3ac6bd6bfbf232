"""`python -m oal.lm_eval ARGS`: lm-eval's own command line (every option: --include_path, --log_samples,
--output_path, batch sizes, ...) with oal's converted model types registered first, so that

    python -m oal.lm_eval --model hf --model_args pretrained=converted/ --tasks piqa

scores the converted model: lm-eval's HFLM loads the folder with AutoModelForCausalLM, which `import oal` taught the
"oal_<family>" types (the folder's hashes are checked on load). The arguments go to lm-eval's `cli_evaluate` as
they are, with two exceptions: without `--device`, the device is the available one (CUDA when torch sees a GPU,
else the CPU; lm-eval's own default is CUDA), and bad input (a missing `pretrained=` folder, an `oal run` directory
instead of an export, an encoder's export, an unknown task, an export whose files fail their SHA256, no `pretrained=`,
a `dtype=` torch lacks, a GPU `--device` torch cannot use, a task whose data the offline hub cannot give) is one line,
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


def _model_args(args: list[str]) -> dict[str, str]:
    """The `--model_args` (`-a`) of `args` as lm-eval reads them: `k=v,k2=v2` or `k=v k2=v2` (several values after
    one flag), every occurrence merged, later keys winning."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a, i = args[i], i + 1
        if a in ("--model_args", "-a") or a.startswith("--model_args="):
            if "=" in a:  # --model_args=k=v
                values = [a.partition("=")[2]]
            else:
                values, i = args[i:i + 1], i + 1
            # then any more `k=v` words (lm-eval's nargs="+")
            while i < len(args) and not args[i].startswith("-") and "=" in args[i]:
                values.append(args[i])
                i += 1
            for kv in ",".join(values).split(","):
                if "=" in kv:
                    key, _, value = kv.partition("=")
                    out[key.strip()] = value.strip()
    return out


def _check_pretrained(args: list[str]) -> None:
    """Refuse, before lm-eval starts, a `pretrained=` that is a local path but not a converted-model folder."""
    from oal.calibration.kernels import META_FILE as KERNELS_META
    from oal.models.families import is_encoder_type
    from oal.models.pretrained import MANIFEST
    from oal.rundir.claim import is_run_dir

    model_args = _model_args(args)
    _check_hf_options(args, model_args)
    pretrained = model_args.get("pretrained")
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


def _check_hf_options(args: list[str], model_args: dict[str, str]) -> None:
    """Refuse what lm-eval's hf model would meet with a traceback: no `pretrained=` (HFLM's TypeError), a `dtype=`
    torch lacks (AttributeError), a CUDA `--device` torch cannot use (AssertionError)."""
    import torch

    if (_option(args, "--model") or "hf") not in ("hf", "hf-auto", "huggingface"):
        return
    tasks = _option(args, "--tasks")
    if tasks and not tasks.startswith("list") and not model_args.get("pretrained"):
        raise ValueError("--model_args: name the model with pretrained=DIR (an `oal export` folder, or a "
                         "transformers model folder or hub id)")
    dtype = model_args.get("dtype", "auto").strip()
    if dtype != "auto" and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"--model_args dtype={dtype}: not a torch dtype; expected auto, float32, bfloat16 or float16")
    device = _option(args, "--device")
    try:
        dev = torch.device(device) if device else None
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device}: not a torch device; expected cpu, cuda or cuda:N") from None
    if dev is not None and dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s); leave --device out "
                         "(the available device is used) or pass --device cpu")


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
        print(f"Error: {' '.join(str(exc).split())}{_OFFLINE if isinstance(exc, ConnectionError) else ''}",
              file=sys.stderr)
        raise SystemExit(2) from None


# `datasets` says only that it could not reach a task's dataset; where a run with the hub reachable leaves it for
# offline ones (datasets reads its own cache when the hub is offline)
_OFFLINE = ("; lm-eval loads its tasks' data from the hub with `datasets`: run this command once where the hub is "
            "reachable (the data stays in HF_DATASETS_CACHE, which offline runs read), or give the task local files "
            "(--include_path DIR with a task YAML: docs/guides/evaluation.md#lm-eval)")


def show_traceback() -> bool:
    """`OAL_DEBUG` set to anything but "" or "0" (as the other OAL_ switches, 0 is off)."""
    return env_flag("OAL_DEBUG", False)


if __name__ == "__main__":
    main()
