"""Train the embedded default model: a small Qwen2ForCausalLM with a BPE tokenizer, on the `builtin` corpus's
pretraining text only.

Data: the `builtin` corpus (Python's standard library: pydoc topics, docstrings, and source with docstrings removed;
PSF License). Its train split starts with a held-out prose head that `oal run` groups, calibrates, evaluates and
adapts on; the model is pretrained only on the token range the default split plan names `pretrain` (after that
head), and the tokenizer is trained on the same text. Validation and test splits are held-out prose too.

Deterministic (fixed seed; batch k is drawn from a generator seeded by (seed, k), so a resumed run sees the same
batches; the tokenizer is rebuilt and checked against the one saved with the first checkpoint). Checkpoints
(safetensors, and json with their SHA256, which the resume checks; no pickle) go to --work-dir every --ckpt-every
steps; rerunning the same command resumes from the latest one. At the end the model is evaluated on the test split
against a unigram baseline, exported with save_pretrained (half precision safetensors) into --out atomically, and
the model card is written by `write_card` (run with --card-only to redo it).

    .venv/bin/python scripts/train_embedded_model.py                       # train (or resume) and export
    .venv/bin/python scripts/train_embedded_model.py --export-now          # export the latest checkpoint as is
    .venv/bin/python scripts/train_embedded_model.py --snapshot DIR        # latest checkpoint -> DIR, no card

The shipped model is four stages (MODEL_CARD.md "Reproduce"): 700 steps of plain language modelling; 200 steps
from those weights with `--logit-var-penalty 0.05`, which keeps each head's attention logits close together (the
regime the method is for); then, with the same penalty, two retrieval stages (`--retrieval-frac`): 300 steps of
short passkey documents only (`--seq 128`, a curriculum: copying is learnt where it is cheap) and 400 steps at the
full context with half of every batch passkey documents and half plain text (the language model recovers; the
copying reaches 512 tokens). `torchrun --standalone --nproc-per-node 2 scripts/train_embedded_model.py ...` runs
any stage data-parallel over two one-thread processes (what a shared 2-core CPU sustains best).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from oal.data import default_plan, encode
from oal.data.corpus import builtin_corpus
from oal.rundir.hashes import sha256_file

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "oal" / "assets" / "default_model"
SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--work-dir", type=Path, default=REPO / ".cache" / "train_embedded")
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size, special tokens included")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05, help="cosine floor as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--keep-every", type=int, default=200, help="also keep every checkpoint at a multiple of this")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass (fp32 weights, Adam)")
    p.add_argument("--logit-var-penalty", type=float, default=0.0,
                   help="lambda: add lambda x (mean over layers, heads and causal rows of the variance of a row's "
                        "attention logits) to the loss")
    p.add_argument("--retrieval-frac", type=float, default=0.0,
                   help="fraction of each batch's rows that are passkey retrieval documents (oal.evaluate.passkey's "
                        "instruction, needle and question around pretraining-text filler), the rest plain windows")
    p.add_argument("--answer-weight", type=float, default=1.0,
                   help="weight of a retrieval document's answer tokens in the mean cross-entropy (1: plain CE)")
    p.add_argument("--passkey-lengths", default="256,512,1024,2048",
                   help="lengths at which the exported model's passkey accuracy is measured (4 keys x 5 depths)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from these weights (a checkpoint folder of this script or a model folder) instead "
                        "of a random initialisation: a second training stage")
    p.add_argument("--init-summary", type=Path, default=None,
                   help="training_summary.json of the stage --init-from continues (recorded in this one's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--store-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--export-now", action="store_true", help="skip training; export the latest checkpoint")
    p.add_argument("--snapshot", type=Path, default=None,
                   help="save the latest checkpoint as a model folder here (no evaluation, no card) and exit")
    p.add_argument("--card-only", action="store_true", help="only rewrite MODEL_CARD.md of --out")
    return p.parse_args()


# --- tokenizer ----------------------------------------------------------------------------------------------------


def build_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE trained with `tokenizers` on `text` (the pretraining text only), wrapped as the
    Qwen2Tokenizer that transformers maps a qwen2 folder to, so AutoTokenizer loads it offline. The trainer uses
    Qwen2Tokenizer's own normaliser (NFC) and pre-tokeniser, so the wrapped tokenizer encodes as trained."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(text.split("\n\n"), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token="<unk>", eos_token="</s>", pad_token="<pad>")


def tokenizer_hash(tok) -> str:
    """SHA256 over the vocabulary and merges (what fixes the encoding)."""
    state = json.loads(tok.backend_tokenizer.to_str())["model"]
    return hashlib.sha256(json.dumps([sorted(state["vocab"].items()), state["merges"]]).encode()).hexdigest()


def pretraining_stream(corpus, tok) -> tuple[torch.Tensor, dict]:
    """Token ids of the plan's `pretrain` range of the train split, and its record for training_summary.json.

    Checks that the range starts after the held-out head (the text every pipeline role uses) and ends the split."""
    pre = default_plan().pretrain
    ids = torch.tensor(encode(tok, corpus.splits["train"]), dtype=torch.long)
    head = len(encode(tok, corpus.splits["train"][: corpus.meta["pretrain_start_char"]]))
    start = pre.indices[0] * pre.block_len
    if not (pre.split == "train" and pre.through_end and head <= start < head + pre.block_len):
        raise ValueError(f"plan: the pretrain range must start at the first {pre.block_len}-token block after the "
                         f"held-out head ({head} tokens), got token {start}; update DEFAULT_PRETRAIN_START_BLOCK")
    stream = ids[start:]
    record = {"split": pre.split, "block_len": pre.block_len, "first_block": pre.indices[0], "token_start": start,
              "tokens": stream.numel(), "heldout_head_tokens": head,
              "sha256_tokens": hashlib.sha256(stream.numpy().tobytes()).hexdigest(),
              "sha256_text": corpus.meta["pretrain_sha256"]}
    return stream, record


# --- model and schedule -------------------------------------------------------------------------------------------


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


# --- retrieval documents (the passkey stage) ------------------------------------------------------------------

RETRIEVAL_FILLERS = ("pretraining text", "a repeated pretraining snippet")


def retrieval_row(index: int, stream: torch.Tensor, tok, args: argparse.Namespace) -> tuple[torch.Tensor, int, int]:
    """One row of seq+1 tokens: a passkey document, `</s>`, then pretraining text; and the answer's [start, end).

    The document is `oal.evaluate.passkey`'s instruction, needle (a random 5-digit key) and question, with the
    answer " <key>." after it, at a random length up to the row and a random depth. Its filler is never the
    evaluation's filler: either a contiguous span of the pretraining range or one short pretraining span repeated
    (the evaluation repeats a sentence block; a model must retrieve through repetition too). Everything comes from
    the pretraining range and a generator seeded by (seed, index)."""
    from oal.evaluate.passkey import answer_ids, prompt_pieces

    rng = random.Random(f"retrieval/{args.seed}/{index}")
    key = str(rng.randint(10_000, 99_999))
    intro, needle, question = prompt_pieces(tok, key)
    answer = answer_ids(tok, key)
    fixed = len(intro) + len(needle) + len(question) + len(answer)
    room = rng.randint(16, args.seq - fixed)  # filler tokens; the document ends by the row's last target
    if rng.random() < 0.5:
        at = rng.randrange(stream.numel() - room)
        filler = stream[at : at + room].tolist()
        cut = round(rng.random() * room)
    else:
        unit_len = rng.randint(8, min(40, room))  # room >= 16; a unit never outgrows it
        at = rng.randrange(stream.numel() - unit_len)
        units = room // unit_len
        filler = stream[at : at + unit_len].tolist() * units
        cut = round(rng.random() * units) * unit_len
    doc = intro + filler[:cut] + needle + filler[cut:] + question
    start = len(doc)
    doc += answer + [tok.eos_token_id]
    rest = args.seq + 1 - len(doc)
    at = rng.randrange(stream.numel() - rest)
    row = torch.tensor(doc + stream[at : at + rest].tolist(), dtype=torch.long)
    return row, start, start + len(answer)


def mixed_batch(step: int, stream: torch.Tensor, tok, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_at`'s windows with the first round(retrieval_frac x batch) rows replaced by retrieval rows, and a
    [batch, seq+1] mask of their answer tokens."""
    xb = batch_at(step, stream, args)
    answers = torch.zeros_like(xb, dtype=torch.bool)
    for b in range(round(args.retrieval_frac * args.batch)):
        xb[b], start, end = retrieval_row(step * args.batch + b, stream, tok, args)
        answers[b, start:end] = True
    return xb, answers


