"""Joint LoRA + kernel adaptation (paper App. F.2), resumable after a kill, data-parallel across processes.

LoRA (peft) on q/k/v/o of every layer, softmax layers included; the backbone stays frozen. Kernel parameters of
converted layers (OAL factors, global, DiJiang theta, SpectraFormer B/G/S, TaylorShift tau) train jointly from
their calibrated start; groups are buffers and stay fixed. AdamW + linear warmup (5%) + cosine decay, grad-norm
clip 1.0, batch 1. Validation NLL every `val_every` updates on fixed blocks picks the checkpoint (never test).

Several processes (`torchrun`, `accelerate launch`; see `oal.distributed`) compute what one process computes: an
update takes the next `batch_size x processes x grad_accum` blocks (the global batch) of one block order that does
not depend on the number of processes; process r takes its `batch_size` blocks of each micro-batch, DDP averages
the gradients (blocks have equal length, so the mean of the per-process mean losses is the global-batch mean),
gradients are clipped by their global norm, and the validation NLL is summed over the processes' shares of the
validation blocks, the same number on every process. So N processes with batch b equal one process with batch N*b,
up to the order of floating-point reductions (with `lora_dropout=0`: dropout masks are drawn per process).

Exact resume: a checkpoint holds trainable tensors, the best tensors so far, the optimizer state (its tensors in
safetensors, the rest in JSON: no pickle), the scheduler, every process's RNG state and the step, with the SHA256 of
each file in state.json (a damaged checkpoint is reported and adaptation starts over). The block order is a pure
function of the seed, so a resumed run replays exactly the updates an uninterrupted one makes. Only the main process
writes checkpoints; on resume it reads and checks them and hands the same state to every process.

A saved adapter records the SHA256 of each of its files and of the converted model it was trained on
(`oal_adapter.json`); `load_adapter` checks both before use.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import get_cosine_schedule_with_warmup

from .distributed import Ranks, ranks, training_accelerator
from .evaluate.perplexity import block_nll
from .runio import (
    atomic_dir,
    atomic_save_safetensors,
    atomic_write_json,
    config_hash,
    existing_dir,
    from_known_keys,
    load_json,
    load_safetensors,
    sha256_file,
    tensor_hash,
)

__all__ = ["AdaptConfig", "AdaptResult", "adapt", "adapt_identity", "check_adapter", "converted_model_sha256",
           "kernel_parameter_names", "load_adapter", "save_adapter", "wrap_lora"]

_PEFT_PREFIX = "base_model.model."
ADAPTER_MANIFEST = "oal_adapter.json"
ADAPTER_FORMAT = "oal-adapter/1"
log = logging.getLogger("oal")


@contextlib.contextmanager
def _quiet_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model (a FutureWarning that
    says nothing to our users); silence that one warning where it arises."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def converted_model_sha256(model) -> str:
    """SHA256 of every tensor of a (converted) model, its kernel tensors included: what an adapter was trained on.

    Floating tensors are hashed as float32, so the same weights loaded in bfloat16/float16 or upcast to float32
    (both exact) give the same fingerprint, while other weights never do."""
    from .models.registry import state_dict_sha256

    return state_dict_sha256(model, torch.float32, kernels=True)


@dataclass
class AdaptConfig:
    """App. F.2 defaults; `steps`/`val_every` are the paper's 512/128 (presets shrink them for the CPU).

    `batch_size` blocks per process and micro-batch, `grad_accum` micro-batches per update: an update averages
    batch_size x processes x grad_accum blocks (the paper: 1 x 1 x 1)."""

    steps: int = 512
    lr: float = 5e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    val_every: int = 128
    ckpt_every: int = 32
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    train_kernel: bool = True
    seed: int = 42
    batch_size: int = 1
    grad_accum: int = 1

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.target_modules = tuple(self.target_modules)
        for name in ("steps", "val_every", "ckpt_every", "lora_r", "batch_size", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a finite number > 0, got {self.lr!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac: expected a value in [0, 1), got {self.warmup_frac!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout: expected a value in [0, 1), got {self.lora_dropout!r}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip: expected > 0, got {self.grad_clip!r}")

    @classmethod
    def from_dict(cls, d: dict) -> AdaptConfig:
        return from_known_keys(cls, d, "adapt config")

    def to_dict(self) -> dict:
        return asdict(self)


# Settings that arrived with data parallelism, at the values that change nothing (the paper's protocol).
_NEUTRAL = {"batch_size": 1, "grad_accum": 1}


def adapt_identity(cfg: AdaptConfig, processes: int = 1) -> dict:
    """What adaptation results depend on: the settings, and the number of processes (it sets the global batch).
    batch_size 1, grad_accum 1 and one process are left out, so that run directories and checkpoints made before
    these settings existed stay valid: they compute exactly what those did."""
    d = {k: v for k, v in cfg.to_dict().items() if not (k in _NEUTRAL and v == _NEUTRAL[k])}
    return d if processes == 1 else {**d, "processes": processes}


@dataclass
class AdaptResult:
    best_step: int
    best_val_nll: float
    steps: int
    n_lora_params: int
    n_kernel_params: int
    kernel_change: float  # |theta_final - theta_calibrated| over kernel parameters (0 when none train)
    kernel_names: list[str] = field(default_factory=list)  # trained kernel parameters (names without peft prefix)
    base_sha256: str = ""  # converted_model_sha256 of the model before adaptation (what the adapter is bound to)
    history: list[dict] = field(default_factory=list)  # per update: step, loss (global-batch mean), lr
    validation: list[dict] = field(default_factory=list)  # step, val_nll
    processes: int = 1  # processes that trained it (data parallel)
    global_batch: int = 1  # blocks per update: batch_size x processes x grad_accum

    def to_dict(self) -> dict:
        return asdict(self)


def kernel_parameter_names(model) -> list[str]:
    """Names of the converted layers' trainable kernel parameters (call before LoRA freezes them)."""
    from .models.convert import kernel_parameters

    ids = {id(p) for p in kernel_parameters(model) if p.requires_grad}
    return [name for name, p in model.named_parameters() if id(p) in ids]


