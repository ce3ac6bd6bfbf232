"""Joint LoRA + kernel adaptation (paper App. F.2), resumable after a kill, data-parallel across processes.

LoRA (peft) on q/k/v/o of every layer, softmax layers included; the backbone stays frozen. Kernel parameters of
converted layers (OAL factors, global, DiJiang theta, SpectraFormer B/G/S, TaylorShift tau) train jointly with it,
from where the caller's model holds them (a run: OAL and the learned global calibrated, the baselines at their
initial values, App. F.1-F.2); groups are buffers and stay fixed. AdamW + linear warmup (5%) + cosine decay, grad-norm
clip 1.0, batch 1. The loss is computed without full-vocabulary logits (`oal.evaluate.loss`). Validation NLL
every `val_every` updates on fixed blocks picks the checkpoint (never test); a non-finite training loss or
validation NLL stops adaptation with FloatingPointError.

Several processes (`torchrun`, `accelerate launch`; see `oal.launch`) compute what one process computes: an
update takes the next `batch_size x processes x grad_accum` blocks (the global batch) of one block order that does
not depend on the number of processes; process r takes its `batch_size` blocks of each micro-batch, DDP averages
the gradients (blocks have equal length, so the mean of the per-process mean losses is the global-batch mean),
gradients are clipped by their global norm, and the validation NLL is summed over the processes' shares of the
validation blocks, the same number on every process. So N processes with batch b equal one process with batch N*b,
up to the order of floating-point reductions (with `lora_dropout=0`: dropout masks are drawn per process).

Exact resume (`adaptation.checkpoint`): the block order is a pure function of the seed, so a resumed run replays
exactly the updates an uninterrupted one makes. Only the main process writes checkpoints; on resume it reads and
checks them and hands the same state to every process.

The trained adapter is saved and checked by `adaptation.adapter`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import get_cosine_schedule_with_warmup

from oal.adaptation.adapter import converted_model_sha256, quiet_peft, strip_peft_prefix
from oal.adaptation.checkpoint import read_checkpoint, restore_checkpoint, rng_state, save_checkpoint
from oal.adaptation.config import AdaptConfig, AdaptResult, adapt_identity
from oal.device import module_device
from oal.evaluate.loss import CausalLMLoss
from oal.evaluate.perplexity import block_nll
from oal.launch import Ranks, log_console, peer_errors, progress_bar, ranks, training_accelerator
from oal.models.attention import converted_methods, kernel_parameters
from oal.rundir.hashes import config_hash, tensor_hash

__all__ = ["adapt", "kernel_parameter_names", "wrap_lora"]

log = logging.getLogger("oal")


def kernel_parameter_names(model) -> list[str]:
    """Names of the converted layers' trainable kernel parameters (call before LoRA freezes them)."""
    ids = {id(p) for p in kernel_parameters(model) if p.requires_grad}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def _count_kernel_params(model) -> int:
    """Trained kernel coefficients of the converted layers, as the paper counts them (no padding)."""
    return sum(m.n_kernel_params for m in converted_methods(model).values())


def wrap_lora(model, cfg: AdaptConfig):
    """peft LoRA on cfg.target_modules of every layer; re-enable kernel parameters when cfg.train_kernel."""
    from peft import LoraConfig, get_peft_model

    kernel_names = set(kernel_parameter_names(model)) if cfg.train_kernel else set()
    if cfg.train_kernel and not kernel_names and kernel_parameters(model):  # (fixed draws are buffers)
        log.warning("train_kernel: the converted layers' kernel parameters are frozen (requires_grad False, e.g. "
                    "after model.requires_grad_(False)), so only LoRA trains; unfreeze them to train the kernel")
    torch.manual_seed(cfg.seed)  # LoRA A initialisation
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with quiet_peft():
        peft_model = get_peft_model(model, lora)
    for name, p in peft_model.named_parameters():
        if strip_peft_prefix(name) in kernel_names:
            p.requires_grad_(True)
    return peft_model, sorted(kernel_names)


