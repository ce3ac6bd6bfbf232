"""Joint LoRA + kernel adaptation (paper App. F.2), resumable after a kill.

LoRA (peft) on q/k/v/o of every layer, softmax layers included; the backbone stays frozen. Kernel parameters of
converted layers (OAL factors, global, DiJiang theta, SpectraFormer B/G/S, TaylorShift tau) train jointly from
their calibrated start; groups are buffers and stay fixed. AdamW + linear warmup (5%) + cosine decay, grad-norm
clip 1.0, batch 1. Validation NLL every `val_every` updates on fixed blocks picks the checkpoint (never test).

Exact resume: a checkpoint holds trainable tensors, the best tensors so far, the optimizer (torch.save, read back
with weights_only=True), the scheduler, the RNG state and the step. The block order is a pure function of the
seed, so a resumed run replays exactly the updates an uninterrupted one makes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import get_cosine_schedule_with_warmup

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
    tensor_hash,
)

__all__ = ["AdaptConfig", "AdaptResult", "adapt", "kernel_parameter_names", "load_adapter", "save_adapter",
           "wrap_lora"]

_PEFT_PREFIX = "base_model.model."


@dataclass
class AdaptConfig:
    """App. F.2 defaults; `steps`/`val_every` are the paper's 512/128 (presets shrink them for the CPU)."""

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

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.target_modules = tuple(self.target_modules)
        for name in ("steps", "val_every", "ckpt_every", "lora_r"):
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


@dataclass
class AdaptResult:
    best_step: int
    best_val_nll: float
    steps: int
    n_lora_params: int
    n_kernel_params: int
    kernel_change: float  # |theta_final - theta_calibrated| over kernel parameters (0 when none train)
    kernel_names: list[str] = field(default_factory=list)  # trained kernel parameters (names without peft prefix)
    history: list[dict] = field(default_factory=list)  # per update: step, loss, lr
    validation: list[dict] = field(default_factory=list)  # step, val_nll

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


def _save_checkpoint(ckpt_dir: Path, params, best, optimizer, scheduler, state: dict) -> None:
    with atomic_dir(ckpt_dir) as tmp:
        atomic_save_safetensors(tmp / "trainable.safetensors", {n: p.data for n, p in params.items()})
        atomic_save_safetensors(tmp / "best.safetensors", best)
        atomic_save_safetensors(tmp / "rng.safetensors", _rng_state())
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        atomic_write_json(tmp / "state.json", {**state, "scheduler": scheduler.state_dict()})


def _load_checkpoint(ckpt_dir: Path, params, optimizer, scheduler, key: str):
    ckpt_dir = existing_dir(ckpt_dir)
    if ckpt_dir is None or not (ckpt_dir / "state.json").exists():
        return None
    state_path = ckpt_dir / "state.json"
    state = load_json(state_path)
    if state.get("key") != key:
        return None  # another configuration: start over rather than mix runs
    saved = load_safetensors(ckpt_dir / "trainable.safetensors")
    if set(saved) != set(params):
        return None
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n])
    optimizer.load_state_dict(torch.load(ckpt_dir / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(state.pop("scheduler"))
    _set_rng_state(load_safetensors(ckpt_dir / "rng.safetensors"))
    state["best"] = load_safetensors(ckpt_dir / "best.safetensors")
    return state


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
    """
    cfg = cfg or AdaptConfig()
    for name, blocks in (("train_blocks", train_blocks), ("val_blocks", val_blocks)):
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] < 2:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise ValueError(f"{name}: expected a non-empty integer tensor [n_blocks, L >= 2], got {got}")
    peft_model, kernel_names = wrap_lora(model, cfg)
    params = _trainable(peft_model)
    kernel_set = set(kernel_names)
    kernel_start = {n: p.detach().clone() for n, p in params.items() if _strip(n) in kernel_set}
    device = next(peft_model.parameters()).device
    optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(round(cfg.warmup_frac * cfg.steps)), cfg.steps)
    order = _block_order(train_blocks.shape[0], cfg.steps, cfg.seed)
    key = config_hash({"cfg": cfg.to_dict(), "train": tensor_hash(train_blocks), "val": tensor_hash(val_blocks),
                       "params": sorted(params), "kernel_start": {n: tensor_hash(v) for n, v in kernel_start.items()}})

    state = {"key": key, "step": 0, "best_step": -1, "best_val_nll": math.inf, "history": [], "validation": []}
    best = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(cfg.seed + 1)  # dropout stream
    ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else None
    if ckpt_dir is not None:
        resumed = _load_checkpoint(ckpt_dir, params, optimizer, scheduler, key)
        if resumed is not None:
            best = resumed.pop("best")
            state = resumed

    peft_model.train()
    with _progress(progress) as bar:
        last_val = state["validation"][-1]["val_nll"] if state["validation"] else None
        task = bar.add_task(description, total=cfg.steps, completed=state["step"], loss="-",
                            val=f"{last_val:.4f}" if last_val is not None else "-", visible=progress)
        while state["step"] < cfg.steps:
            ids = train_blocks[order[state["step"]]].unsqueeze(0).to(device)
            loss = peft_model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            step = state["step"]
            state["history"].append({"step": step, "loss": float(loss.detach()), "lr": lr})
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"adapt: non-finite training loss at update {step}")
            validate = step % cfg.val_every == 0 or step == cfg.steps
            if validate:
                total, count = block_nll(peft_model, val_blocks)
                val_nll = total / count
                state["validation"].append({"step": step, "val_nll": val_nll})
                if val_nll < state["best_val_nll"]:
                    state["best_val_nll"], state["best_step"] = val_nll, step
                    best = {n: p.detach().clone() for n, p in params.items()}
                bar.update(task, val=f"{val_nll:.4f}")
            bar.update(task, advance=1, loss=f"{float(loss.detach()):.4f}")
            if ckpt_dir is not None and (validate or step % cfg.ckpt_every == 0):
                _save_checkpoint(ckpt_dir, params, best, optimizer, scheduler, state)
            if on_step is not None:
                on_step(step)

    with torch.no_grad():
        for n, p in params.items():
            p.copy_(best[n])
    change = sum(float((params[n].detach() - v).pow(2).sum()) for n, v in kernel_start.items()) ** 0.5
    result = AdaptResult(
        best_step=state["best_step"], best_val_nll=state["best_val_nll"], steps=state["step"],
        n_lora_params=sum(p.numel() for n, p in params.items() if _strip(n) not in kernel_set),
        n_kernel_params=_count_kernel_params(model) if kernel_start else 0, kernel_change=change,
        kernel_names=kernel_names,
        history=state["history"], validation=state["validation"],
    )
    peft_model.eval()
    return peft_model, result


def save_adapter(peft_model, out_dir: str | Path, result: AdaptResult | None = None,
                 kernel_names: list[str] | None = None) -> Path:
    """DIR/adapter/: peft `save_pretrained` + `kernel_params.safetensors` (trained kernel tensors) + adapt.json."""
    out_dir = Path(out_dir)
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
    return out_dir


def load_adapter(model, adapter_dir: str | Path):
    """Attach a saved LoRA adapter to `model` (already converted, if it was) and load its trained kernel tensors."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").exists():
        raise ValueError(f"adapter_dir: {adapter_dir} has no adapter_config.json (not a saved adapter)")
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
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    peft_model.eval()
    return peft_model