def _count_kernel_params(model) -> int:
    """Trained kernel coefficients of the converted layers, as the paper counts them (no padding)."""
    from .models.convert import converted_methods

    return sum(m.n_kernel_params for m in converted_methods(model).values())


def _strip(name: str) -> str:
    return name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name


def wrap_lora(model, cfg: AdaptConfig):
    """peft LoRA on cfg.target_modules of every layer; re-enable kernel parameters when cfg.train_kernel."""
    from peft import LoraConfig, get_peft_model

    kernel_names = set(kernel_parameter_names(model)) if cfg.train_kernel else set()
    torch.manual_seed(cfg.seed)  # LoRA A initialisation
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    with _quiet_peft():
        peft_model = get_peft_model(model, lora)
    for name, p in peft_model.named_parameters():
        if _strip(name) in kernel_names:
            p.requires_grad_(True)
    return peft_model, sorted(kernel_names)


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _block_order(n_blocks: int, steps: int, seed: int) -> list[int]:
    """Training-block order: concatenated seeded permutations, identical for every arm of a backbone."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order += torch.randperm(n_blocks, generator=gen).tolist()
    return order[:steps]


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    cuda = [states[k] for k in sorted(k for k in states if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _save_optimizer(folder: Path, optimizer) -> None:
    """The optimizer's state_dict without pickle: its tensors in safetensors, everything else in JSON."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v
            else:
                scalars.setdefault(str(idx), {})[k] = v
    if tensors:
        atomic_save_safetensors(folder / "optimizer.safetensors", tensors)
    atomic_write_json(folder / "optimizer.json", {"param_groups": sd["param_groups"], "scalars": scalars,
                                                  "state": {str(i): sorted(st) for i, st in sd["state"].items()}})


