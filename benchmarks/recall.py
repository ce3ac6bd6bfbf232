"""Benchmark: multi-query associative recall (MQAR, Zoology: Arora et al. 2023) of a softmax model and of its
conversions, against sequence length and the number of key-value pairs, with each method's decode state beside it.

The task: a sequence opens with N key-value pairs (keys from the lower half of the vocabulary, values from the
upper half, all distinct), then every key comes back once as a query at a power-law distributed gap, and the model
must write the key's value as the next token. The other positions hold random tokens. Only query positions are
scored (exact argmax match); nothing else is trained or counted.

Protocol:
1. A two-layer softmax LlamaForCausalLM (built from its config, no download) is trained from scratch on MQAR at
   its trained length until it solves it (>= 99% on held-out sequences at every trained number of pairs). If it
   does not within the step budget the benchmark is void: it says so, writes the JSON, and exits 1.
2. Each method replaces the attention of both layers: App. B groups (`oal.analysis.stable_gap_groups`) from the
   contributions of MQAR sequences, kernels calibrated by output matching (`oal.calibration.fit`), then the same
   adaptation for every method (LoRA on q/k/v/o + the kernel parameters, loss on the query positions only, the
   same steps, batch, learning rate and data).
   Every method goes through the pipeline's driver, `calibrate_methods`, with the window settings
   ({"window": W, "sinks": 0}: the first tokens are the pairs, so no sinks): global then OAL, global-swa then
   oal-swa (App. B's order, each OAL start seeded by its G = 1 control), with every query position sampled
   (CalibConfig.queries = the trained length): the sampled-query loss aligns a window method's queries as the
   last ones of the block, which is right only when all of them are sampled. swa has nothing to calibrate.
3. Accuracy on fresh sequences at each length (the trained one and longer) and number of pairs; the decode state
   of a method at a length is the bytes its generation cache holds after a prefill of that length
   (`oal.models.cache.state_nbytes`, float32): softmax's K/V grows with the length, the others' does not.

Writes `--json` (default benchmarks/results/recall.json: `{"trained_length": L, "accuracy": {method: {length:
acc}}, "accuracy_by_pairs": {method: {pairs: acc}}, "state_bytes": {method: {length: bytes}}, ...}`) and a PNG
beside it, prints the tables on stdout and its progress on stderr.

    .venv/bin/python -m benchmarks.recall --quick      # trained length 64: 6 CPU minutes on one thread
                                                       # (20 min of wall time on a 2-core machine at load 13)
    .venv/bin/python -m benchmarks.recall              # trained length 256
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import MAX_THREADS, ToolParser, environment, int_in, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the results (--json; default benchmarks/results/recall.json) and a PNG beside it; the tables "
           "on stdout, progress on stderr; exit code 1 when the softmax model does not learn the task (void)")


def parse_args(argv=None) -> argparse.Namespace:
    p = ToolParser(__doc__, OUTPUTS)
    p.add_argument("--quick", action="store_true", help="trained length 64 (a few minutes on a CPU)")
    p.add_argument("--json", type=output_file, help="write the results here (default benchmarks/results/recall.json)")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import copy
import platform
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch

METHODS = ("oal", "global", "swa", "oal-swa", "global-swa")
IGNORE = -100


# ------------------------------------------------------------------------------------------------- the task


def mqar(n_examples: int, seq_len: int, n_pairs: int, vocab: int, seed: int, *, power_a: float = 0.01,
         noise: bool = True, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """MQAR sequences (inputs [n, L], targets [n, L]); targets are IGNORE except at the query positions, where
    they hold the queried key's value (the next token the model must write). A pure function of its arguments
    (drawn on the CPU, then placed on `device`: the same sequences on every device).

    Keys are distinct draws from [1, vocab // 2), values from [vocab // 2, vocab). The first 2N positions are
    k_1 v_1 ... k_N v_N; each key is then queried once, at position 2N + 2g with the gaps g distinct draws from
    p(g) ~ (g + 1)^(power_a - 1) over the (L - 2N) // 2 slots (Zoology's power law: most queries close to the
    pairs, some far). Every other position holds a uniform random token of the value half (`noise`) or 0.
    Zoology draws its noise from the whole vocabulary; then a noise copy of a key can precede its query and make
    the answer ambiguous (a first trial here with that noise, vocabulary 256, was still under 98% after 700 steps;
    with this noise the same model passes 99% by step 600), so here a key occurs only in its pair and its query.
    """
    half = vocab // 2
    if seq_len % 2 or n_pairs < 1 or 4 * n_pairs > seq_len:
        raise ValueError(f"seq_len/n_pairs: expected an even length >= 4 x pairs, got {seq_len} / {n_pairs}")
    if half - 1 < n_pairs:
        raise ValueError(f"vocab: {vocab} has fewer than {n_pairs} keys in its lower half")
    gen = torch.Generator().manual_seed(seed)
    keys = torch.rand(n_examples, half - 1, generator=gen).argsort(-1)[:, :n_pairs] + 1
    values = torch.rand(n_examples, vocab - half, generator=gen).argsort(-1)[:, :n_pairs] + half
    slots = (seq_len - 2 * n_pairs) // 2
    weights = (torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)).expand(n_examples, -1)
    gaps = torch.multinomial(weights, n_pairs, replacement=False, generator=gen)  # [n, N], distinct per row
    if noise:
        inputs = torch.randint(half, vocab, (n_examples, seq_len), generator=gen)
    else:
        inputs = torch.zeros(n_examples, seq_len, dtype=torch.long)
    inputs[:, 0 : 2 * n_pairs : 2], inputs[:, 1 : 2 * n_pairs : 2] = keys, values
    at = 2 * n_pairs + 2 * gaps
    inputs.scatter_(1, at, keys)
    targets = torch.full_like(inputs, IGNORE).scatter_(1, at, values)
    return inputs.to(device), targets.to(device)


def recall_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(correct, scored): argmax predictions equal to the target at the query positions only."""
    scored = targets != IGNORE
    return int((logits.argmax(-1)[scored] == targets[scored]).sum()), int(scored.sum())


