"""Options shared by several CLI commands, `name: ModelOpt = "default"` (one declaration each: one help, one check)."""

from __future__ import annotations

from typing import Annotated

import typer

from oal.cli.bounds import Max, parse_numbers, positive_examples  # noqa: F401  (the commands import them here)

ModelOpt = Annotated[str, typer.Option(help="'default' (embedded model), a local HF folder or a pinned hub id.")]
BaseModelOpt = Annotated[str, typer.Option(help="Base model (default: the one recorded in kernels.json).")]
DataOpt = Annotated[str, typer.Option(help="Corpus: 'builtin', a WikiText config, or a local file or folder of text, "
                                      "JSON-lines or parquet (docs/guides/evaluation.md).")]
DataDirOpt = Annotated[str, typer.Option(help="Local WikiText folder (with manifest) for WikiText corpora.")]
LayersOpt = Annotated[str, typer.Option(help="'all', '3-20' or '1,4,7'. Default: the preset's conversion layers.")]


def comma_names(spec: str, allowed, option: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`; a one-line error on `option` otherwise."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if not names or set(names) - set(allowed):
        raise typer.BadParameter(f"expected a comma list of {', '.join(allowed)}, got {spec!r}", param_hint=option)
    return names


def _device_callback(value: str | None) -> str:
    from oal.device import resolve_device

    try:
        return str(resolve_device(value))
    except ValueError as exc:
        from oal.errors import message_of

        raise typer.BadParameter(message_of(exc), param_hint="--device") from None


def dtype_choice(value: str | None) -> str | None:
    from oal.device import DTYPES

    if value is not None and value not in DTYPES:
        raise typer.BadParameter(f"expected one of {', '.join(DTYPES)}, got {value!r}", param_hint="--dtype")
    return value


# --device auto resolves to "cuda" when this torch sees a GPU, else "cpu"; a device this build lacks is a clean
# usage error. --dtype is the base model's dtype; kernels, LoRA and calibration stay float32 (oal.device).
DeviceOpt = Annotated[str, typer.Option(callback=_device_callback,
                                        help="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:N'.")]
DtypeOpt = Annotated[str, typer.Option(callback=dtype_choice,
                                       help="Base model dtype: float32, bfloat16 or float16 (kernels, LoRA and "
                                       "calibration stay float32).")]
RunDtypeOpt = Annotated[str, typer.Option("--dtype", callback=dtype_choice,
                                          help="Base model dtype (default: the run's own). The run recorded its "
                                          "base model's weights in that dtype, so another one is refused where "
                                          "its weights differ.")]
GroupingOpt = Annotated[str, typer.Option(help="'app-b': App. B stable-gap groups (the paper's protocol); "
                                          "'app-b-pairs': App. B over RoPE's rotation pairs, each pair (r, r + d/2) "
                                          "in one group, so outputs depend on relative positions only; "
                                          "'budget:G': Fig. 2(b)'s fixed budget of G groups per head, cut at the "
                                          "G - 1 largest contribution gaps (both departures from the paper).")]
AdapterOpt = Annotated[bool | None, typer.Option(
    "--adapter/--no-adapter", help="Use the run's LoRA adapter and trained kernels for the method (default: when "
    "the run has one; --adapter requires it, --no-adapter: the calibrated kernels, or softmax's base model, alone).")]
ThreadsOpt = Annotated[int, typer.Option(min=0, max=Max.THREADS, help="CPU threads for torch; 0 keeps torch's "
                                         "default. One thread is the predictable choice on a small or shared CPU "
                                         "(oversubscribed threads stall).")]
# Adaptation batch (App. F.2 uses 1 x 1 with dropout 0.05); under torchrun / accelerate launch the global batch of an
# update is batch size x processes x grad accum.
BatchSizeOpt = Annotated[int, typer.Option(min=1, max=Max.BATCH, help="Adaptation blocks per process and "
                                           "micro-batch (default: 1; an update averages batch size x processes x "
                                           "grad accum blocks).")]
GradAccumOpt = Annotated[int, typer.Option(min=1, max=Max.BATCH, help="Micro-batches accumulated per adaptation "
                                           "update (default: 1).")]
LoraDropoutOpt = Annotated[float, typer.Option(min=0.0, max=0.99, help="LoRA dropout (default: 0.05; 0 makes "
                                               "several processes reproduce one process exactly).")]
# zero-shot PIQA / HellaSwag / ARC-E (App. F.3), shared by `oal run` and `oal evaluate --zeroshot`
TasksOpt = Annotated[str, typer.Option(help="Zero-shot tasks: 'all', 'none' or some of piqa,hellaswag,arc_easy.")]
LimitOpt = Annotated[int, typer.Option(max=Max.COUNT, callback=positive_examples, help="Only the first N "
                                       "examples of each zero-shot task (a quick run; the report says so).")]
ZeroshotDirOpt = Annotated[str, typer.Option(help="Local folder of the pinned zero-shot files: DIR/<task>/<file in "
                                             "the hub repo> plus manifest.json (oal.data.zeroshot.write_manifest).")]
TaskFileOpt = Annotated[list[str], typer.Option(help="TASK=PATH.jsonl: a local JSON-lines file in the dataset's own "
                                                "schema instead of the pinned set (unverified; its SHA256 is "
                                                "recorded). Repeat for several tasks.")]
# the sliding windows (swa, oal-swa, global-swa): recorded in config.json; other methods ignore them
# show_default=False: the help names the default, also where a command's own default is None (the run's)
WindowOpt = Annotated[int, typer.Option(min=1, max=Max.WINDOW, show_default=False,
                                        help="Sliding window W of swa, oal-swa and global-swa: the last W keys get "
                                             "exact softmax weights (default: 64).")]
SinksOpt = Annotated[int, typer.Option(min=0, max=Max.WINDOW, show_default=False,
                                       help="Attention sinks S of swa, oal-swa and global-swa: the first S keys get "
                                            "exact softmax weights beside the window (default: 4).")]
StepsOpt = Annotated[int, typer.Option(min=1, max=Max.STEPS, help="Adaptation updates per arm (default: preset's).")]
ValEveryOpt = Annotated[int, typer.Option(min=1, max=Max.STEPS, help="Updates per validation (default: preset's).")]
SelectByOpt = Annotated[str, typer.Option(help="With --layers auto:K: rank layers by 'fidelity' (frozen-attention "
                                          "RelMSE after W_o) or 'probe' (val PPL with that layer alone converted).")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars (on stderr; "
                                           "`oal --quiet` or `oal --no-progress` turns them off by default).")]


def main_console():
    """A rich console that prints on the main process of a launch only (the other processes compute silently)."""
    from rich.console import Console

    from oal.launch import env_rank

    return Console(quiet=env_rank() != 0)


def set_threads(threads: int | None) -> None:
    """Thread count is a runtime choice, not part of the run's configuration. Reductions may round differently
    with another count, so resume a killed run with the same --threads for bit-identical results."""
    if threads is None or threads == 0:
        return
    if threads < 0:
        raise typer.BadParameter(f"expected >= 0, got {threads}", param_hint="--threads")
    import torch

    torch.set_num_threads(threads)
