"""Benchmark: the conversion frontier of a real LM. How many layers, and which, can run in linear time (oal, global,
swa, oal-swa), what that costs in perplexity and passkey recall, and what it buys in prefill time, decode time and
memory, against the softmax model adapted with the same budget and timed in the same run.

Protocol (the pipeline's own drivers, shared across rows so that each layer is calibrated once):
1. The model and the token blocks of its preset's split plan (`smollm2-135m`: the builtin corpus).
2. App. B groups of every candidate layer (all but the first and last: `oal.analysis.runner.analyze`), and the
   kernel methods calibrated on every candidate layer (`oal.calibration.resume.calibrate_directory`, resumable).
3. Per method, the candidates ranked by the project's selection criterion (`--select-by`: `fidelity`, the layer's
   frozen RelMSE after W_o on the calibration validation blocks, or `probe`, the one-layer swap probe); a row
   converts the K best.
4. Every row, and the softmax arm, is adapted with the same budget (LoRA + kernel, `oal.adaptation.train.adapt`),
   merged, then measured: test perplexity, passkey accuracy (`oal.evaluate.passkey`), prefill seconds and decode
   ms/token (median) after a prefill of real test text at each length, and how much the longest prefill and its
   decode raise the process's resident memory (VmHWM, reset before it, less the resident memory before it; with
   `--device cuda`: the device's peak allocation, and synchronised times).
Rows are kept under `--work` as they finish; a killed run resumes at the next row.

Writes `--json` (default benchmarks/results/frontier_<model>.json; the schema of
benchmarks/reference/frontier_smollm2.json) and a PNG beside it (perplexity against decode time at the longest
length, one curve per method), keeps its rows and calibrations in `--work`, and prints a table.

    .venv/bin/python -m benchmarks.frontier                                   # SmolLM2-135M, the default grid
    .venv/bin/python -m benchmarks.frontier --methods swa,oal-swa --k 15 --steps 32 --quick
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import (
    MAX_THREADS,
    MAX_TOKENS,
    ToolParser,
    environment,
    float_in,
    int_in,
    list_of,
    output_dir,
    output_file,
    run_tool,
)

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the frontier (--json; default benchmarks/results/frontier_<model>.json) and a PNG beside it, "
           "its finished rows and calibrations in --work (default benchmarks/results/frontier_<model>/; a rerun "
           "reads them back); the table on stdout, progress on stderr")


def _k(text: str) -> tuple[str | None, int]:
    method, _, k = text.rpartition(":")
    return method or None, int_in(1, 4096)(k)


def parse(argv=None) -> argparse.Namespace:
    """The arguments, all checked before any work (the method names once oal is imported)."""
    p = ToolParser(__doc__, OUTPUTS)
    p.add_argument("--model", default="smollm2-135m", help="a model oal loads (default: smollm2-135m)")
    p.add_argument("--methods", default="swa,oal-swa,oal", type=list_of(str),
                   help="comma-separated linear-time methods")
    p.add_argument("--k", default="8,15,22", type=list_of(_k), help="numbers of converted layers; METHOD:K for one "
                   "method only (e.g. 15,22,swa:28)")
    p.add_argument("--steps", type=int_in(1, 10**7), default=64, help="adaptation updates per arm (softmax too)")
    p.add_argument("--select-by", default="fidelity", type=list_of(_select_by), help="comma list of rankings, each "
                   "fidelity or probe, with +recall: the retrieval layers last (oal.evaluate.retrieval); rows for each")
    p.add_argument("--recall-threshold", type=float_in(0.0, 1.0), default=0.2,
                   help="+recall: a layer retrieves when one of its heads puts this share of its weight on the needle")
    p.add_argument("--window", type=int_in(1, MAX_TOKENS), default=64)
    p.add_argument("--sinks", type=int_in(0, MAX_TOKENS), default=4)
    p.add_argument("--lengths", default="2048,4096,8192", type=list_of(int_in(1, MAX_TOKENS)),
                   help="prefill / decode timing lengths")
    p.add_argument("--passkey-lengths", default="1024,2048,4096", type=list_of(int_in(64, MAX_TOKENS)))
    p.add_argument("--depths", default="0.1,0.5,0.9", type=list_of(float_in(0.0, 1.0)),
                   help="passkey needle depths, in [0, 1]")
    p.add_argument("--trials", type=int_in(1, 10**4), default=2, help="passkey keys per length and depth")
    p.add_argument("--decode-tokens", type=int_in(1, 10**4), default=8)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=42)
    p.add_argument("--quick", action="store_true", help="1 passkey trial, timing at 2048 and 4096 only")
    p.add_argument("--work", type=output_dir, help="work folder (default benchmarks/results/frontier_<model>/)")
    p.add_argument("--json", type=output_file, help="output (default benchmarks/results/frontier_<model>.json)")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N; on CUDA the "
                   "times are synchronised and the memory is the device's peak allocation")
    a = p.parse_args(argv)
    if a.quick:
        a.trials, a.lengths = 1, [n for n in a.lengths if n <= 4096] or a.lengths[:1]
    tag = model_tag(a.model)
    a.work = a.work or RESULTS / f"frontier_{tag}"
    a.json = a.json or RESULTS / f"frontier_{tag}.json"
    return a


def _select_by(text: str) -> str:
    base, _, extra = text.partition("+")
    if base not in ("fidelity", "probe") or extra not in ("", "recall"):
        raise argparse.ArgumentTypeError(f"expected fidelity, probe, fidelity+recall or probe+recall, got {text!r}")
    return text


def model_tag(name: str) -> str:
    return Path(name).stem.split(".")[0].lower().replace("-instruct", "") if name.endswith(".gguf") else \
        Path(name).name.lower()


ARGS = parse() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import copy
import gc
import math
import platform
import statistics
import time

import torch

KERNEL_METHODS = ("oal", "global", "oal-swa", "global-swa")
KERNEL_METHODS = ("oal", "global", "oal-swa", "global-swa")


def _peak_reset() -> bool:
    """Reset the process's peak resident memory (Linux: VmHWM); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously: a time read without it measures the launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status ("VmHWM", "VmRSS") in MB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def timing(model, text: torch.Tensor, lengths: list[int], decode_tokens: int) -> dict:
    """{"prefill_s": {L: s}, "decode_ms": {L: ms}, "peak_mb": MB}: one prefill of the first L tokens of `text` [1, M]
    into a fresh cache, then `decode_tokens` greedy tokens (median ms; the first is a warm-up). peak_mb: how far the
    longest prefill and its decode raised the memory above what it held before (activations and cache; the weights
    already there are not counted): the process's resident memory on the CPU, the device's allocation on CUDA."""
    from transformers import DynamicCache

    from oal.device import module_device
    from oal.models.cache import cache_kwargs

    device = module_device(model)
    text = text.to(device)
    cuda = device.type == "cuda"
    out = {"prefill_s": {}, "decode_ms": {}, "peak_mb": None}
    for n in lengths:
        longest = n == max(lengths)
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            reset, before = longest, torch.cuda.memory_allocated(device) / 2**20
        else:
            reset, before = longest and _peak_reset(), _status_mb("VmRSS")
        cache = DynamicCache(config=model.config)
        _sync(device)
        t0 = time.perf_counter()
        logits = model(text[:, :n], **cache_kwargs(model, cache), use_cache=True).logits
        _sync(device)
        out["prefill_s"][str(n)] = time.perf_counter() - t0
        tok, times = logits[:, -1:].argmax(-1), []
        for i in range(decode_tokens + 1):
            position = torch.tensor([[n + i]], device=device)
            _sync(device)
            t0 = time.perf_counter()
            logits = model(tok, **cache_kwargs(model, cache), use_cache=True, position_ids=position).logits
            _sync(device)
            times.append(time.perf_counter() - t0)
            tok = logits[:, -1:].argmax(-1)
        out["decode_ms"][str(n)] = 1e3 * statistics.median(times[1:])
        if reset and before is not None:
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else _status_mb("VmHWM")
            out["peak_mb"] = peak - before
        del cache, logits
    return out