# the command-line options of the settings a launch's processes must share (named in the error when they differ)
_OPTIONS = {k: "--" + k.replace("_", "-") for k in ("steps", "val_every", "batch_size", "grad_accum", "lora_dropout")}


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _block_order(n_blocks: int, steps: int, seed: int) -> list[int]:
    """Training-block order: concatenated seeded permutations, identical for every arm of a backbone."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order += torch.randperm(n_blocks, generator=gen).tolist()
    return order[:steps]


def _validation_nll(model, val_blocks: torch.Tensor, group: Ranks) -> float:
    """Mean next-token NLL over `val_blocks`. Each process scores its share (blocks r, r + N, ...) and the sums are
    added up, so every process gets the same number (one process: `block_nll` over all blocks)."""
    if group.size == 1:
        total, count = block_nll(model, val_blocks)
        return total / count
    share = val_blocks[group.index::group.size]
    total, count = block_nll(model, share) if share.shape[0] else (0.0, 0)
    summed = group.sum(torch.tensor([total, float(count)], dtype=torch.float64))
    return summed[0].item() / summed[1].item()


def _progress(enabled: bool) -> Progress:
    # a file's log gets a line a minute (launch.progress_bar), with the loss and validation NLL of the moment
    return progress_bar(enabled, log_console(), (
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("val NLL {task.fields[val]}"), TimeRemainingColumn()))


def adapt(
    model,
    train_blocks: torch.Tensor,
    val_blocks: torch.Tensor,
    cfg: AdaptConfig | None = None,
    *,
    ckpt_dir: str | Path | None = None,
    progress: bool = True,
    description: str = "adapt",
    on_step: Callable[[int], None] | None = None,
):
    """Train LoRA (+ kernel parameters) on `train_blocks` [n, L]; select on `val_blocks` [m, L'].

    Returns (peft_model with the best checkpoint loaded, AdaptResult). With `ckpt_dir`, checkpoints are written
    every `cfg.ckpt_every` updates and at each validation, and an existing checkpoint of the same configuration
    is resumed. `on_step(step)` is called after each completed update (tests use it to simulate a kill).

    Under a launch of several processes, every process calls it with the same arguments (see the module docstring);
    all of them return the same tensors, and only the main process writes `ckpt_dir`.
    """
    cfg = cfg or AdaptConfig()
    for name, blocks in (("train_blocks", train_blocks), ("val_blocks", val_blocks)):
        ids = isinstance(blocks, torch.Tensor) and not (blocks.is_floating_point() or blocks.is_complex()
                                                        or blocks.dtype == torch.bool)  # float ids failed deep inside
        if not ids or blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] < 2:
            got = f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"{name}: expected a non-empty integer tensor [n_blocks, L >= 2], got {got}")
    base_sha256 = converted_model_sha256(model)
    # which layers run which method: a method without tensors (swa) leaves no trace in the tensor fingerprint, and a
    # checkpoint of another conversion must not be resumed
    conversion = {i: [m.name, {k: getattr(m, k) for k in m.settings}] for i, m in converted_methods(model).items()}
    # base_sha256 hashes as float32, so a bfloat16 model and its float32 upcast share it; a checkpoint of one must not
    # be resumed by the other (float32 alone is left out: checkpoints written before this stay valid)
    precision = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    peft_model, kernel_names = wrap_lora(model, cfg)
    params = _trainable(peft_model)
    kernel_set = set(kernel_names)
    kernel_start = {n: p.detach().clone() for n, p in params.items() if strip_peft_prefix(n) in kernel_set}
    device = module_device(peft_model)
    train_blocks, val_blocks = train_blocks.to(device), val_blocks.to(device)  # once, where the model is
    acc = training_accelerator(device, cfg.grad_accum)
    group = ranks(device)
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(round(cfg.warmup_frac * cfg.steps)), cfg.steps)
    # DDP across the processes of a launch (one process: the model as it is); the scheduler is ours, stepped once
    # per update (accelerate's would step once per process)
    # the loss module runs the decoder and the chunked LM head + cross-entropy (oal.evaluate.loss): no [N, V] logits
    train_model, optimizer = acc.prepare(CausalLMLoss(peft_model), optimizer)
    per_update = cfg.batch_size * group.size * cfg.grad_accum  # the global batch
    if per_update > train_blocks.shape[0] and group.is_main:
        log.warning("adapt: an update takes %d blocks (batch %d x grad_accum %d x %d processes) and there are %d "
                    "training blocks: blocks repeat within an update", per_update, cfg.batch_size, cfg.grad_accum,
                    group.size, train_blocks.shape[0])
    order = _block_order(train_blocks.shape[0], cfg.steps * per_update, cfg.seed)
    inputs = {"train": tensor_hash(train_blocks), "val": tensor_hash(val_blocks), "params": sorted(params),
              "kernel_start": {n: tensor_hash(v) for n, v in kernel_start.items()}, "base": base_sha256,
              "conversion": conversion, **({"precision": precision} if precision != ["float32"] else {})}
    identity = adapt_identity(cfg, group.size)
    # processes given other settings or data would each train their own schedule while DDP averaged their gradients
    # (one that stops first leaves the other's collectives matched with unrelated ones): refused on every process
    group.agree({**cfg.to_dict(), **inputs}, _OPTIONS)
    key = config_hash({"cfg": identity, **inputs})

    state = {"key": key, "step": 0, "best_step": -1, "best_val_nll": math.inf, "history": [], "validation": []}
    best = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(cfg.seed + 1 + group.index)  # dropout stream, one per process
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
    if ckpt_dir is not None:  # the main process reads and checks the checkpoint; every process restores the same one
        saved = group.on_main(lambda: read_checkpoint(ckpt_dir, key, set(params), group.size))
        if saved is not None:
            state, best = restore_checkpoint(saved, params, optimizer, scheduler, group.index)
            if group.is_main:
                log.info("%s: resuming at update %d of %d from its checkpoint in %s", description, state["step"],
                         cfg.steps, ckpt_dir)

    train_model.train()
    with _progress(progress and group.is_main) as bar:
        last_val = state["validation"][-1]["val_nll"] if state["validation"] else None
        task = bar.add_task(description, total=cfg.steps, completed=state["step"], loss="-",
                            val=f"{last_val:.4f}" if last_val is not None else "-", visible=progress)
        while state["step"] < cfg.steps:
            first = state["step"] * per_update
            losses = []
            for micro in range(cfg.grad_accum):  # this process's batch_size blocks of each micro-batch
                start = first + (micro * group.size + group.index) * cfg.batch_size
                ids = train_blocks[order[start : start + cfg.batch_size]]
                # gradients are averaged across processes on the last one (a process that stopped: one line)
                with acc.accumulate(train_model), peer_errors():
                    loss = train_model(ids)
                    acc.backward(loss)  # divided by grad_accum
                losses.append(loss.detach())
            acc.clip_grad_norm_(list(params.values()), cfg.grad_clip)  # the gradients are global by now
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            with peer_errors():
                loss = float(acc.reduce(torch.stack(losses).mean(), reduction="mean"))  # over the global batch
            state["step"] += 1
            step = state["step"]
            state["history"].append({"step": step, "loss": loss, "lr": lr})
            if not math.isfinite(loss):
                raise FloatingPointError(f"adapt: non-finite training loss at update {step}")
            validate = step % cfg.val_every == 0 or step == cfg.steps
            if validate:
                val_nll = _validation_nll(peft_model, val_blocks, group)
                if not math.isfinite(val_nll):  # never "better": all NaN would select the untrained start
                    raise FloatingPointError(f"adapt: non-finite validation NLL at update {step}")
                state["validation"].append({"step": step, "val_nll": val_nll})
                if val_nll < state["best_val_nll"]:
                    state["best_val_nll"], state["best_step"] = val_nll, step
                    best = {n: p.detach().clone() for n, p in params.items()}
                bar.update(task, val=f"{val_nll:.4f}")
            bar.update(task, advance=1, loss=f"{loss:.4f}")
            if ckpt_dir is not None and (validate or step % cfg.ckpt_every == 0):
                rngs = group.gather(rng_state())
                if group.is_main:
                    save_checkpoint(ckpt_dir, params, best, optimizer, scheduler, state, rngs)
            if on_step is not None:
                on_step(step)

    acc.free_memory()  # drop accelerate's references to the model (the DDP wrapper and its gradient hooks)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(best[n])
    change = sum(float((params[n].detach() - v).pow(2).sum()) for n, v in kernel_start.items()) ** 0.5
    result = AdaptResult(
        best_step=state["best_step"], best_val_nll=state["best_val_nll"], steps=state["step"],
        n_lora_params=sum(p.numel() for n, p in params.items() if strip_peft_prefix(n) not in kernel_set),
        n_kernel_params=_count_kernel_params(model) if kernel_start else 0, kernel_change=change,
        kernel_names=kernel_names, base_sha256=base_sha256,
        history=state["history"], validation=state["validation"], processes=group.size, global_batch=per_update,
    )
    peft_model.eval()
    return peft_model, result


