"""One-pass capture of many layers to disk: every requested layer's q/k/v/output from each forward, per layer.

Calibration fits one layer at a time but needs that layer's frozen q/k/v and softmax output for every calibration
block. Capturing layer by layer (a forward cut after each layer) costs sum_i (i+1) layer forwards, quadratic in
depth; here each block batch runs once, up to the deepest requested layer, and `oal.models.capture` hands over
the layers one at a time inside that forward. Each layer's tensors go straight to their own safetensors file

    ROOT/<role>/layer-<i>/<first block>.safetensors   (q, k, v, out in the model's dtype; mask for padded input)

written atomically and recorded with its SHA256 in ROOT/manifest.json, which also holds a key (model, blocks,
layers) and whether the attention was causal (encoders: not). A later `open_store` with the same key reuses the
files (a killed calibration resumes without capturing again); `load` checks each file's hash, and that the manifest
lists it under its own role and layer, before reading it, and `remove` deletes everything once calibration is done.

Memory bound. While capturing, nothing outlives the layer callback: the extra memory is one layer's tensors for
one batch of blocks, (2 Hq + 2 Hkv) * N * d elements (Qwen2.5-0.5B, N = 4096, bf16: 16.8 MB per block), next to
the forward pass itself. Reading back, one layer of one role is in memory at a time: S blocks of that layer
(paper: 8 calibration + 2 validation blocks = 168 MB in bf16, twice that once calibration upcasts to float32).
Disk holds blocks x layers of them: 10 x 18 x 16.8 MB = 3.0 GB for the Qwen2.5-0.5B protocol in bf16 (6 GB in
float32), removed after calibration. Keeping all of it in memory instead would need those 3-6 GB resident on top
of the model; keeping only sampled rows would change what calibration sees (it samples fresh query positions
every update and validates on every position), so whole layers go to disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from oal.device import module_device, to_device
from oal.models.capture import Captured, capture
from oal.rundir.files import atomic_save_safetensors, atomic_write_json, load_json, load_safetensors, remove
from oal.rundir.hashes import sha256_file

__all__ = ["CaptureStore", "block_ids", "capture_to_disk", "open_store"]

FIELDS = ("q", "k", "v", "out")
MANIFEST = "manifest.json"


class CaptureStore:
    """The per-layer capture files under `root` and their manifest (key, roles, layers, file hashes)."""

    def __init__(self, root: str | Path, manifest: dict):
        self.root = Path(root)
        self.manifest = manifest

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def causal(self) -> bool:
        """False when the captured attention was non-causal (encoders)."""
        return bool(self.manifest.get("causal", True))

    def files(self, role: str, layer: int) -> list[str]:
        """The files of `role` and `layer` in block order; each must be named for that role, layer and its place
        (the manifest's lists are checked against the names, so an edited list cannot hand one role another's)."""
        try:
            rels = self.manifest["roles"][role][str(layer)]
        except KeyError:
            raise ValueError(f"capture: no data for role {role!r}, layer {layer} in {self.root}") from None
        prefix = f"{role}/layer-{layer}/"
        starts = [rel.removeprefix(prefix).removesuffix(".safetensors") for rel in rels]
        named = all(r.startswith(prefix) and s.isdigit() for r, s in zip(rels, starts, strict=True))
        if not rels or not named or [int(s) for s in starts] != sorted({int(s) for s in starts}) or int(starts[0]):
            raise ValueError(f"capture: {self.root / MANIFEST} lists files for role {role!r}, layer {layer} that are "
                             "not that role's and layer's blocks in order; delete the capture folder to capture again")
        return rels

    def load(self, role: str, layer: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """{q, k, v, out} (and `mask` [S, N], True = real token, when the blocks were padded) of `layer` for every
        block of `role`, concatenated in block order on `device` (each file's hash is checked before it is read)."""
        parts = []
        for rel in self.files(role, layer):
            path = self.root / rel
            want = self.manifest["sha256"][rel]
            if not path.is_file() or sha256_file(path) != want:
                raise ValueError(f"capture: {path} is missing or does not match its recorded SHA256; "
                                 "delete the capture folder to capture again")
            parts.append(load_safetensors(path))
        fields = FIELDS + (("mask",) if "mask" in parts[0] else ())
        return {f: torch.cat([p[f] for p in parts]).to(device) for f in fields}

    def nbytes(self) -> int:
        """Bytes on disk of all capture files."""
        return sum((self.root / rel).stat().st_size for rel in self.manifest["sha256"])

    def remove(self) -> None:
        remove(self.root)


def open_store(root: str | Path, key: str) -> CaptureStore | None:
    """The complete store at `root` if it was written for `key` and every file still has its recorded hash."""
    root = Path(root)
    try:
        manifest = load_json(root / MANIFEST)
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key:
        return None
    listed = {rel for layers in manifest.get("roles", {}).values() for rels in layers.values() for rel in rels}
    if listed != set(manifest.get("sha256", {})):  # every listed file hashed, every hashed file listed
        return None
    for rel, digest in manifest.get("sha256", {}).items():
        if not (root / rel).is_file() or sha256_file(root / rel) != digest:
            return None
    return CaptureStore(root, manifest)


def block_ids(role: str, blocks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids [S, N], attention_mask [S, N] or None) of one role: token blocks, or tokenised padded passages
    {"input_ids", "attention_mask"} (encoders)."""
    ids, mask = (blocks.get("input_ids"), blocks.get("attention_mask")) if isinstance(blocks, Mapping) else (blocks,
                                                                                                               None)
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"blocks[{role!r}]: expected a non-empty LongTensor [S, N] (or input_ids and "
                         f"attention_mask), got {tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__}")
    if mask is not None and (not torch.is_tensor(mask) or mask.shape != ids.shape):
        raise ValueError(f"blocks[{role!r}]: expected an attention_mask of shape {tuple(ids.shape)}")
    return ids, mask


def capture_to_disk(model, blocks: Mapping[str, torch.Tensor | Mapping[str, torch.Tensor]], layers: Sequence[int],
                    root: str | Path, *, key: str, batch_size: int = 1,
                    on_batch: Callable[[str, int], None] | None = None) -> CaptureStore:
    """Capture `layers` of `model` on the token blocks of each role ({role: LongTensor [S, N]}, or {role:
    {"input_ids", "attention_mask"}} for padded passages) in one forward per batch of blocks, streaming every
    layer's q/k/v/out (and the padding mask) to its own file under `root`.

    An existing store with the same `key` and intact files is reused as is. `on_batch(role, n_blocks)` is called
    after each forward (progress bars).
    """
    existing = open_store(root, key)
    if existing is not None:
        return existing
    root = Path(root)
    remove(root)  # a store of another key, or a partial one left by a kill
    layers = sorted(int(i) for i in layers)
    device = module_device(model)
    manifest: dict = {"key": key, "layers": layers, "roles": {}, "sha256": {}}
    for role, data in blocks.items():
        ids, mask = to_device(block_ids(role, data), device)  # the role's blocks go where the model is, once
        files: dict[str, list[str]] = {str(i): [] for i in layers}
        manifest["roles"][role] = files
        for start in range(0, ids.shape[0], batch_size):

            def write(c: Captured, role=role, start=start, files=files) -> None:
                rel = f"{role}/layer-{c.layer}/{start:06d}.safetensors"
                tensors = {f: getattr(c, f) for f in FIELDS}
                if c.attention_mask is not None:
                    tensors["mask"] = c.attention_mask.bool()
                atomic_save_safetensors(root / rel, tensors)
                manifest["causal"] = bool(c.causal)
                manifest["sha256"][rel] = sha256_file(root / rel)
                files[str(c.layer)].append(rel)

            with torch.no_grad():
                part = None if mask is None else mask[start : start + batch_size]
                capture(model, ids[start : start + batch_size], layers, write, part, stop_after_last=True)
            if on_batch is not None:
                on_batch(role, min(batch_size, ids.shape[0] - start))
    atomic_write_json(root / MANIFEST, manifest)  # last: a store without its manifest is never reused
    return CaptureStore(root, manifest)