@torch.no_grad()
def passkey_record(model, tok, lengths: list[int], seed: int = 0) -> dict:
    """Greedy passkey accuracy (oal.evaluate.passkey, its default depths, 4 keys each) by length, for the card."""
    from oal.evaluate.passkey import evaluate_passkey

    model.eval()
    res = evaluate_passkey(model, tok, lengths=lengths, trials=4, seed=seed)
    return {"lengths": lengths, "trials": 4, "depths": res["depths"], "by_length": res["by_length"],
            "accuracy": res["accuracy"], "examples": res["examples"]}


# --- attention-logit variance penalty ------------------------------------------------------------------------------

LOGIT_VAR_ATTENTION = "oal_train_logit_var"
_ROW_VARIANCES: list[torch.Tensor] = []


def _logit_var_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """SDPA attention (output unchanged) that also records the mean, over heads and causal rows with >= 2 keys, of
    the variance of a row's logits s = q.k * scaling. Penalising it keeps each head's logits close together, the
    regime where a quadratic kernel can follow exp(s); softmax is invariant to a row's mean, so only the spread
    is penalised."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)
    scaling = kwargs.get("scaling") or module.scaling
    k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    s = (query.float() @ k.float().transpose(-1, -2)) * scaling  # [B, H, N, N]
    n = s.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    count = causal.sum(-1).to(s.dtype)
    sm = s.masked_fill(~causal, 0.0)
    mean = sm.sum(-1) / count
    var = sm.square().sum(-1) / count - mean.square()
    _ROW_VARIANCES.append(var[..., 1:].mean())
    return out


def use_logit_var_penalty(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(LOGIT_VAR_ATTENTION, _logit_var_attention)
    AttentionMaskInterface.register(LOGIT_VAR_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = LOGIT_VAR_ATTENTION


def init_weights(model, path: Path) -> dict:
    """Load the starting weights of a second stage; returns their record for training_summary.json."""
    ck = path / "model.safetensors"
    state = load_file(str(ck))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"--init-from {path}: missing {missing}, unexpected {unexpected}")
    rec = {"path": str(path), "sha256": hashlib.sha256(ck.read_bytes()).hexdigest()}
    for name in ("training_summary.json", "state.json"):
        if (path / name).is_file():
            meta = json.loads((path / name).read_text())
            rec["step"] = meta.get("step", meta.get("steps_trained"))
    return rec


# --- checkpoints (safetensors + json, atomic) -------------------------------------------------------------------


CHECKPOINT_TENSORS = ("model.safetensors", "optimizer.safetensors")


def save_checkpoint(work: Path, step: int, model, opt, elapsed: float, losses: list, keep_every: int = 0) -> None:
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
    meta = {"step": step, "elapsed_s": elapsed, "losses": losses, "opt_steps": opt_steps,
            "sha256": {f: sha256_file(tmp / f) for f in CHECKPOINT_TENSORS}}  # the resume checks them
    (tmp / "state.json").write_text(json.dumps(meta))
    final = work / f"ckpt-{step}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(work.glob("ckpt-*"), key=lambda q: int(q.name.split("-")[1].split(".")[0]))[:-2]:
        if keep_every and int(old.name.split("-")[1].split(".")[0]) % keep_every == 0:
            continue  # milestones kept for measuring the attention regime along training
        shutil.rmtree(old, ignore_errors=True)  # keep the newest two


def latest_checkpoint(work: Path) -> Path | None:
    cks = [p for p in work.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")]
    cks = [p for p in cks if (p / "state.json").is_file()]
    return max(cks, key=lambda p: int(p.name.split("-")[1])) if cks else None


def load_checkpoint(ck: Path, model, opt) -> dict:
    meta = json.loads((ck / "state.json").read_text())
    for f in CHECKPOINT_TENSORS:  # a checkpoint without hashes predates them: read as before
        if "sha256" in meta and sha256_file(ck / f) != meta["sha256"].get(f):
            raise ValueError(f"checkpoint {ck / f}: its SHA256 is not the one in state.json; delete {ck} to resume "
                             "from the checkpoint before it")
    missing, unexpected = model.load_state_dict(load_file(str(ck / "model.safetensors")), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"checkpoint {ck}: missing {missing}, unexpected {unexpected}")
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




def summary_record(args, model, tok, corpus, pre_record, trained_steps, elapsed, losses, test) -> dict:
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "config": {"hidden": args.hidden, "layers": args.layers, "q_heads": 4, "kv_heads": 2, "head_dim": 64,
                   "intermediate": args.intermediate, "vocab": len(tok), "tied_embeddings": True,
                   "context": args.seq},
        "params": n_params,
        "tokenizer": {"kind": "byte-level BPE (tokenizers), Qwen2Tokenizer", "vocab": len(tok),
                      "sha256_vocab_merges": tokenizer_hash(tok), "trained_on": "pretrain range only"},
        "seed": args.seed,
        "steps_planned": args.steps,
        "steps_trained": trained_steps,
        "batch": args.batch,
        "seq": args.seq,
        "training_tokens": trained_steps * args.batch * args.seq,
        "optimizer": {"name": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                      "warmup": args.warmup, "schedule": "cosine", "min_lr_frac": args.min_lr_frac, "clip": 1.0},
        "autocast": "bfloat16" if args.bf16 else None,
        "train_seconds": round(elapsed, 1),
        "threads": args.threads,
        "processes": int(os.environ.get("WORLD_SIZE", "1")),
        "final_train_loss_mean_last50": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "corpus": {"name": corpus.name, "python_version": corpus.meta["python_version"],
                   "source": corpus.meta["source"], "licence": corpus.meta["licence"],
                   "fingerprint": corpus.fingerprint(), "sha256": corpus.sha256, "chars": corpus.meta["chars"],
                   "heldout_head_chars": corpus.meta["pretrain_start_char"]},
        "pretrain": pre_record,
        "test": test,
    }


def _all_reduce_mean(tensors, world: int) -> None:
    """Average tensors over the data-parallel ranks (torchrun); a no-op in a single process."""
    if world > 1:
        import torch.distributed as dist

        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Data parallel under `torchrun --nproc-per-node N` (gloo, CPU): rank r takes windows r, r + N, ... of each
    # step's batch and gradients are averaged, so the update equals the single-process one (up to summation
    # order). On a shared CPU, N one-thread processes keep going where one N-thread process stalls at barriers.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if args.batch % world:
            raise ValueError(f"--batch {args.batch} must be a multiple of the {world} processes")
    if args.card_only:
        write_card(args.out)
        return
    torch.manual_seed(args.seed)
    corpus = builtin_corpus()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    pretrain_text = corpus.splits["train"][corpus.meta["pretrain_start_char"]:]
    tok = build_tokenizer(pretrain_text, args.vocab)
    tok_dir = work / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():  # resuming: the rebuilt tokenizer must be the one trained with
        saved = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        if tokenizer_hash(saved) != tokenizer_hash(tok):
            raise ValueError(f"tokenizer: rebuilt BPE differs from {tok_dir} (corpus or tokenizers changed)")
    elif rank == 0:
        tok.save_pretrained(tok_dir)
    stream, pre_record = pretraining_stream(corpus, tok)
    test_blocks = torch.tensor(encode(tok, corpus.splits["test"]), dtype=torch.long)
    test_blocks = test_blocks[: test_blocks.numel() // args.seq * args.seq].reshape(-1, args.seq)
    model = Qwen2ForCausalLM(make_config(args, len(tok)))
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    start, elapsed, losses = 0, 0.0, []
    init_rec = init_weights(model, args.init_from) if args.init_from is not None else None
    if args.logit_var_penalty > 0:
        use_logit_var_penalty(model)
    ck = latest_checkpoint(work)
    if ck is not None:
        meta = load_checkpoint(ck, model, opt)
        start, elapsed, losses = meta["step"], meta["elapsed_s"], meta["losses"]
        print(f"resumed from {ck} at step {start}", flush=True)
    if args.snapshot is not None:
        model.to(getattr(torch, args.store_dtype)).save_pretrained(args.snapshot, safe_serialization=True)
        tok.save_pretrained(args.snapshot)
        print(f"snapshot of step {start} -> {args.snapshot}", flush=True)
        return
    print(f"params {n_params:,}; pretraining tokens {stream.numel():,} (from token {pre_record['token_start']}); "
          f"test blocks {test_blocks.shape[0]}", flush=True)

    stop = start if args.export_now else args.steps
    penalties: list[float] = []
    answer_acc: list[float] = []
    model.train()
    t0 = time.time()
    columns = (TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not os.isatty(1)) as bar:
        task = bar.add_task("train", total=args.steps, completed=start, loss="-")
        for step in range(start, stop):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            xb, answers = mixed_batch(step, stream, tok, args)
            xb, answers = xb[rank::world], answers[rank::world, 1:]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                logits = model(input_ids=xb[:, :-1]).logits
            ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                   xb[:, 1:].reshape(-1), reduction="none").view_as(answers)
            weights = 1.0 + (args.answer_weight - 1.0) * answers.float()
            loss = (ce * weights).sum() / weights.sum()
            if answers.any():  # exact-token accuracy on the answers of this process's retrieval rows (for the log)
                hits = (logits.argmax(-1) == xb[:, 1:])[answers].float().mean()
                answer_acc.append(round(hits.item(), 3))
            objective = loss
            if args.logit_var_penalty > 0:
                penalty = torch.stack(_ROW_VARIANCES).mean()
                _ROW_VARIANCES.clear()
                objective = loss + args.logit_var_penalty * penalty
                penalties.append(round(penalty.item(), 3))
            opt.zero_grad(set_to_none=True)
            objective.backward()
            _all_reduce_mean([p.grad for p in model.parameters()] + [loss.detach()], world)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_value = loss.item()
            losses.append(round(loss_value, 4))
            bar.update(task, advance=1, loss=f"{loss_value:.3f}")
            done = step + 1
            if rank == 0 and (done % 10 == 0 or done == stop):
                pen = f" logit-var {penalties[-1]:.3f}" if penalties else ""
                pen += f" answer-acc {sum(answer_acc[-10:]) / len(answer_acc[-10:]):.3f}" if answer_acc else ""
                print(f"step {done}/{args.steps} loss {loss_value:.4f}{pen} lr {lr_at(step, args):.2e} "
                      f"elapsed {elapsed + time.time() - t0:.0f}s", flush=True)
            if rank == 0 and (done % args.ckpt_every == 0 or done == stop):
                save_checkpoint(work, done, model, opt, elapsed + time.time() - t0, losses, args.keep_every)
    trained_steps = stop
    elapsed += time.time() - t0 if stop > start else 0.0
    model.config._attn_implementation = "sdpa"  # the penalty is a training device: evaluate and ship plain SDPA
    if world > 1:
        dist.destroy_process_group()
        if rank > 0:
            return

    # Evaluate fp32 weights and the stored (half precision, upcast) weights on the full test split.
    nll32 = model_nll(model, test_blocks)
    stored = Qwen2ForCausalLM(model.config)
    stored.load_state_dict({k: v.to(getattr(torch, args.store_dtype)).float() for k, v in model.state_dict().items()})
    nll_stored = model_nll(stored, test_blocks)
    nll_uni = unigram_nll(stream, test_blocks, len(tok))
    test = {"blocks": test_blocks.shape[0], "block_len": args.seq, "ppl_fp32": math.exp(nll32),
            "ppl_stored": math.exp(nll_stored), "store_dtype": args.store_dtype, "ppl_unigram": math.exp(nll_uni)}
    summary = summary_record(args, model, tok, corpus, pre_record, trained_steps, elapsed, losses, test)
    summary["logit_var_penalty"] = args.logit_var_penalty
    if args.retrieval_frac > 0:
        from oal.evaluate.passkey import PASSKEY

        summary["retrieval"] = {
            "rows_per_batch": round(args.retrieval_frac * args.batch), "answer_weight": args.answer_weight,
            "format": "oal.evaluate.passkey: instruction, needle, question, answer ' <key>.', </s>, then "
                      "pretraining text; 5-digit keys, uniform depth and length",
            "template_sha256": hashlib.sha256(json.dumps(vars(PASSKEY), sort_keys=True).encode()).hexdigest(),
            "fillers": list(RETRIEVAL_FILLERS), "filler_source": "the pretrain range (as above)",
            "last50_answer_token_accuracy": round(sum(answer_acc[-50:]) / max(1, len(answer_acc[-50:])), 4)}
    lengths = [int(n) for n in args.passkey_lengths.split(",") if n.strip()]
    summary["passkey"] = passkey_record(model, tok, lengths)
    print("passkey", json.dumps(summary["passkey"]["by_length"]), flush=True)
    if init_rec is not None:
        summary["init_from"] = init_rec
        if args.init_summary is not None:
            summary["init_from"]["summary"] = json.loads(args.init_summary.read_text())
            if "passkey" not in summary["init_from"]["summary"]:  # the stage's input, measured the same way
                start_model = Qwen2ForCausalLM(model.config)
                init_weights(start_model, args.init_from)
                start_model.config._attn_implementation = "sdpa"
                summary["init_from"]["summary"]["passkey"] = passkey_record(start_model, tok, lengths)
    print(json.dumps(summary["test"], indent=2), flush=True)
    export(model, tok, args.out, args.store_dtype, summary)
    print(f"exported to {args.out}", flush=True)
    write_card(args.out)


@torch.no_grad()
def qk_structure(model, tokenizer, seed: int = 0) -> dict:
    """Top-5 contribution concentration (share of total chi, Eq. 2, in the 5 largest dims; paper Fig. 5) and the
    App. B group count of every layer/head on the default plan's 40 grouping prompts, against an isotropic
    Gaussian control with the same shapes; and the attention regime (oal.analysis.regime) on its fidelity blocks."""
    from oal.analysis import head_contributions, stable_gap_groups
    from oal.analysis.controls import gaussian_chi, topk_concentration
    from oal.analysis.regime import attention_regime
    from oal.data import default_plan, load_corpus, plan_blocks
    from oal.models.capture import capture
    from oal.pipeline.config import grouping_preset

    blocks = plan_blocks(load_corpus("builtin"), tokenizer, default_plan())
    prompts = blocks["grouping"]
    layers = list(range(model.config.num_hidden_layers))
    chi: dict[int, torch.Tensor] = {}

    def on_layer(c) -> None:
        chi[c.layer] = head_contributions(c.q.double(), c.k.double())  # [P, Hq, d], post-RoPE (Eq. 2)

    capture(model, prompts, layers, on_layer)
    gen = torch.Generator().manual_seed(seed)
    n_prompts, _, d = chi[0].shape
    gauss = gaussian_chi(n_prompts, chi[0].shape[1], d, [prompts.shape[1]] * n_prompts, gen)  # [P, Hq, d]
    out = {"prompts": n_prompts, "prompt_len": prompts.shape[1],
           "gaussian_top5": topk_concentration(gauss.mean(0)).tolist(), "layers": {},
           "regime": attention_regime(model, blocks["fidelity"], layers)}
    for layer in layers:
        res = stable_gap_groups(chi[layer].transpose(0, 1), **grouping_preset("default"), seed=seed)
        out["layers"][layer] = {"top5": topk_concentration(chi[layer].mean(0)).tolist(),
                                "groups": (res.groups.amax(-1) + 1).tolist()}
    return out


def _stage_line(number: int, st: dict, pretrain_tokens: int, block_len: int) -> str:
    """One training stage of the card, from its training_summary.json record; `block_len`: the shipped model's
    test blocks (a stage measured on others says so)."""
    opt = st["optimizer"]
    penalty = st.get("logit_var_penalty", 0.0)
    start = (f"from the stage-{number - 1} weights (step {st['init_from'].get('step')})" if st.get("init_from")
             else "from a random initialisation (seed {})".format(st["seed"]))
    objective = ("next-token cross-entropy" if not penalty else
                 f"next-token cross-entropy + {penalty} x the mean variance of a row's attention logits (over "
                 "layers, heads and causal rows): a penalty on each head's logit spread, the regime quadratic "
                 "kernels need")
    blocks = "" if st["test"]["block_len"] == block_len else f" (on {st['test']['block_len']}-token test blocks)"
    if "retrieval" in st:
        r = st["retrieval"]
        weight = f", answer tokens weighted {r['answer_weight']}" if r["answer_weight"] != 1 else ""
        objective += (f"; {r['rows_per_batch']} of the {st['batch']} rows of every batch are passkey retrieval "
                      "documents (the evaluation's instruction, needle and question, filler "
                      f"{' or '.join(r['fillers'])} from the pretraining range, a random 5-digit key at a random "
                      "depth and length, the answer "
                      f"' <key>.', then `</s>` and pretraining text{weight}; answer-token accuracy over the last 50 "
                      f"steps {r['last50_answer_token_accuracy']:.3f})")
    return (f"- Stage {number}, {start}: {st['steps_trained']} steps of batch {st['batch']} x {st['seq']} tokens = "
            f"{st['training_tokens']:,} tokens ({st['training_tokens'] / pretrain_tokens:.1f} epochs); {objective}; "
            f"AdamW lr {opt['lr']}, betas (0.9, 0.95), weight decay {opt['weight_decay']}, {opt['warmup']} warmup "
            f"steps then cosine decay to {opt['min_lr_frac']} x lr, grad clip 1.0; forward in "
            f"{st.get('autocast') or 'float32'} autocast with fp32 master weights; test perplexity after it "
            f"{st['test']['ppl_stored']:.2f}{blocks}. Wall time {st['train_seconds'] / 60:.1f} min in "
            f"{st.get('processes', 1)} process(es) x {st['threads']} thread on a 2-core CPU.")


def _kept_section(card: Path, heading: str) -> str:
    """The hand-written section `heading` of an existing card (up to the next heading), so --card-only keeps it."""
    if not card.exists():
        return ""
    text = card.read_text()
    start = text.find(heading + "\n")
    if start < 0:
        return ""
    end = text.find("\n## ", start + len(heading))
    return text[start:end + 1] if end >= 0 else text[start:].rstrip() + "\n\n"


def write_card(out: Path) -> None:
    """MODEL_CARD.md from training_summary.json plus a fresh QK-structure and attention-regime measurement."""
    from oal.models.registry import load_model
    from oal.pipeline.config import grouping_preset

    grp = grouping_preset("default")
    summary = json.loads((out / "training_summary.json").read_text())
    model, tok, prov = load_model(str(out))
    qk = qk_structure(model, tok)
    t, c, cfg, pre = summary["test"], summary["corpus"], summary["config"], summary["pretrain"]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    rows = "\n".join(
        f"| {layer} | {' / '.join(f'{x:.3f}' for x in v['top5'])} | {' / '.join(map(str, v['groups']))} |"
        for layer, v in qk["layers"].items())
    reg = qk["regime"]
    regime_rows = "\n".join(
        f"| {layer} | {' / '.join(f'{x:.2f}' for x in r['max_weight'])} | "
        f"{' / '.join(f'{x:.1f}' for x in r['eff_keys'])} | {min(r['logit_p01']):.1f} .. {max(r['logit_p99']):.1f} "
        f"| {min(r['logit_min']):.1f} .. {max(r['logit_max']):.1f} |" for layer, r in reg["layers"].items())
    all_top5 = [x for v in qk["layers"].values() for x in v["top5"]]
    gmean = sum(qk["gaussian_top5"]) / len(qk["gaussian_top5"])
    chars = c["chars"]
    stages = [summary]  # follow the chain of stages back to the one from a random initialisation
    while "summary" in stages[0].get("init_from", {}):
        stages.insert(0, stages[0]["init_from"]["summary"])
    training = "\n".join(_stage_line(i + 1, st, pre["tokens"], t["block_len"]) for i, st in enumerate(stages))
    head_chars = f"{c['heldout_head_chars']:,}" if "heldout_head_chars" in c else "before the pretraining text"
    measured = [(i + 1, st["passkey"]) for i, st in enumerate(stages) if "passkey" in st]
    lens = sorted({int(x) for _, pk in measured for x in pk["lengths"]})
    cells = [(n, [f"{pk['by_length'][str(x)]:.2f}" if str(x) in pk["by_length"] else "-" for x in lens])
             for n, pk in measured]
    passkey_table = "\n".join([f"| after stage | {' | '.join(map(str, lens))} |", "|---|" + "---|" * len(lens)]
                              + [f"| {n} | {' | '.join(row)} |" for n, row in cells])
    depths = ", ".join(f"{d:g}" for d in measured[-1][1]["depths"]) if measured else ""
    passkey_section = f"""## Passkey retrieval (inside and beyond the training context)
