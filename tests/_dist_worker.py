"""One process of a multi-process test (tests/test_distributed.py), started by
`python -m torch.distributed.run --nproc_per_node N tests/_dist_worker.py SPEC.json`.

SPEC: {"mode": "adapt" | "calibrate" | "run" | "cli", "watch": folder, "audit": folder, ...}; "cfg_by_rank" and
"args_by_rank" (RANK -> settings) give a process settings or arguments of its own, "join_timeout_s" shortens
`oal.launch.JOIN_TIMEOUT`. Every process records the file-system writes it makes below `watch` (a Python audit
hook: file opens for writing, renames, removals, new folders and temporary files) and writes them to
`audit/rank<r>.json`, so the tests can check that only the main process wrote. The builders of the tiny models and
data live here, so the tests' one-process references use the same.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

VOCAB = 61
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# audit events that change the file system (every path argument is checked)
CHANGES = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate", "os.symlink", "os.link",
           "shutil.rmtree", "shutil.copyfile", "shutil.move", "tempfile.mkstemp", "tempfile.mkdtemp")


def record_writes(watch: str | Path) -> list:
    """Install an audit hook that appends [event, path] for every change below `watch`; returns that list."""
    root = os.path.join(str(Path(watch).resolve()), "")
    seen: list = []

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            paths = [path] if writes else []
        elif event in CHANGES:
            paths = list(args)
        else:
            return
        for p in paths:
            if isinstance(p, (str, os.PathLike)) and os.path.abspath(os.fspath(p)).startswith(root):
                seen.append([event, os.fspath(p)])

    sys.addaudithook(hook)
    return seen


# ------------------------------------------------------------------------------------------------ shared builders


def adapt_inputs():
    """A tiny converted model (OAL on layer 1) and its train / validation blocks (3 validation blocks: uneven
    shares across 2 processes)."""
    from test_adapt import _blocks, _tiny_model

    return _tiny_model(convert="oal"), _blocks(8, 12, 0), _blocks(3, 12, 1)


def calibration_inputs():
    """A tiny 3-layer GQA model, its calibration blocks and random groups for every layer."""
    from _tiny import tiny_model

    from oal.calibration.data import CalibConfig

    gen = torch.Generator().manual_seed(0)
    blocks = {"calib_train": torch.randint(0, VOCAB, (2, 24), generator=gen),
              "calib_val": torch.randint(0, VOCAB, (1, 24), generator=gen)}
    groups = {i: torch.randint(0, 3, (6, 8), generator=gen) for i in range(3)}
    kw = dict(groups=groups, cfg=CalibConfig.preset("tiny", max_steps=6, val_every=3), seed=0, base_model="tiny",
              provenance={}, progress=False)
    return tiny_model("qwen2", VOCAB), blocks, [0, 1, 2], ["oal", "global"], kw


# ------------------------------------------------------------------------------------------------ modes


def run_adapt(spec: dict) -> None:
    from oal.adaptation.config import AdaptConfig
    from oal.adaptation.train import adapt
    from oal.launch import ranks

    kill = spec.get("kill_after")

    def on_step(step):
        if step == kill and ranks().index == spec.get("kill_rank", 0):
            os._exit(3)  # the main process (or kill_rank) dies right after this update (and its checkpoint)

    model, train, val = adapt_inputs()
    cfg = {**spec["cfg"], **spec.get("cfg_by_rank", {}).get(os.environ.get("RANK", "0"), {})}  # a mismatched launch
    peft_model, res = adapt(model, train, val, AdaptConfig(**cfg), ckpt_dir=spec["ckpt"], progress=False,
                            on_step=on_step)
    from safetensors.torch import save_file

    out = Path(spec["result"])  # every process keeps its own result (outside `watch`): they must all agree
    save_file({n: p.detach().contiguous() for n, p in peft_model.named_parameters() if p.requires_grad},
              str(out / f"rank{ranks().index}.safetensors"))
    (out / f"rank{ranks().index}.json").write_text(json.dumps(res.to_dict()))


def run_calibrate(spec: dict) -> None:
    from oal.calibration.resume import calibrate_directory

    model, blocks, layers, methods, kw = calibration_inputs()
    calibrate_directory(spec["out"], model, blocks, layers, methods, **kw)


def run_pipeline(spec: dict) -> None:
    """`oal run` (the library call behind it; the CLI has no option for test_pipeline's tiny split plan)."""
    from test_pipeline import _cfg

    from oal.pipeline.runs import run

    run(_cfg(Path(spec["assets"]), adapt=spec["adapt"], methods=spec["methods"], layers=spec["layers"]), spec["out"],
        progress=False)


def run_cli(spec: dict) -> int:
    """The `oal` CLI; the adaptation updates this process runs are recorded in `audit/steps-rank<r>.json`, and with
    `kill_after` the main process dies right after that update (and its checkpoint), as in `run_adapt`."""
    import oal.pipeline.decoder
    from oal.cli import load_commands
    from oal.launch import ranks

    steps: list[int] = []
    train = oal.pipeline.decoder.adapt

    def on_step(step):
        steps.append(step)
        Path(spec["audit"], f"steps-rank{ranks().index}.json").write_text(json.dumps(steps))
        if step == spec.get("kill_after") and ranks().is_main:
            os._exit(3)

    oal.pipeline.decoder.adapt = lambda *args, **kw: train(*args, on_step=on_step, **kw)
    try:
        load_commands()(spec.get("args_by_rank", {}).get(os.environ.get("RANK", "0"), spec["args"]), prog_name="oal")
    except SystemExit as exc:
        return exc.code or 0
    return 0


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if "join_timeout_s" in spec:  # how long the processes wait for one another to start (oal.launch)
        from datetime import timedelta

        import oal.launch

        oal.launch.JOIN_TIMEOUT = timedelta(seconds=spec["join_timeout_s"])
    writes = record_writes(spec["watch"])
    modes = {"adapt": run_adapt, "calibrate": run_calibrate, "run": run_pipeline, "cli": run_cli}
    code = modes[spec["mode"]](spec) or 0
    rank = int(os.environ.get("RANK", "0"))
    Path(spec["audit"], f"rank{rank}.json").write_text(json.dumps(writes))
    return code


if __name__ == "__main__":
    sys.exit(main())
