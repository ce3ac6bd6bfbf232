"""Train the embedded default model: a small byte-level Qwen2ForCausalLM on the `builtin` corpus train split.

Deterministic (fixed seed; batch k is drawn from a generator seeded by (seed, k), so a resumed run sees the same
batches). Checkpoints (safetensors + json, no pickle) go to --work-dir every --ckpt-every steps; rerunning the same
command resumes from the latest one. At the end the model is evaluated on the test split against a unigram
baseline, exported with save_pretrained (half precision safetensors, <= 16 MB) into --out atomically, and the
model card is written by `write_card` (run with --card-only to redo it).

    .venv/bin/python scripts/train_embedded_model.py                       # train (or resume) and export
    .venv/bin/python scripts/train_embedded_model.py --export-now          # export the latest checkpoint as is
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.data.blocks import token_blocks
from oal.data.byte_tokenizer import byte_tokenizer
from oal.data.corpus import builtin_corpus

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "oal" / "assets" / "default_model"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=REPO / ".cache" / "train_embedded")
    p.add_argument("--steps", type=int, default=1150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05, help="cosine floor as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--store-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--export-now", action="store_true", help="skip training; export the latest checkpoint")
    p.add_argument("--card-only", action="store_true", help="only rewrite MODEL_CARD.md of --out")
    return p.parse_args()


def make_config(args: argparse.Namespace, vocab: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
        use_cache=True,
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then cosine decay to min_lr_frac * lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.lr * args.min_lr_frac
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, t)))


def batch_at(step: int, stream: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """Random windows of seq+1 tokens; a pure function of (seed, step) so resuming replays the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - args.seq - 1, (args.batch,), generator=g)
    return torch.stack([stream[s : s + args.seq + 1] for s in starts.tolist()])


# --- checkpoints (safetensors + json, atomic) -------------------------------------------------------------------