`oal.evaluate.passkey` (the Landmark-attention format `oal evaluate --passkey` uses: its own filler sentences,
never trained on), greedy decoding, a 5-digit key at depths {depths} of the filler, 4 keys per depth, seed 0;
accuracy by prompt length (tokens), after each stage that measured it:

{passkey_table}

""" if measured else ""
    card = f"""# oal embedded default model

A small causal LM with the architecture the paper targets, trained here so that `oal` works offline. Built by
`scripts/train_embedded_model.py` (deterministic, resumable, seed {summary['seed']}); loaded by
`oal.models.registry.load_model("default")` or `AutoModelForCausalLM` / `AutoTokenizer` on this folder.

## Config
- `Qwen2ForCausalLM`: hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['q_heads']} query heads /
  {cfg['kv_heads']} KV heads (GQA), head_dim {cfg['head_dim']}, SwiGLU intermediate {cfg['intermediate']},
  RoPE (theta 10000), RMSNorm, tied embeddings; {summary['params']:,} parameters; trained at context
  {cfg['context']}.
- Tokenizer: byte-level BPE, {cfg['vocab']} tokens (`<pad>`=0, `</s>`=1, `<unk>`=2), trained with the
  `tokenizers` library on the pretraining text only, with Qwen2's normaliser (NFC) and pre-tokeniser, saved as the
  `Qwen2Tokenizer` transformers maps a qwen2 folder to (`AutoTokenizer.from_pretrained(dir)` loads it offline).