def _read_optimizer(folder: Path) -> dict:
    """The optimizer state_dict `_save_optimizer` wrote (tuples such as betas restored)."""
    meta = load_json(folder / "optimizer.json")
    tensors = load_safetensors(folder / "optimizer.safetensors") if meta["state"] else {}
    state = {}
    for idx, keys in meta["state"].items():
        scalars = meta["scalars"].get(idx, {})
        state[int(idx)] = {k: tensors[f"{idx}.{k}"] if f"{idx}.{k}" in tensors else scalars[k] for k in keys}
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _rng_name(rank: int, name: str) -> str:
    """Key of a process's RNG state in rng.safetensors (the main process's under the names one process uses)."""
    return name if rank == 0 else f"rank{rank}.{name}"


def _save_checkpoint(ckpt_dir: Path, params, best, optimizer, scheduler, state: dict, rngs: list[dict]) -> None:
    """Main process only. `rngs`: every process's RNG state, in rank order."""
    with atomic_dir(ckpt_dir) as tmp:
        atomic_save_safetensors(tmp / "trainable.safetensors", {n: p.data for n, p in params.items()})
        atomic_save_safetensors(tmp / "best.safetensors", best)
        atomic_save_safetensors(tmp / "rng.safetensors", {_rng_name(r, k): v for r, rng in enumerate(rngs)
                                                          for k, v in rng.items()})
        _save_optimizer(tmp, optimizer)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / "state.json", {**state, "scheduler": scheduler.state_dict(), "sha256": files})


def _read_checkpoint(ckpt_dir: Path, key: str, names: set[str], processes: int) -> dict | None:
    """The saved state of the same configuration (and number of processes); None when there is none, it is of
    another configuration, or it is damaged (reported; adaptation then starts over). Everything is read and checked
    here, before anything is restored."""
    found = existing_dir(ckpt_dir)
    if found is None or not (found / "state.json").exists():
        return None
    try:
        state = load_json(found / "state.json")
        if state.get("key") != key:
            return None  # another configuration: start over rather than mix runs
        bad = sorted(f for f, h in state.get("sha256", {}).items()
                     if not (found / f).is_file() or sha256_file(found / f) != h)
        if bad or not state.get("sha256"):
            raise ValueError(f"{', '.join(bad) or 'state.json'} changed since it was written")
        saved = load_safetensors(found / "trainable.safetensors")
        opt_state = _read_optimizer(found)
        rng = load_safetensors(found / "rng.safetensors")
        best = load_safetensors(found / "best.safetensors")
        rngs = [{k: rng[_rng_name(r, k)] for k in {n.split(".")[-1] for n in rng} if _rng_name(r, k) in rng}
                for r in range(processes)]
        if not all(rngs):
            raise ValueError(f"rng.safetensors lacks the RNG state of some of {processes} processes")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("adaptation checkpoint %s is damaged (%s); starting adaptation over", found, exc)
        return None
    if set(saved) != names:
        return None
    state.pop("sha256", None)
    return {"state": state, "trainable": saved, "optimizer": opt_state, "rngs": rngs, "best": best}


