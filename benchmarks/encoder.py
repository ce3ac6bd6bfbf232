"""Encoder run: what calibration bought. Taylor start vs learned global vs OAL on the run's held-out passages.

Reads an encoder run directory (`oal run --model ENCODER_DIR --out RUN`), rebuilds the base encoder, the passages
and the calibrated kernels from its files, and adds the uncalibrated start: the second-order Taylor kernel
1 + s + s^2/2 (G = 1), which is also OAL's Taylor start on any groups. For each it reports frozen-attention fidelity
(Eq. 21-22, non-causal, padding masked) and the cosine of mean- and [CLS]-pooled embeddings against the original.
Writes `--out` (default benchmarks/results/encoder_<model folder name>.json) with the run it read (`run`: the
folder and the SHA256 of its config.json and of the kernel files read; `base_model`: the encoder folder loaded,
the SHA256 of its files and tensors, which must be those the kernels record), a PNG beside it (RelMSE, and 1 - cosine
of the pooled embeddings, per kernel) and prints a table.

    .venv/bin/python -m benchmarks.encoder RUN_DIR
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
import copy
from pathlib import Path

from benchmarks._common import ToolParser, environment, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the comparison (--out; default benchmarks/results/encoder_<model folder name>.json) and a "
           "PNG beside it; the table on stdout")
KERNELS = ("oal", "global")  # the run's calibrated kernels compared
ORDER = ("taylor", *KERNELS)  # the figure's order (a JSON read back is key-sorted)


def _run_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a run directory (no config.json)")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, OUTPUTS)
    ap.add_argument("run_dir", type=_run_dir, help="an encoder run directory (`oal run --model ENCODER_DIR`)")
    ap.add_argument("--out", type=output_file, help="the JSON to write")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import transformers
from rich.console import Console
from rich.table import Table

from benchmarks._common import finish_figure
from oal.calibration.kernels import KERNELS_FILE, META_FILE, check_kernels_base, kernel_dir, load_kernels
from oal.data import load_corpus
from oal.data.passages import PassagePlan, plan_passages, tokenize_passages
from oal.evaluate.embedding import embedding_similarity
from oal.evaluate.fidelity import fidelity
from oal.methods import build_method
from oal.models.convert import convert
from oal.models.encoder import load_encoder
from oal.ops.kernel import taylor_factor
from oal.rundir.files import atomic_write_json, load_json
from oal.rundir.hashes import sha256_tree


def taylor_start(calibrated: dict) -> dict:
    """layer -> the Taylor kernel eps + 1 + s + s^2/2 (G = 1); OAL's Taylor start on any groups is the same kernel."""
    return {layer: build_method("global", m.n_heads, m.n_kv_heads, m.head_dim, factor=taylor_factor(m.n_heads, 1),
                                layer_idx=layer) for layer, m in calibrated.items()}


def provenance(run_dir: Path) -> dict:
    """The run the numbers came from: its folder and the SHA256 of the files read (config.json, each kernel set)."""
    files = ["config.json"] + [str((kernel_dir(run_dir, m) / f).relative_to(run_dir)) for m in KERNELS
                               for f in (META_FILE, KERNELS_FILE)]
    return {"dir": str(run_dir.resolve()), "sha256": {k: v for f in files for k, v in sha256_tree(run_dir, f).items()}}


def plot(result: dict, path: Path) -> None:
    """RelMSE (before and after W_o) and 1 - cosine of the pooled embeddings against the original, per kernel."""
    names = [m for m in ORDER if m in result["methods"]]
    fig, (ax, cx) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(names))
    for i, (key, label) in enumerate((("relmse", "RelMSE"), ("relmse_post_o", "RelMSE after W_o"))):
        ax.bar([x + 0.4 * i for x in xs], [result["methods"][m][key] for m in names], 0.4, label=label)
    for i, (pool, label) in enumerate((("mean", "mean-pooled"), ("cls", "[CLS]"))):
        cx.bar([x + 0.4 * i for x in xs], [1 - result["methods"][m]["cosine"][pool]["mean"] for m in names], 0.4,
               label=f"{label}: 1 - mean cosine")
    for a, label in ((ax, "frozen-attention fidelity (lower is better)"), (cx, "embedding distance (lower is better)")):
        a.set_xticks([x + 0.2 for x in xs], names)
        a.set_ylabel(label)
    finish_figure(fig, [ax, cx], f"{Path(result['model']).name}: layers {result['layers']}, {result['passages']} "
                  "held-out passages", path)


def main(args: argparse.Namespace) -> None:
    transformers.utils.logging.disable_progress_bar()
    run = provenance(args.run_dir)  # before reading: the files hashed are the ones the numbers come from
    config = load_json(args.run_dir / "config.json")
    if not isinstance(config, dict) or config.get("protocol") != "encoder":
        raise ValueError(f"run_dir: {args.run_dir} is not an encoder run (config.json protocol)")
    cfg = config["config"]
    model, tok, base = load_encoder(cfg["model"])
    plan = PassagePlan.from_dict(config["split_plan"])
    held = tokenize_passages(tok, plan_passages(load_corpus(cfg["data"], data_dir=cfg["data_dir"]), plan)["heldout"],
                             plan.max_len)
    sets = {}
    for m in KERNELS:  # the folder at cfg["model"] may have changed since the run: its kernels' base model or nothing
        sets[m], meta = load_kernels(kernel_dir(args.run_dir, m))
        check_kernels_base(kernel_dir(args.run_dir, m), meta, model, base)
    sets = {"taylor": taylor_start(sets["oal"]), **sets}
    layers = config["converted_layers"]
    fid = fidelity(model, held["input_ids"], sets, layers, batch_size=8, attention_mask=held["attention_mask"])
    result = {"model": cfg["model"], "layers": layers, "passages": int(held["input_ids"].shape[0]), "methods": {},
              "run": run, "base_model": {k: base[k] for k in ("model", "sha256", "state_dict_sha256", "dtype")}}
    table = Table(title=f"{Path(cfg['model']).name}: layers {layers}, {result['passages']} held-out passages")
    for col in ("kernel", "RelMSE", "RelMSE post-o", "cos mean-pool (mean / min)", "cos [CLS] (mean / min)"):
        table.add_column(col, justify="right")
    for name, methods in sets.items():
        conv = convert(copy.deepcopy(model), layers, methods)  # the checked model, not a second read of its folder
        emb = embedding_similarity(model, conv, held, batch_size=8)
        f = fid[name]
        result["methods"][name] = {"relmse": f["relmse"], "relmse_post_o": f["relmse_post_o"], "mse": f["mse"],
                                   "per_layer_relmse": {k: v["relmse"] for k, v in f["per_layer"].items()},
                                   "cosine": {p: {k: e[k] for k in ("mean", "min", "p05")} for p, e in emb.items()}}
        table.add_row(name, f"{f['relmse']:.4f}", f"{f['relmse_post_o']:.4f}",
                      *(f"{emb[p]['mean']:.4f} / {emb[p]['min']:.4f}" for p in ("mean", "cls")))
    result["environment"] = environment()
    out = args.out or RESULTS / f"encoder_{Path(cfg['model']).name}.json"
    atomic_write_json(out, result)
    plot(result, out.with_suffix(".png"))
    Console().print(table)
    Console(stderr=True).print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    with torch.no_grad():
        run_tool(main, ARGS)