def _row_key(spec: dict) -> str:
    from oal.rundir.hashes import config_hash

    return config_hash(spec)


class Frontier:
    """The shared inputs (model, blocks, groups, calibrated candidates, rankings) and the rows."""

    def __init__(self, args, log):
        from oal.data.sources import load_corpus
        from oal.data.splits import PLAN_PRESETS, bind_pretraining, default_plan, plan_blocks
        from oal.device import resolve_device
        from oal.models.registry import load_model, preset_for

        self.args, self.log = args, log
        self.work = Path(args.work)
        self.device = resolve_device(args.device)
        # a model that cannot be had leaves no work folder
        self.model, self.tok, self.prov = load_model(args.model, device=self.device)
        self.work.mkdir(parents=True, exist_ok=True)
        self.preset = preset_for(self.model)
        n = self.model.config.num_hidden_layers
        self.candidates = list(range(1, n - 1)) if n >= 3 else list(range(n))
        corpus = load_corpus("builtin")
        plan = bind_pretraining(default_plan(self.preset if self.preset in PLAN_PRESETS else "default"), self.prov,
                                corpus)
        self.blocks = plan_blocks(corpus, self.tok, plan)
        # timing text: real tokens (the test blocks, then the others); its content does not change the times
        roles = ["test", *(r for r in self.blocks if r != "test")]
        self.text = torch.cat([self.blocks[r].reshape(-1) for r in roles])[None]
        need = max(args.lengths) + args.decode_tokens + 1
        if self.text.shape[1] < need:
            raise ValueError(f"--lengths: the plan's blocks hold {self.text.shape[1]} tokens, fewer than {need}")
        self.options = {"window": args.window, "sinks": args.sinks}
        self.base_key = {"model": self.prov["state_dict_sha256"], "blocks": {r: list(b.shape)
                                                                            for r, b in self.blocks.items()},
                         # rows timed on another kind of device are other rows (CPU rows keep their keys)
                         **({"device": self.device.type} if self.device.type != "cpu" else {})}

    # ------------------------------------------------------------------------------------------- candidates

    def calibrated(self, methods: list[str]) -> dict[str, dict[int, torch.nn.Module]]:
        """{method: {layer: calibrated method}} on every candidate layer (kernel methods; swa is built)."""
        from oal.analysis.runner import analyze, load_groups
        from oal.calibration.data import CalibConfig
        from oal.calibration.kernels import kernel_dir, load_kernels
        from oal.calibration.resume import calibrate_directory
        from oal.methods import build_method
        from oal.methods.base import method_settings
        from oal.pipeline.config import PRESETS, grouping_preset

        preset = self.preset if self.preset in PRESETS else "default"
        out: dict[str, dict[int, torch.nn.Module]] = {}
        kernel = [m for m in methods if m in KERNEL_METHODS]
        if kernel:
            calib_dir = self.work / "calibration"
            if not (calib_dir / "groups.json").is_file():
                self.log(f"App. B groups of layers {self.candidates[0]}-{self.candidates[-1]}")
                analyze(self.model, self.tok, self.blocks["grouping"], self.candidates, calib_dir, figures=False,
                        seed=self.args.seed, **grouping_preset(preset))
            groups = load_groups(calib_dir)
            cfg = CalibConfig(**{**PRESETS[preset]["calib"], "seed": self.args.seed})
            self.log(f"calibrating {', '.join(kernel)} on {len(self.candidates)} layers (resumable)")
            calibrate_directory(calib_dir, self.model, self.blocks, self.candidates, kernel, groups=groups, cfg=cfg,
                                seed=self.args.seed, base_model=self.args.model, provenance=self.prov,
                                options=self.options)
            for m in kernel:
                out[m] = load_kernels(kernel_dir(calib_dir, m))[0]
        cfg = self.model.config
        for m in methods:
            if m not in out:
                out[m] = {i: build_method(m, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                          layer_idx=i, **method_settings(m, self.options)).eval()
                          for i in self.candidates}
        return out

    def ranking(self, name: str, methods: dict[int, torch.nn.Module], select: str) -> list[int]:
        """Candidate layers best first by `select` (`oal.pipeline.selection`; "+recall": retrieval layers last),
        cached in the work folder."""
        import json

        from oal.evaluate.fidelity import fidelity
        from oal.pipeline.selection import rank_layers, swap_probe
        from oal.rundir.files import atomic_write_json

        by, _, recall = select.partition("+")
        path = self.work / f"ranking_{name}_{by}.json"
        key = _row_key({**self.base_key, "method": name, "by": by, "options": self.options,
                        "candidates": self.candidates})
        if path.is_file() and json.loads(path.read_text()).get("key") == key:
            order = json.loads(path.read_text())["order"]
            return self.recall_last(order) if recall else order
        self.log(f"ranking the layers for {name} by {by}")
        if by == "fidelity":
            per = fidelity(self.model, self.blocks["calib_val"], {"m": methods}, self.candidates)["m"]["per_layer"]
            scores = {i: per[str(i)]["relmse_post_o"] for i in self.candidates}
        else:
            scores = swap_probe(lambda: copy.deepcopy(self.model), methods, self.blocks["val"], progress=True)
        order = rank_layers(scores)
        atomic_write_json(path, {"key": key, "order": order, "scores": {str(i): s for i, s in scores.items()}})
        return self.recall_last(order) if recall else order

    def recall_last(self, order: list[int]) -> list[int]:
        """`order` with the retrieval layers last (`oal.evaluate.retrieval`; the needle mass is cached)."""
        import json

        from oal.evaluate.retrieval import needle_attention, retrieval_last
        from oal.rundir.files import atomic_write_json

        path = self.work / "needle_attention.json"
        key = _row_key({"model": self.base_key["model"], "length": 2048})
        if path.is_file() and json.loads(path.read_text()).get("key") == key:
            mass = {int(i): v for i, v in json.loads(path.read_text())["mass"].items()}
        else:
            self.log("measuring each layer's attention on a passkey needle (3 prompts of 2048 tokens)")
            mass = needle_attention(self.model, self.tok, length=2048)
            atomic_write_json(path, {"key": key, "mass": {str(i): v for i, v in mass.items()}})
        out = retrieval_last(order, mass, self.args.recall_threshold)
        self.log(f"retrieval layers (a head with >= {self.args.recall_threshold} of its weight on the needle), "
                 f"kept last: {out[len(out) - sum(max(mass[i]) >= self.args.recall_threshold for i in order):]}")
        return out

    # ------------------------------------------------------------------------------------------------- rows

    def row(self, name: str, layers: list[int], methods: dict[int, torch.nn.Module] | None,
            select: str = "fidelity") -> dict:
        """Adapt and measure one arm (`methods` None: the softmax model), or read it back from the work folder."""
        import json

        from oal.adaptation.config import AdaptConfig
        from oal.adaptation.train import adapt
        from oal.evaluate.passkey import evaluate_passkey
        from oal.evaluate.perplexity import block_nll
        from oal.models.convert import convert
        from oal.rundir.files import atomic_write_json

        a = self.args
        spec = {**self.base_key, "method": name, "layers": layers, "steps": a.steps, "seed": a.seed,
                "options": self.options if methods else {}, "lengths": a.lengths, "passkey": a.passkey_lengths,
                "trials": a.trials, "depths": a.depths,
                "kernels": {i: sorted(m.state_dict()) for i, m in (methods or {}).items()}}
        key = _row_key(spec)
        # how the row's times were taken: not part of the key (a row is hours of adaptation; re-timing one is
        # benchmarks.frontier_retime's job), but a row read back with others is said to be
        timed = {"decode_tokens": a.decode_tokens, "threads": torch.get_num_threads()}
        tag = "" if select == "fidelity" or not methods else f"-{select}"  # the first rows' names stay
        path = self.work / "rows" / f"{name}-{len(layers)}{tag}.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                self.log(f"{name} K={len(layers)}: done earlier")
                if saved["row"].get("timed", timed) != timed:
                    self.log(f"  timed with {saved['row']['timed']}, not {timed}: its decode and prefill times "
                             "are those; re-time every row alike with `python -m benchmarks.frontier_retime`")
                return {**saved["row"], "select_by": select if methods else None}
        self.log(f"{name} K={len(layers)}: layers {layers}; adapt {a.steps} steps, then measure")
        t0 = time.perf_counter()
        model = copy.deepcopy(self.model)
        if methods:
            convert(model, layers, {i: copy.deepcopy(methods[i]) for i in layers})
        cfg = AdaptConfig(steps=a.steps, val_every=max(1, a.steps // 2), ckpt_every=max(1, a.steps // 4), seed=a.seed)
        peft_model, result = adapt(model, self.blocks["adapt_train"], self.blocks["val"], cfg,
                                   ckpt_dir=self.work / "checkpoints" / f"{name}-{len(layers)}",
                                   description=f"adapt {name} K={len(layers)}")
        model = peft_model.merge_and_unload().eval()
        total, count = block_nll(model, self.blocks["test"], progress=True, description=f"test PPL {name}")
        pk = evaluate_passkey(model, self.tok, lengths=a.passkey_lengths, depths=a.depths, trials=a.trials,
                              progress=True, description=f"passkey {name}")
        times = timing(model, self.text, a.lengths, a.decode_tokens)
        row = {"method": name, "select_by": select if methods else None, "layers": layers,
               "n_linear": len(layers) if methods else 0,
               "ppl": math.exp(total / count), "passkey": pk["by_length"], "decode_ms": times["decode_ms"],
               "prefill_s": times["prefill_s"], "peak_mb": times["peak_mb"], "best_val_nll": result.best_val_nll,
               "seconds": round(time.perf_counter() - t0, 1), "timed": timed}
        atomic_write_json(path, {"key": key, "row": row})
        del model, peft_model
        gc.collect()
        return row


def machine(device: torch.device) -> dict:
    """Where the rows were timed: the platform, torch's threads, the device and, on CUDA, the GPU's name."""
    return {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
            "device": str(device), **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {})}


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    f = Frontier(args, log)
    res = {"model": args.model, "preset": f.preset, "select_by": args.select_by,
           "recall_threshold": args.recall_threshold if any("recall" in x for x in args.select_by) else None,
           "steps": args.steps,
           "window": args.window, "sinks": args.sinks, "candidates": f.candidates,
           "machine": machine(f.device), "environment": environment(),
           "provenance": {k: f.prov.get(k) for k in ("model", "source", "gguf", "base_model", "state_dict_sha256")}}
    cands = f.calibrated(args.methods)
    soft = f.row("softmax", [], None)
    res["softmax"] = {k: soft[k] for k in ("ppl", "passkey", "decode_ms", "prefill_s", "peak_mb")}
    rows, res["rankings"] = [], {}
    for select in args.select_by:
        for name in args.methods:
            order = f.ranking(name, cands[name], select)
            res["rankings"][f"{name} by {select}"] = order
            for k in [k for m, k in args.k if m in (None, name)]:
                if k > len(order):
                    log(f"{name}: K={k} exceeds the {len(order)} candidate layers; skipped")
                    continue
                rows.append(f.row(name, sorted(order[:k]), cands[name], select))
    res["rows"] = rows
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def arm(r: dict) -> str:
    """A row's label: the method, and its selection when that is not the default fidelity ranking."""
    sel = r.get("select_by")
    return r["method"] if sel in (None, "fidelity") else f"{r['method']} ({sel})"


def table_rows(res: dict) -> tuple[list[str], list[list[str]]]:
    lengths = list(res["softmax"]["decode_ms"])
    pk = list(res["softmax"]["passkey"])
    header = ["method", "K", "PPL", *(f"passkey {n}" for n in pk), *(f"decode ms {n}" for n in lengths),
              *(f"prefill s {n}" for n in lengths), "peak MB"]
    out = []
    for r in [{"method": "softmax", "n_linear": 0, **res["softmax"]}, *res["rows"]]:
        out.append([arm(r), str(r["n_linear"]), f"{r['ppl']:.2f}", *(f"{r['passkey'][n]:.2f}" for n in pk),
                    *(f"{r['decode_ms'][n]:.1f}" for n in lengths), *(f"{r['prefill_s'][n]:.2f}" for n in lengths),
                    f"{r['peak_mb']:.0f}" if r.get("peak_mb") else "-"])
    return header, out


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    from oal.pipeline.report_figures import method_color
    from oal.rundir.files import atomic_save_figure

    longest = max(res["softmax"]["decode_ms"], key=int)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    s = res["softmax"]
    ax.scatter([s["decode_ms"][longest]], [s["ppl"]], marker="*", s=160, color=method_color("softmax"),
               label="softmax", zorder=3)
    for name in dict.fromkeys(arm(r) for r in res["rows"]):
        pts = sorted((r for r in res["rows"] if arm(r) == name), key=lambda r: r["n_linear"])
        # a method keeps its colour in every figure; another selection of its layers: squares, dashed
        ax.plot([r["decode_ms"][longest] for r in pts], [r["ppl"] for r in pts], "o-" if name == pts[0]["method"]
                else "s--", label=name, color=method_color(pts[0]["method"]))
        for r in pts:
            ax.annotate(f"K={r['n_linear']}", (r["decode_ms"][longest], r["ppl"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
    where = res["machine"].get("gpu") or f"CPU, {res['machine']['threads']} threads"
    ax.set_xlabel(f"decode ms/token at {longest} tokens ({where})")
    ax.set_ylabel("test perplexity (adapted)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())  # 12.6, not 1.26 x 10^1
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Conversion frontier: {res['model']} ({res['steps']} adaptation steps per arm)", fontsize=9)
    atomic_save_figure(fig, path, dpi=120, bbox_inches="tight")


def publish(res: dict, path: Path, title: str) -> None:
    """Write `res` to `path` (JSON) and its figure beside it, and print its table under `title`."""
    from rich.console import Console
    from rich.table import Table

    from oal.rundir.files import atomic_write_json

    atomic_write_json(path, res)
    figure(res, path.with_suffix(".png"))
    header, rows = table_rows(res)
    table = Table(title=title)
    for col in header:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def check_methods(methods: list[str]) -> None:
    """ValueError naming --methods unless every one is a linear-time method oal has."""
    from oal.methods import method_names

    linear = [m for m in method_names() if m != "softmax"]
    bad = [m for m in methods if m not in linear]
    if bad:
        raise ValueError(f"--methods: unknown or not linear-time: {', '.join(bad)}; expected some of "
                         f"{', '.join(linear)}")


def main(argv=None) -> int:
    return _main(parse(argv))


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    check_methods(args.methods)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    res = run(args, log=console.log)
    publish(res, args.json, f"conversion frontier: {res['model']} ({res['steps']} adaptation steps, select by "
                            f"{', '.join(res['select_by'])}, window {res['window']}, sinks {res['sinks']})")
    console.log(f"{res['seconds'] / 60:.1f} min; wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    run_tool(_main, ARGS)