def recall_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the query positions (the others are ignored)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             ignore_index=IGNORE)


@torch.no_grad()
def accuracy(model, length: int, pairs: int, cfg: SimpleNamespace, seed: int) -> float:
    inputs, targets = mqar(cfg.eval_examples, length, pairs, cfg.vocab, seed, device=cfg.device)
    model.eval()
    hits = total = 0
    for i in range(0, inputs.shape[0], cfg.batch):
        h, t = recall_counts(model(input_ids=inputs[i : i + cfg.batch]).logits, targets[i : i + cfg.batch])
        hits, total = hits + h, total + t
    return hits / total


# ------------------------------------------------------------------------------------------------- settings


# Model: a two-layer Llama, `heads` query / `kv_heads` KV heads of hidden // heads dims. Softmax training:
# `batch` sequences a step at lr `lr` (one-cycle over max_steps), the numbers of pairs of `train_pairs` in turn,
# held-out accuracy every `eval_every` steps; lengths are evaluated at `eval_pairs` pairs, `pairs` at the trained
# length; calibration on `calib_examples` sequences per trained number of pairs; adaptation: `adapt_steps` at
# `adapt_lr`, the same for every method. swa, oal-swa and global-swa look back `window` tokens.
BASE = dict(vocab=256, hidden=64, heads=2, kv_heads=2, window=16, batch=64, lr=3e-3, eval_examples=256,
            calib_examples=16, calib_steps=200, adapt_lr=1e-3, seed=0, device="cpu")
QUICK = dict(BASE, trained_length=64, train_pairs=(2, 4, 8, 16), lengths=(64, 128, 256, 512), pairs=(2, 4, 8, 16),
             eval_pairs=8, max_steps=1500, eval_every=100, adapt_steps=100)
FULL = dict(BASE, trained_length=256, train_pairs=(4, 8, 16, 32, 64), lengths=(256, 512, 1024, 2048),
            pairs=(4, 8, 16, 32, 64), eval_pairs=16, vocab=1024, hidden=128, window=64, max_steps=12000,
            eval_every=250, eval_examples=512, adapt_steps=300)


def setup(name: str = "quick", **overrides) -> SimpleNamespace:
    """The settings of `--quick` ("quick") or the full run ("full"), with `overrides`."""
    return SimpleNamespace(**{**{"quick": QUICK, "full": FULL}[name], **overrides})


