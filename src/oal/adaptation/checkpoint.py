"""Exact resume of an adaptation: trainable tensors, the best tensors so far, the optimizer state (its tensors in
safetensors, the rest in JSON: no pickle), the scheduler, every process's RNG state and the step, with the SHA256 of
each file in state.json, whose loop state is bound to trainable.safetensors' header in turn (a damaged or edited
checkpoint is reported and adaptation starts over)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from oal.rundir.files import (
    atomic_dir,
    atomic_save_safetensors,
    atomic_write_json,
    existing_dir,
    load_json,
    load_safetensors,
)
from oal.rundir.hashes import header_binds, record_header, sha256_file

__all__ = ["read_checkpoint", "restore_checkpoint", "rng_state", "save_checkpoint"]

log = logging.getLogger("oal")

_FILES = {"trainable.safetensors", "best.safetensors", "rng.safetensors", "optimizer.json"}  # always written


def rng_state() -> dict[str, torch.Tensor]:
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


def save_checkpoint(ckpt_dir: Path, params, best, optimizer, scheduler, state: dict, rngs: list[dict]) -> None:
    """Main process only. `rngs`: every process's RNG state, in rank order."""
    record = {**state, "scheduler": scheduler.state_dict()}
    with atomic_dir(ckpt_dir) as tmp:
        # the tensors' header binds state.json's loop state (step, best so far, scheduler), which names the files'
        # SHA256 in turn
        atomic_save_safetensors(tmp / "trainable.safetensors", {n: p.data for n, p in params.items()},
                                metadata=record_header(record))
        atomic_save_safetensors(tmp / "best.safetensors", best)
        atomic_save_safetensors(tmp / "rng.safetensors", {_rng_name(r, k): v for r, rng in enumerate(rngs)
                                                          for k, v in rng.items()})
        _save_optimizer(tmp, optimizer)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        atomic_write_json(tmp / "state.json", {**record, "sha256": files})


def read_checkpoint(ckpt_dir: Path, key: str, names: set[str], processes: int) -> dict | None:
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
        files = state.get("sha256")
        if not isinstance(files, dict) or not _FILES <= set(files):
            raise ValueError(f"state.json records no SHA256 of {', '.join(sorted(_FILES - set(files or {})))}")
        read = _FILES | ({"optimizer.safetensors"} if (found / "optimizer.safetensors").exists() else set())
        unlisted = sorted(read - set(files))
        if unlisted:  # every file a resume reads is hashed (optimizer.safetensors is written only with state)
            raise ValueError(f"state.json records no SHA256 of {', '.join(unlisted)}")
        bad = sorted(f for f, h in files.items() if not (found / f).is_file() or sha256_file(found / f) != h)
        if bad:
            raise ValueError(f"{', '.join(bad)} changed since it was written")
        if not header_binds(found / "trainable.safetensors", {k: v for k, v in state.items() if k != "sha256"}):
            raise ValueError("state.json's loop state is not the one saved with trainable.safetensors")
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


def restore_checkpoint(saved: dict, params, optimizer, scheduler, rank: int) -> tuple[dict, dict]:
    """Load what `read_checkpoint` read into this process's tensors, optimizer, scheduler and RNG; returns the
    loop state and the best tensors so far."""
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved["trainable"][n])
    optimizer.load_state_dict(saved["optimizer"])
    state = dict(saved["state"])
    scheduler.load_state_dict(state.pop("scheduler"))
    _set_rng_state(saved["rngs"][rank])
    return state, saved["best"]
