"""Peak memory of one joint LoRA + kernel adaptation step at the paper's length, on CPU, phase by phase.

A model of a published shape (random weights from its config, no download) cut to `--layers` decoder layers, the
last one converted to OAL with random but valid kernels (`benchmarks.model.random_kernels`), is wrapped in LoRA as
`oal.adaptation.train.wrap_lora` does (q/k/v/o, kernel parameters trainable) and takes one update on one block of
`--seq-len` random tokens: forward + loss, backward, AdamW step; then the validation NLL of one block (what the
perplexity evaluation computes per block). The loss is `oal.evaluate.loss` (`--loss chunked`, what adaptation and
perplexity use) or transformers' own `model(ids, labels=ids).loss` over the whole [N, V] logits (`--loss full`,
the code before issue 24). `--compare-full` also runs the full-logits step in a child process (the peak RSS of a
process cannot be reset) and reports both.

Writes `{"peak_rss_gb": ..., "phases": {...}, "compared": {...}, "complete": ...}` to --json (peak RSS of the
process, GB = 1e9 bytes; per phase the RSS at its end, its own peak above its start, and seconds; `compared`: the
full-logits step of --compare-full), a PNG beside it and prints a table (without --json, the table only). With
--compare-full the JSON is written before the comparison too, with `"complete": false` until it is in.

    python -m benchmarks.memory --shape qwen2.5-0.5b --layers 1 --seq-len 4096 --json OUT.json
    python -m benchmarks.memory --shape qwen2.5-0.5b --layers 1 --seq-len 4096 --json OUT.json --compare-full
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse

from benchmarks._common import MAX_TOKENS, ToolParser, int_in, output_file, run_tool

OUTPUTS = ("with --json, the result there and a PNG beside it; the table on stdout")
SHAPE_NAMES = ("llama-3.2-1b", "qwen2.5-0.5b")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(__doc__, OUTPUTS)
    parser.add_argument("--shape", choices=SHAPE_NAMES, default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int_in(1, 4096), default=1,
                        help="decoder layers (the last one converted), at most the shape's")
    parser.add_argument("--seq-len", type=int_in(2, MAX_TOKENS), default=4096)
    parser.add_argument("--loss", choices=("chunked", "full"), default="chunked")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--compare-full", action="store_true", help="also run the full-logits step (a child)")
    parser.add_argument("--json", type=output_file, help="write the result here (and a PNG beside it)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import json
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks._common import PeakRSS, child_json, environment, finish_figure
from benchmarks.model import QWEN_SHAPE, random_kernels

GOAL_GB = 3.0  # issue 24: one adaptation step of Qwen2.5-0.5B's shape, 1 layer, N = 4096
SHAPES = {  # transformers config values (the published checkpoints' config.json; see scripts/scale_rehearsal.py)
    "qwen2.5-0.5b": ("qwen2", QWEN_SHAPE),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                                   rope_theta=5e5, tie_word_embeddings=True, max_position_embeddings=131072)),
}
assert tuple(sorted(SHAPES)) == SHAPE_NAMES  # --shape's choices, named before the imports
PHASES = ("build", "convert", "forward + loss", "backward", "optimizer step", "validation block")


def _phases(result: dict) -> list[str]:
    """The phases in the order they ran (a JSON read back is key-sorted: the table and figure keep this order)."""
    return [p for p in PHASES if p in result["phases"]]


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def _max_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


class Phases:
    """Each `with phases("name"):` block: RSS at its end, its own peak above its start, seconds."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def __call__(self, name: str):
        phases = self

        class _Phase(PeakRSS):
            def __enter__(self):
                self.t0 = time.perf_counter()
                return super().__enter__()

            def __exit__(self, *exc):
                super().__exit__(*exc)
                phases.rows[name] = {"rss_gb": _rss_gb(), "peak_above_start_gb": self.peak_mib * 2**20 / 1e9,
                                     "seconds": time.perf_counter() - self.t0}

        return _Phase()