def save_checkpoint(work: Path, step: int, model, opt, elapsed: float, losses: list) -> None:
    tmp = work / f"ckpt-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # named_parameters lists the tied embedding once (safetensors refuses shared storage).
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    opt_t, opt_steps = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                opt_t[f"{n}.exp_avg"] = st["exp_avg"].contiguous()
                opt_t[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                opt_steps[n] = float(st["step"])
    save_file(opt_t, str(tmp / "optimizer.safetensors"))
    meta = {"step": step, "elapsed_s": elapsed, "losses": losses, "opt_steps": opt_steps}
    (tmp / "state.json").write_text(json.dumps(meta))
    final = work / f"ckpt-{step}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(work.glob("ckpt-*"), key=lambda q: int(q.name.split("-")[1].split(".")[0]))[:-2]:
        shutil.rmtree(old, ignore_errors=True)  # keep the newest two


def latest_checkpoint(work: Path) -> Path | None:
    cks = [p for p in work.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")]
    cks = [p for p in cks if (p / "state.json").is_file()]
    return max(cks, key=lambda p: int(p.name.split("-")[1])) if cks else None


def load_checkpoint(ck: Path, model, opt) -> dict:
    missing, unexpected = model.load_state_dict(load_file(str(ck / "model.safetensors")), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"checkpoint {ck}: missing {missing}, unexpected {unexpected}")
    meta = json.loads((ck / "state.json").read_text())
    opt_t = load_file(str(ck / "optimizer.safetensors"))
    for n, p in model.named_parameters():
        if n in meta["opt_steps"]:
            opt.state[p] = {
                "step": torch.tensor(meta["opt_steps"][n]),
                "exp_avg": opt_t[f"{n}.exp_avg"],
                "exp_avg_sq": opt_t[f"{n}.exp_avg_sq"],
            }
    return meta


# --- evaluation ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def model_nll(model, blocks: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token NLL (nats) over all scored tokens of the blocks (block_len - 1 targets per block)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, blocks.shape[0], batch):
        x = blocks[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += x[:, 1:].numel()
    return total / count


def unigram_nll(train_ids: torch.Tensor, blocks: torch.Tensor, vocab: int) -> float:
    """NLL of an add-one smoothed unigram model fit on the train tokens, on the same targets as model_nll."""
    counts = torch.bincount(train_ids.reshape(-1), minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[blocks[:, 1:].reshape(-1)].mean())


# --- export -------------------------------------------------------------------------------------------------------


def export(model, tokenizer, out: Path, store_dtype: str, summary: dict) -> None:
    """save_pretrained into a temporary sibling folder, then swap it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = getattr(torch, store_dtype)
    model.to(dtype).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(tmp)
    (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if (out / "MODEL_CARD.md").is_file():
        shutil.copy2(out / "MODEL_CARD.md", tmp / "MODEL_CARD.md")
    for f in tmp.iterdir():
        f.chmod(0o644)  # save_pretrained may create 0600 files; package data must be world-readable
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def qk_structure(model, tokenizer, seed: int = 0) -> dict:
    """Top-5 contribution concentration (share of total chi, Eq. 2, in the 5 largest dims; paper Fig. 5) and the
    App. B natural group count of every layer/head, on the default plan's 40 grouping prompts, against an
    isotropic Gaussian control with the same shapes."""
    from oal.analysis import head_contributions, stable_gap_groups
    from oal.analysis.controls import gaussian_chi, topk_concentration
    from oal.data import default_plan, load_corpus, plan_blocks
    from oal.models.capture import capture
    from oal.models.registry import PRESETS

    prompts = plan_blocks(load_corpus("builtin"), tokenizer, default_plan())["grouping"]
    layers = list(range(model.config.num_hidden_layers))
    chi: dict[int, torch.Tensor] = {}

    def on_layer(c) -> None:
        chi[c.layer] = head_contributions(c.q.double(), c.k.double())  # [P, Hq, d], post-RoPE (Eq. 2)

    capture(model, prompts, layers, on_layer)
    p = PRESETS["default"]
    gen = torch.Generator().manual_seed(seed)
    n_prompts, hq, d = chi[0].shape
    gauss = gaussian_chi(n_prompts, hq, d, [prompts.shape[1]] * n_prompts, gen)  # [P, Hq, d]
    out = {"prompts": n_prompts, "prompt_len": prompts.shape[1],
           "gaussian_top5": topk_concentration(gauss.mean(0)).tolist(), "layers": {}}
    for layer in layers:
        res = stable_gap_groups(chi[layer].transpose(0, 1), tail_fraction=p["alpha"], min_support=p["gamma"],
                                min_ratio=p["tau"], min_groups=p["min_groups"], n_bootstrap=p["n_bootstrap"],
                                seed=seed)
        out["layers"][layer] = {"top5": topk_concentration(chi[layer].mean(0)).tolist(),
                                "groups": (res.groups.amax(-1) + 1).tolist()}
    return out


def write_card(out: Path) -> None:
    """MODEL_CARD.md from training_summary.json plus a fresh QK-structure measurement of the stored model."""
    from oal.models.registry import PRESETS, load_model

    grp = PRESETS["default"]
    summary = json.loads((out / "training_summary.json").read_text())
    model, tok, prov = load_model(str(out))
    qk = qk_structure(model, tok)
    t, c, cfg = summary["test"], summary["corpus"], summary["config"]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    rows = "\n".join(
        f"| {layer} | {' / '.join(f'{x:.3f}' for x in v['top5'])} | {' / '.join(map(str, v['groups']))} |"
        for layer, v in qk["layers"].items())
    all_top5 = [x for v in qk["layers"].values() for x in v["top5"]]
    gmean = sum(qk["gaussian_top5"]) / len(qk["gaussian_top5"])
    steps_note = ("" if summary["steps_trained"] == summary["steps_planned"] else
                  f" (stopped early: planned {summary['steps_planned']})")
    card = f"""# oal embedded default model

A small byte-level causal LM with the architecture the paper targets, trained here so that `oal` works offline.
Built by `scripts/train_embedded_model.py` (deterministic, seed {summary['seed']}); loaded by
`oal.models.registry.load_model("default")`.

## Config
- `Qwen2ForCausalLM`: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['q_heads']} query heads /
  {cfg['kv_heads']} KV heads (GQA), head_dim {cfg['head_dim']}, SwiGLU intermediate {cfg['intermediate']},
  RoPE (theta 10000), RMSNorm, tied embeddings; {summary['params']:,} parameters.
- Tokenizer: byte-level (`Qwen2Tokenizer` with no merges, vocab {cfg['vocab']}: `<pad>`=0, `</s>`=1, `<unk>`=2,
  byte b = b + 3; NFC normalisation first). Loads with `AutoTokenizer.from_pretrained(dir)`.
- Stored as {t['store_dtype']} safetensors ({size_mb:.1f} MB); load with `dtype=torch.float32` to upcast.

## Training
- Data: the `builtin` corpus train split (Python {c['python_version']} documentation: `pydoc_data.topics` and
  top-level stdlib docstrings; {c['train_tokens']:,} bytes); corpus fingerprint `{c['fingerprint'][:16]}...`.
  On another Python version the corpus differs; `oal` then logs one warning line and carries on.
- {summary['steps_trained']} steps{steps_note} of batch {summary['batch']} x {summary['seq']} tokens =
  {summary['training_tokens']:,} training tokens; AdamW lr {summary['optimizer']['lr']}, betas (0.9, 0.95),
  weight decay {summary['optimizer']['weight_decay']}, {summary['optimizer']['warmup']} warmup steps then
  cosine decay, grad clip 1.0.
- Wall time {summary['train_seconds'] / 60:.1f} min on {summary['threads']} CPU thread(s) of a shared 2-core
  machine.

## Quality (test split, never trained on)
| model | test perplexity per byte |
|---|---|
| this model (fp32 weights) | {t['ppl_fp32']:.3f} |
| this model (stored {t['store_dtype']} weights, upcast) | {t['ppl_stored']:.3f} |
| unigram baseline (add-one, fit on train) | {t['ppl_unigram']:.3f} |

{t['blocks']} non-overlapping blocks of {t['block_len']} bytes ({t['block_len'] - 1} scored targets each).
Ratio to unigram: {t['ppl_stored'] / t['ppl_unigram']:.3f} (quality bar: at most 1/3).

## QK structure (does it have outliers?)
Top-5 contribution concentration = share of the total chi (Eq. 2: mean over causal pairs of |q_ir k_jr|/sqrt(d),
post-RoPE) held by the 5 largest of the 64 dimensions, on the {qk['prompts']} grouping prompts of the default
plan ({qk['prompt_len']} bytes each). Groups: number of App. B stable-gap groups (alpha
{grp['alpha']}, gamma {grp['gamma']}, tau {grp['tau']}, B
{grp['n_bootstrap']}).

| layer | top-5 share per query head | groups per query head |
|---|---|---|
{rows}

Range over all heads: {min(all_top5):.3f} to {max(all_top5):.3f}; isotropic Gaussian control (same shapes):
{gmean:.3f}. (Paper Fig. 5: Qwen2.5-0.5B 50.7% vs 7.8% Gaussian.)

## Provenance
- `model.safetensors` SHA256 `{prov['sha256']['model.safetensors']}`.
- `training_summary.json` holds the full training record and the corpus split hashes.
"""
    tmp = out / "MODEL_CARD.md.tmp"
    tmp.write_text(card)
    os.replace(tmp, out / "MODEL_CARD.md")
    (out / "MODEL_CARD.md").chmod(0o644)
    print(f"wrote {out / 'MODEL_CARD.md'}", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.card_only:
        write_card(args.out)
        return
    torch.manual_seed(args.seed)
    corpus = builtin_corpus()
    tok = byte_tokenizer()  # byte-level: ids 0-2 <pad> </s> <unk>, byte b -> b + 3
    train_stream = token_blocks(tok, corpus.splits["train"], 1).reshape(-1)
    test_blocks = token_blocks(tok, corpus.splits["test"], args.seq)
    model = Qwen2ForCausalLM(make_config(args, len(tok)))
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    start, elapsed, losses = 0, 0.0, []
    ck = latest_checkpoint(work)
    if ck is not None:
        meta = load_checkpoint(ck, model, opt)
        start, elapsed, losses = meta["step"], meta["elapsed_s"], meta["losses"]
        print(f"resumed from {ck} at step {start}", flush=True)
    print(f"params {n_params:,}; train tokens {train_stream.numel():,}; test blocks {test_blocks.shape[0]}", flush=True)

    stop = start if args.export_now else args.steps
    model.train()
    t0 = time.time()
    columns = (TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not os.isatty(1)) as bar:
        task = bar.add_task("train", total=args.steps, completed=start, loss="-")
        for step in range(start, stop):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            xb = batch_at(step, train_stream, args)
            logits = model(input_ids=xb[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), xb[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_value = loss.item()
            losses.append(round(loss_value, 4))
            bar.update(task, advance=1, loss=f"{loss_value:.3f}")
            done = step + 1
            if done % 10 == 0 or done == stop:
                print(f"step {done}/{args.steps} loss {loss_value:.4f} lr {lr_at(step, args):.2e} "
                      f"elapsed {elapsed + time.time() - t0:.0f}s", flush=True)
            if done % args.ckpt_every == 0 or done == stop:
                save_checkpoint(work, done, model, opt, elapsed + time.time() - t0, losses)
    trained_steps = stop
    elapsed += time.time() - t0 if stop > start else 0.0

    # Evaluate fp32 weights and the stored (half precision, upcast) weights on the full test split.
    nll32 = model_nll(model, test_blocks)
    stored = Qwen2ForCausalLM(model.config)
    stored.load_state_dict({k: v.to(getattr(torch, args.store_dtype)).float() for k, v in model.state_dict().items()})
    nll_stored = model_nll(stored, test_blocks)
    nll_uni = unigram_nll(train_stream, test_blocks, len(tok))
    summary = {
        "config": {"hidden": args.hidden, "layers": args.layers, "q_heads": 4, "kv_heads": 2, "head_dim": 64,
                   "intermediate": args.intermediate, "vocab": len(tok), "tied_embeddings": True},
        "params": n_params,
        "seed": args.seed,
        "steps_planned": args.steps,
        "steps_trained": trained_steps,
        "batch": args.batch,
        "seq": args.seq,
        "training_tokens": trained_steps * args.batch * args.seq,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                      "warmup": args.warmup, "schedule": "cosine", "min_lr_frac": args.min_lr_frac, "clip": 1.0},
        "train_seconds": round(elapsed, 1),
        "threads": args.threads,
        "final_train_loss_mean_last50": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "corpus": {"name": corpus.name, "python_version": corpus.meta["python_version"],
                   "fingerprint": corpus.fingerprint(), "sha256": corpus.sha256,
                   "train_tokens": train_stream.numel()},
        "test": {"blocks": test_blocks.shape[0], "block_len": args.seq,
                 "ppl_fp32": math.exp(nll32), "ppl_stored": math.exp(nll_stored), "store_dtype": args.store_dtype,
                 "ppl_unigram": math.exp(nll_uni)},
    }
    print(json.dumps(summary["test"], indent=2), flush=True)
    export(model, tok, args.out, args.store_dtype, summary)
    print(f"exported to {args.out}", flush=True)
    write_card(args.out)


if __name__ == "__main__":
    main()