def _restore(saved: dict, params, optimizer, scheduler, rank: int) -> tuple[dict, dict]:
    """Load what `_read_checkpoint` read into this process's tensors, optimizer, scheduler and RNG; returns the
    loop state and the best tensors so far."""
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved["trainable"][n])
    optimizer.load_state_dict(saved["optimizer"])
    state = dict(saved["state"])
    scheduler.load_state_dict(state.pop("scheduler"))
    _set_rng_state(saved["rngs"][rank])
    return state, saved["best"]


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
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("val NLL {task.fields[val]}"), TimeRemainingColumn(),
        transient=False, disable=not enabled,
    )


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
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] < 2:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"{name}: expected a non-empty integer tensor [n_blocks, L >= 2], got {got}")
    base_sha256 = converted_model_sha256(model)
    peft_model, kernel_names = wrap_lora(model, cfg)
    params = _trainable(peft_model)
    kernel_set = set(kernel_names)
    kernel_start = {n: p.detach().clone() for n, p in params.items() if _strip(n) in kernel_set}
    device = next(peft_model.parameters()).device
    acc = training_accelerator(device, cfg.grad_accum)
    group = ranks(device)
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(round(cfg.warmup_frac * cfg.steps)), cfg.steps)
    # DDP across the processes of a launch (one process: the model as it is); the scheduler is ours, stepped once
    # per update (accelerate's would step once per process)
    train_model, optimizer = acc.prepare(peft_model, optimizer)
    per_update = cfg.batch_size * group.size * cfg.grad_accum  # the global batch
    order = _block_order(train_blocks.shape[0], cfg.steps * per_update, cfg.seed)
    key = config_hash({"cfg": adapt_identity(cfg, group.size), "train": tensor_hash(train_blocks),
                       "val": tensor_hash(val_blocks), "params": sorted(params),
                       "kernel_start": {n: tensor_hash(v) for n, v in kernel_start.items()}, "base": base_sha256})

    state = {"key": key, "step": 0, "best_step": -1, "best_val_nll": math.inf, "history": [], "validation": []}
    best = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(cfg.seed + 1 + group.index)  # dropout stream, one per process
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
    if ckpt_dir is not None:  # the main process reads and checks the checkpoint; every process restores the same one
        saved = group.on_main(lambda: _read_checkpoint(ckpt_dir, key, set(params), group.size))
        if saved is not None:
            state, best = _restore(saved, params, optimizer, scheduler, group.index)

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
                ids = train_blocks[order[start : start + cfg.batch_size]].to(device)
                with acc.accumulate(train_model):  # gradients are averaged across processes on the last one
                    loss = train_model(input_ids=ids, labels=ids).loss
                    acc.backward(loss)  # divided by grad_accum
                losses.append(loss.detach())
            acc.clip_grad_norm_(list(params.values()), cfg.grad_clip)  # the gradients are global by now
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(acc.reduce(torch.stack(losses).mean(), reduction="mean"))  # over the global batch
            state["step"] += 1
            step = state["step"]
            state["history"].append({"step": step, "loss": loss, "lr": lr})
            if not math.isfinite(loss):
                raise FloatingPointError(f"adapt: non-finite training loss at update {step}")
            validate = step % cfg.val_every == 0 or step == cfg.steps
            if validate:
                val_nll = _validation_nll(peft_model, val_blocks, group)
                state["validation"].append({"step": step, "val_nll": val_nll})
                if val_nll < state["best_val_nll"]:
                    state["best_val_nll"], state["best_step"] = val_nll, step
                    best = {n: p.detach().clone() for n, p in params.items()}
                bar.update(task, val=f"{val_nll:.4f}")
            bar.update(task, advance=1, loss=f"{loss:.4f}")
            if ckpt_dir is not None and (validate or step % cfg.ckpt_every == 0):
                rngs = group.gather(_rng_state())
                if group.is_main:
                    _save_checkpoint(ckpt_dir, params, best, optimizer, scheduler, state, rngs)
            if on_step is not None:
                on_step(step)

    acc.free_memory()  # drop accelerate's references to the model (the DDP wrapper and its gradient hooks)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(best[n])
    change = sum(float((params[n].detach() - v).pow(2).sum()) for n, v in kernel_start.items()) ** 0.5
    result = AdaptResult(
        best_step=state["best_step"], best_val_nll=state["best_val_nll"], steps=state["step"],
        n_lora_params=sum(p.numel() for n, p in params.items() if _strip(n) not in kernel_set),
        n_kernel_params=_count_kernel_params(model) if kernel_start else 0, kernel_change=change,
        kernel_names=kernel_names, base_sha256=base_sha256,
        history=state["history"], validation=state["validation"], processes=group.size, global_batch=per_update,
    )
    peft_model.eval()
    return peft_model, result