def build_model(cfg: SimpleNamespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden,
                         num_hidden_layers=2, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                         max_position_embeddings=max(cfg.lengths) + 8, rope_theta=10000.0,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(cfg.device)


# ------------------------------------------------------------------------------------------------- training


def train_softmax(cfg: SimpleNamespace, log) -> tuple[object, dict]:
    """Train until held-out accuracy >= 0.99 at every trained number of pairs; returns (model, record)."""
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.max_steps, pct_start=0.05)
    t0, history, solved = time.perf_counter(), [], False
    step = 0
    for step in range(1, cfg.max_steps + 1):
        model.train()
        pairs = cfg.train_pairs[step % len(cfg.train_pairs)]
        x, y = mqar(cfg.batch, cfg.trained_length, pairs, cfg.vocab, seed=10_000_000 + step, device=cfg.device)
        loss = recall_loss(model(input_ids=x).logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            accs = {p: accuracy(model, cfg.trained_length, p, cfg, seed=1 + p) for p in cfg.train_pairs}
            history.append({"step": step, "loss": round(loss.item(), 4), "accuracy": accs})
            log(f"  softmax step {step}: loss {loss.item():.3f}, held-out accuracy "
                + ", ".join(f"{p} pairs {a:.3f}" for p, a in accs.items()))
            if min(accs.values()) >= 0.99:
                solved = True
                break
    return model.eval(), {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "solved": solved,
                          "history": history}


def _capture(model, cfg: SimpleNamespace, seed: int):
    """Frozen q/k/v/out of both layers on MQAR sequences at the trained length (mixed numbers of pairs)."""
    from oal.calibration.data import LayerData
    from oal.models.capture import capture

    rows = [mqar(cfg.calib_examples, cfg.trained_length, p, cfg.vocab, seed=seed + p, device=cfg.device)[0]
            for p in cfg.train_pairs]
    got: dict[int, list] = {0: [], 1: []}
    with torch.no_grad():
        capture(model, torch.cat(rows), [0, 1], lambda c: got[c.layer].append(c))
    return {layer: LayerData.from_captured(items) for layer, items in got.items()}


def calibrate(model, cfg: SimpleNamespace) -> tuple[dict[str, dict[int, object]], dict]:
    """{method: {layer: calibrated AttentionMethod}} for METHODS, and the groups' record."""
    from oal.analysis import head_contributions, stable_gap_groups
    from oal.calibration.data import CalibConfig
    from oal.calibration.fit import calibrate_methods

    train, val = _capture(model, cfg, seed=20_000), _capture(model, cfg, seed=30_000)
    ccfg = CalibConfig(max_steps=cfg.calib_steps, queries=cfg.trained_length, seed=cfg.seed)
    out: dict[str, dict[int, object]] = {m: {} for m in METHODS}
    n_groups = {}
    for layer in (0, 1):
        tr, va = train[layer], val[layer]
        chi = head_contributions(tr.q.double(), tr.k.double())  # [S, Hq, d]
        groups = stable_gap_groups(chi.transpose(0, 1), seed=cfg.seed).groups  # App. B defaults
        n_groups[layer] = (groups.amax(-1) + 1).tolist()
        for name, (method, _) in calibrate_methods(METHODS, tr, va, layer=layer, groups=groups, cfg=ccfg,
                                                   seed=cfg.seed, options={"window": cfg.window, "sinks": 0}).items():
            out[name][layer] = method
    return out, {"groups_per_head": n_groups, "calibration": asdict(ccfg)}


def adapt(model, cfg: SimpleNamespace) -> tuple[object, list[float]]:
    """LoRA (q/k/v/o, r 8) + the kernel parameters, trained on the query positions: the same for every method."""
    from oal.adaptation.config import AdaptConfig
    from oal.adaptation.train import wrap_lora

    peft_model, _ = wrap_lora(model, AdaptConfig(lora_dropout=0.0, seed=cfg.seed))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.adapt_lr, weight_decay=0.0)
    losses = []
    peft_model.train()
    for step in range(cfg.adapt_steps):
        pairs = cfg.train_pairs[step % len(cfg.train_pairs)]
        x, y = mqar(cfg.batch, cfg.trained_length, pairs, cfg.vocab, seed=40_000_000 + step, device=cfg.device)
        loss = recall_loss(peft_model(input_ids=x).logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
    return peft_model.merge_and_unload().eval(), losses


@torch.no_grad()
def state_bytes(model, length: int, cfg: SimpleNamespace) -> int:
    """Bytes of the generation cache after a prefill of `length` tokens (one sequence)."""
    from transformers import DynamicCache

    from oal.models.cache import cache_kwargs, state_nbytes

    x = mqar(1, length, cfg.eval_pairs, cfg.vocab, seed=7, device=cfg.device)[0]
    cache = DynamicCache(config=model.config)
    model(input_ids=x, **cache_kwargs(model, cache), use_cache=True)
    return sum(state_nbytes(cache).values())


def measure(model, cfg: SimpleNamespace) -> dict:
    return {"accuracy": {str(n): accuracy(model, n, cfg.eval_pairs, cfg, seed=50_000 + n) for n in cfg.lengths},
            "accuracy_by_pairs": {str(p): accuracy(model, cfg.trained_length, p, cfg, seed=60_000 + p)
                                  for p in cfg.pairs},
            "state_bytes": {str(n): state_bytes(model, n, cfg) for n in cfg.lengths}}


# ------------------------------------------------------------------------------------------------- output


def _arms(res: dict) -> list[str]:
    """The arms in the benchmark's order: a JSON read back is key-sorted, and its figure must be the same."""
    return [a for a in ("softmax", *METHODS) if a in res["accuracy"]]


def _by_value(keys) -> list[str]:
    """Lengths or pair counts (JSON keys, strings) in numeric order: "64" after "512" as text."""
    return sorted(keys, key=int)


def tables(res: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the accuracy by length, by number of pairs, and the state size."""
    arms = _arms(res)
    lengths, pairs = _by_value(res["accuracy"]["softmax"]), _by_value(res["accuracy_by_pairs"]["softmax"])
    trained = res["trained_length"]
    by_len = [[a, *(f"{res['accuracy'][a][n]:.3f}" for n in lengths)] for a in arms]
    by_pairs = [[a, *(f"{res['accuracy_by_pairs'][a][p]:.3f}" for p in pairs)] for a in arms]
    state = [[a, *(f"{res['state_bytes'][a][n] / 1024:.1f}" for n in lengths)] for a in arms]
    return [(f"MQAR accuracy by sequence length ({res['eval_pairs']} pairs; trained at {trained})",
             ["method", *lengths], by_len),
            (f"MQAR accuracy by number of key-value pairs (length {trained})", ["method", *pairs], by_pairs),
            ("decode state (KiB, float32, whole model) after a prefill of the length", ["method", *lengths], state)]


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import finish_figure

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm in _arms(res):
        style = "--" if "swa" in arm else "-"
        lens, pairs = _by_value(res["accuracy"][arm]), _by_value(res["accuracy_by_pairs"][arm])
        axes[0].plot([int(n) for n in lens], [res["accuracy"][arm][n] for n in lens], style, marker="o", label=arm)
        axes[1].plot([int(p) for p in pairs], [res["accuracy_by_pairs"][arm][p] for p in pairs], style, marker="o",
                     label=arm)
        axes[2].plot([int(n) for n in lens], [res["state_bytes"][arm][n] / 1024 for n in lens], style, marker="o",
                     label=arm)
    for ax, xl, yl in ((axes[0], "sequence length", "accuracy"), (axes[1], "key-value pairs", "accuracy"),
                       (axes[2], "sequence length", "decode state (KiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
    axes[0].axvline(res["trained_length"], color="grey", lw=0.8)
    axes[2].set_yscale("log")
    finish_figure(fig, axes, "MQAR: recall of a softmax model and its conversions", path)


def run(cfg: SimpleNamespace, log=print) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    from oal.models.convert import convert

    log(f"training the softmax model on MQAR at length {cfg.trained_length}, pairs {list(cfg.train_pairs)}")
    base, training = train_softmax(cfg, log)
    res = {"trained_length": cfg.trained_length, "eval_pairs": cfg.eval_pairs, "setup": vars(cfg),
           "training": training, "void": not training["solved"],
           "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "device": cfg.device},
           "environment": environment()}
    if res["void"]:
        log(f"VOID: the softmax model did not solve MQAR at length {cfg.trained_length} in {cfg.max_steps} steps")
        return res
    arms = {"softmax": measure(base, cfg)}
    methods, res["grouping"] = calibrate(base, cfg)
    res["adapt_loss"] = {}
    for name in METHODS:
        log(f"  {name}: convert both layers, adapt {cfg.adapt_steps} steps, measure")
        model = convert(copy.deepcopy(base), [0, 1], methods[name])
        model, losses = adapt(model, cfg)
        res["adapt_loss"][name] = losses[-10:]
        arms[name] = measure(model, cfg)
    for key in ("accuracy", "accuracy_by_pairs", "state_bytes"):
        res[key] = {arm: m[key] for arm, m in arms.items()}
    res["seconds"], res["cpu_seconds"] = round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1)
    return res


def main(argv=None) -> int:
    return _main(parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.threads:
        torch.set_num_threads(args.threads)
    from oal.device import resolve_device

    cfg = setup("quick" if args.quick else "full", seed=args.seed, device=str(resolve_device(args.device)))
    progress, console = Console(stderr=True), Console()
    res = run(cfg, log=progress.print)
    out = args.json or RESULTS / "recall.json"
    from oal.rundir.files import atomic_write_json

    atomic_write_json(out, res)
    if not res["void"]:
        figure(res, out.with_suffix(".png"))
        for title, header, rows in tables(res):
            table = Table(title=title)
            for col in header:
                table.add_column(col, justify="right")
            for row in rows:
                table.add_row(*row)
            console.print(table)
        progress.print(f"{res['seconds'] / 60:.1f} min ({res['cpu_seconds'] / 60:.1f} CPU min); wrote {out} and "
                       f"{out.with_suffix('.png')}")
    return 1 if res["void"] else 0


if __name__ == "__main__":
    run_tool(_main, ARGS)