def step(shape: str, layers: int, seq_len: int, loss_kind: str, dtype: torch.dtype) -> dict:
    """One adaptation step and one validation block, measured; the result dict (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from oal.adaptation.config import AdaptConfig
    from oal.adaptation.train import wrap_lora
    from oal.evaluate.loss import CausalLMLoss
    from oal.evaluate.perplexity import block_nll
    from oal.models.convert import convert

    phases = Phases()
    start_gb = _rss_gb()
    model_type, values = SHAPES[shape]
    with phases("build"):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, **{**values, "num_hidden_layers": layers})
        model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    with phases("convert"):
        convert(model, methods=random_kernels(model, [layers - 1]))
        model, _ = wrap_lora(model, AdaptConfig(steps=1))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    model.train()
    loss_fn = CausalLMLoss(model) if loss_kind == "chunked" else (lambda x: model(input_ids=x, labels=x).loss)
    with phases("forward + loss"):
        loss = loss_fn(ids)
    with phases("backward"):
        loss.backward()
    with phases("optimizer step"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del loss
    with phases("validation block"):
        if loss_kind == "chunked":
            total, count = block_nll(model, ids)
        else:  # the pre-issue-24 perplexity: full logits, upcast, one cross-entropy
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, :-1].float()
                total = float(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum"))
                count = seq_len - 1
            del logits
    n_params = sum(p.numel() for p in model.parameters())
    goal = GOAL_GB if (shape, layers, seq_len) == ("qwen2.5-0.5b", 1, 4096) else None
    return {"shape": shape, "layers": layers, "converted_layer": layers - 1, "seq_len": seq_len, "loss": loss_kind,
            "dtype": str(dtype).removeprefix("torch."), "parameters": n_params, "trainable_tensors": len(params),
            "trainable_parameters": sum(p.numel() for p in params), "vocab_size": cfg.vocab_size,
            "val_nll": total / count, "rss_at_start_gb": start_gb, "peak_rss_gb": _max_rss_gb(),
            "phases": phases.rows, "goal_gb": goal}


def _child(args, loss_kind: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--shape", args.shape, "--layers", str(args.layers),
           "--seq-len", str(args.seq_len), "--loss", loss_kind, "--dtype", args.dtype, "--child"]
    return child_json(cmd, f"the {loss_kind} child")


def _table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"One adaptation step + one validation block: {results[0]['shape']}, {results[0]['layers']} "
                        f"layer(s), N = {results[0]['seq_len']}, {results[0]['dtype']} (CPU; RSS in GB)")
    table.add_column("phase")
    for r in results:
        table.add_column(f"{r['loss']}: RSS at end")
        table.add_column(f"{r['loss']}: own peak")
        table.add_column(f"{r['loss']}: s")
    for name in _phases(results[0]):
        table.add_row(name, *[f"{x:.2f}" for r in results for x in (r["phases"][name]["rss_gb"],
                                                                     r["phases"][name]["peak_above_start_gb"],
                                                                     r["phases"][name]["seconds"])])
    table.add_row("[bold]process peak", *[c for r in results for c in (f"[bold]{r['peak_rss_gb']:.2f}", "", "")])
    Console().print(table)
    goal = results[0]["goal_gb"]
    if goal is not None:
        print(f"goal: peak RSS <= {goal} GB with the chunked loss: {results[0]['peak_rss_gb']:.2f} GB "
              f"({'met' if results[0]['peak_rss_gb'] <= goal else 'NOT met'})")


def _figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _phases(results[0])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [r["phases"][n]["rss_gb"] for n in names], width,
               alpha=0.35, label=f"{r['loss']}: RSS at end of phase")
        ax.bar(xs, [r["phases"][n]["peak_above_start_gb"] for n in names], width * 0.5,
               label=f"{r['loss']}: own peak (process peak {r['peak_rss_gb']:.2f} GB)")
    if results[0]["goal_gb"] is not None:
        ax.axhline(results[0]["goal_gb"], color="k", ls="--", lw=1, label=f"goal {results[0]['goal_gb']} GB")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_ylabel("GB")
    finish_figure(fig, [ax], f"{results[0]['shape']}, {results[0]['layers']} layer(s), N = {results[0]['seq_len']}",
                  path)


def main(args: argparse.Namespace) -> None:
    most = SHAPES[args.shape][1]["num_hidden_layers"]
    if args.layers > most:
        raise ValueError(f"--layers: {args.shape} has {most} decoder layers, got {args.layers}")
    if args.child:
        print(json.dumps(step(args.shape, args.layers, args.seq_len, args.loss, getattr(torch, args.dtype))))
        return
    results = [_child(args, args.loss)]  # a fresh process: its peak RSS is this step's alone
    compare = args.compare_full and args.loss != "full"
    # before the (long) comparison, so that an interrupted one loses nothing; marked partial until the last write
    _write(args.json, results, complete=not compare)
    if compare:
        results.append(_child(args, "full"))
        _write(args.json, results, complete=True)
    _table(results)


def _write(path: Path | None, results: list[dict], complete: bool) -> None:
    if path is None:
        return
    from oal.rundir.files import atomic_write_json

    goal = results[0]["goal_gb"]
    atomic_write_json(path, dict(results[0], compared={r["loss"]: r for r in results[1:]}, complete=complete,
                                 goal_met=results[0]["peak_rss_gb"] <= goal if goal is not None else None,
                                 environment=environment()))
    _figure(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_tool(main, ARGS)