def save_adapter(peft_model, out_dir: str | Path, result: AdaptResult | None = None,
                 kernel_names: list[str] | None = None, *, base_sha256: str | None = None) -> Path:
    """DIR/adapter/: peft `save_pretrained` + `kernel_params.safetensors` (trained kernel tensors) + adapt.json, and
    `oal_adapter.json` with the SHA256 of each file and of the converted model it was trained on (`base_sha256`,
    default: `result.base_sha256`)."""
    out_dir = Path(out_dir)
    base_sha256 = base_sha256 or (result.base_sha256 if result is not None else None)
    if not base_sha256:
        raise ValueError("base_sha256: expected the converted_model_sha256 of the model before adaptation (or an "
                         "AdaptResult that holds it); an adapter must record what it was trained on")
    if kernel_names is None:
        kernel_names = result.kernel_names if result is not None else [
            _strip(n) for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    named = {_strip(n): p for n, p in peft_model.named_parameters()}
    with atomic_dir(out_dir) as tmp:
        peft_model.save_pretrained(str(tmp))
        if kernel_names:  # the softmax arm has no kernel parameters (and safetensors cannot read an empty file)
            atomic_save_safetensors(tmp / "kernel_params.safetensors", {n: named[n].data for n in kernel_names})
        if result is not None:
            atomic_write_json(tmp / "adapt.json", result.to_dict())
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / ADAPTER_MANIFEST, {
            "format": ADAPTER_FORMAT, "sha256": files,
            "base": {"state_dict_sha256": base_sha256}})
    return out_dir


def check_adapter(adapter_dir: str | Path, model=None) -> dict:
    """Check a saved adapter before use: every file it recorded has its SHA256 and, given `model` (converted, not
    yet adapted), that model is the one it was trained on. Returns the manifest; ValueError naming the file."""
    adapter_dir = Path(adapter_dir)
    manifest_path = adapter_dir / ADAPTER_MANIFEST
    if not (adapter_dir / "adapter_config.json").exists():
        raise ValueError(f"adapter_dir: {adapter_dir} has no adapter_config.json (not a saved adapter)")
    if not manifest_path.is_file():
        raise ValueError(f"adapter_dir: {adapter_dir} has no {ADAPTER_MANIFEST} (no record of its files' hashes); "
                         "adapt again with this version of oal")
    manifest = load_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != ADAPTER_FORMAT or "sha256" not in manifest:
        raise ValueError(f"{manifest_path}: expected format {ADAPTER_FORMAT!r} with file hashes")
    for name, want in sorted(manifest["sha256"].items()):
        f = adapter_dir / name
        if not f.is_file():
            raise ValueError(f"{f}: missing (recorded in {manifest_path})")
        if sha256_file(f) != want:
            raise ValueError(f"{f}: SHA256 does not match {manifest_path} (file changed or truncated)")
    if model is not None:
        base = manifest.get("base") or {}
        have = converted_model_sha256(model)
        if have != base.get("state_dict_sha256"):
            raise ValueError(f"adapter_dir: the adapter in {adapter_dir} was trained on another model (sha256 "
                             f"{str(base.get('state_dict_sha256'))[:12]}) than the one given (sha256 {have[:12]}): "
                             "other base weights or other kernels")
    return manifest


def load_adapter(model, adapter_dir: str | Path):
    """Attach a saved LoRA adapter to `model` (already converted, if it was) and load its trained kernel tensors,
    after `check_adapter` (file hashes, and that `model` is the model the adapter was trained on)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    check_adapter(adapter_dir, model)
    kernel_path = adapter_dir / "kernel_params.safetensors"
    kernels = load_safetensors(kernel_path) if kernel_path.exists() else {}
    named = dict(model.named_parameters())
    missing = [n for n in kernels if n not in named]
    if missing:
        raise ValueError(f"adapter_dir: kernel parameters {missing[:3]} do not exist in the model "
                         "(was it converted with the same layers and methods?)")
    with torch.no_grad():
        for n, t in kernels.items():
            if named[n].shape != t.shape:
                raise ValueError(f"adapter_dir: {n} has shape {tuple(t.shape)}, model has {tuple(named[n].shape)}")
            named[n].copy_(t)
    with _quiet_peft():
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    peft_model.eval()
    return peft_model