- Stored as {t['store_dtype']} safetensors ({size_mb:.1f} MB); load with `dtype=torch.float32` to upcast.

## Data (strictly disjoint from everything `oal run` uses)
- The `builtin` corpus: {c['source']}; Python {c['python_version']}, licence PSF-2.0. Prose units (pydoc topics,
  one unit of docstrings per stdlib file) are ordered by a hash of their name; the first 30% of the prose (by
  characters) is the held-out head of the train split, then 5% validation and 5% test; the rest of the prose
  and all the code are pretraining text. Paragraphs that repeat are kept only once, in that order.
  Characters: train {chars['train']:,} (held-out head: {head_chars}),
  validation {chars['validation']:,}, test {chars['test']:,}; corpus fingerprint `{c['fingerprint'][:16]}...`.
- Pretraining: train-split tokens {pre['token_start']:,} to the end ({pre['tokens']:,} tokens; the default split
  plan's `pretrain` role, 512-token blocks from {pre['first_block']}); the held-out head is
  {pre['heldout_head_tokens']:,} tokens, and every role of the plan (grouping, calibration, fidelity, adaptation)
  lies inside it, validation and test in their own splits. `SplitPlan.check_disjoint` enforces this, and `oal run`
  binds this record to its plan for the embedded model. Token SHA256 `{pre['sha256_tokens'][:16]}...`.
  On another Python version the corpus differs; `oal` then logs one warning line and carries on.

## Training
{training}

## Quality (test split, never trained on)
| model | test perplexity per token |
|---|---|
| this model (fp32 weights) | {t['ppl_fp32']:.3f} |
| this model (stored {t['store_dtype']} weights, upcast) | {t['ppl_stored']:.3f} |
| unigram baseline (add-one, fit on the pretraining tokens) | {t['ppl_unigram']:.3f} |

{t['blocks']} non-overlapping blocks of {t['block_len']} tokens ({t['block_len'] - 1} scored targets each).
Ratio to unigram: {t['ppl_stored'] / t['ppl_unigram']:.3f} (quality bar: at most 1/3).

## Attention regime (does a quadratic kernel have a chance?)
`oal.analysis.regime` on the default plan's 8 fidelity blocks (512 tokens), per query head: median largest
softmax weight and effective number of keys (exp of the attention entropy), logit quantiles p01 .. p99 and
range (s = q.k / sqrt(d)). Verdict: this model is {reg['verdict']['text']}

| layer | largest softmax weight | effective keys | logit p01 .. p99 | logit min .. max |
|---|---|---|---|---|
{regime_rows}

(The previous byte-level default, measured the same way on two 512-byte blocks of this plan: largest weight
0.74-1.00 and effective keys 1.0-2.8 in layers 1-4, logits p01 .. p99 -34 .. +17.)

## QK structure (does it have outliers?)
Top-5 contribution concentration = share of the total chi (Eq. 2: mean over causal pairs of |q_ir k_jr|/sqrt(d),
post-RoPE) held by the 5 largest of the 64 dimensions, on the {qk['prompts']} grouping prompts of the default
plan ({qk['prompt_len']} tokens each). Groups: number of App. B stable-gap groups (alpha
{grp['tail_fraction']}, gamma {grp['min_support']}, tau {grp['min_ratio']}, B {grp['n_bootstrap']}).

| layer | top-5 share per query head | groups per query head |
|---|---|---|
{rows}

Range over all heads: {min(all_top5):.3f} to {max(all_top5):.3f}; isotropic Gaussian control (same shapes):
{gmean:.3f}. (Paper Fig. 5: Qwen2.5-0.5B 50.7% vs 7.8% Gaussian.)

{passkey_section}## Reproduce
```bash
S=scripts/train_embedded_model.py; RUN="torchrun --standalone --nproc-per-node 2"
$RUN $S --steps 700 --bf16 --threads 1 --work-dir .cache/stage1 --out .cache/stage1_model
$RUN $S --steps 200 --lr 1e-3 --warmup 20 --logit-var-penalty 0.05 --bf16 --threads 1 --work-dir .cache/stage2 \\
    --init-from .cache/stage1/ckpt-700 --init-summary .cache/stage1_model/training_summary.json \\
    --out .cache/stage2_model
R="--answer-weight 5 --lr 1e-3 --warmup 20 --logit-var-penalty 0.05 --bf16 --threads 1"
$RUN $S --steps 300 --seq 128 --batch 32 --retrieval-frac 1.0 $R --passkey-lengths 128,256,512 \\
    --work-dir .cache/stage3 --out .cache/stage3_model \\
    --init-from .cache/stage2_model --init-summary .cache/stage2_model/training_summary.json
$RUN $S --steps 400 --seq 512 --batch 16 --retrieval-frac 0.5 $R --work-dir .cache/stage4 \\
    --init-from .cache/stage3/ckpt-300 --init-summary .cache/stage3_model/training_summary.json
```
(Checkpoints every 50 steps; rerunning a command resumes it. Summation order differs between one and two
processes, so a one-process rerun matches to rounding, not bit for bit.)

## Provenance
- `model.safetensors` SHA256 `{prov['sha256']['model.safetensors']}`.
- `training_summary.json` holds the full training record, the corpus split hashes and the pretraining range.
"""
    card = card.replace("## Provenance", _kept_section(out / "MODEL_CARD.md", "## Selection") + "## Provenance")
    tmp = out / "MODEL_CARD.md.tmp"
    tmp.write_text(card)
    os.replace(tmp, out / "MODEL_CARD.md")
    (out / "MODEL_CARD.md").chmod(0o644)
    print(f"wrote {out / 'MODEL_CARD.md'}", flush=True)


if __name__ == "__main__":
    main()
