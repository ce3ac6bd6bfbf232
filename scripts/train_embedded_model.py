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


def write_card(out: Path) -> None:
    raise NotImplementedError("model card writer not implemented yet")


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


if __name__ == "__main__":
    main()
