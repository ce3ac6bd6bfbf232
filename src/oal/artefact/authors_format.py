"""Read the authors' released calibration format (their `configs/oal_qwen_n4096.json`) into our OAL kernels.

The authors of the paper publish precomputed groups and factors for Qwen2.5-0.5B Base in one JSON file (no
licence: we ship only this reader, never their file). Its layout, per layer and query head:

    {"head_dim": 64, "epsilon": 1e-06, "layers": {"<layer>": {"max_groups": M, "heads": {"<head>": {
        "group_count": G, "groups": [[dims of group 1], ..., [dims of group G]], "special_dims": [...],
        "packed_lower_triangular": [(M+1)(M+2)/2 numbers], "expanded_quadratic_matrix": [[M+1 x M+1]],
        "validation_output_mse": ...}}}}}

with the kernel "epsilon + ||[1, z_1, ..., z_G] L||^2": L is lower triangular, packed row by row, and the expanded
matrix is L L^T. That is our Eq. 7 kernel eps + |L^T s_bar|^2 with s_bar = [1, s_1, ..., s_G] and group g of
the file as our group id g - 1, so their L (its first G + 1 rows and columns) is our `factor` as is. Heads of a
layer with fewer groups than the layer's largest are padded with zero rows and columns, which multiply group
scores that are identically zero (no dimension carries those ids). We assume, as in the paper, that z_g is
scaled by 1/sqrt(d) like our s_g; the file does not say.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["read_authors_calibration", "import_authors_calibration"]


def _fail(path, where: str, what: str):
    raise ValueError(f"{path}: {where}: {what}")


def _head(path, where: str, rec: dict, d: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids [d], factor [size, size]) of one head record."""
    try:
        groups = [[int(x) for x in g] for g in rec["groups"]]
        n_groups = int(rec["group_count"])
        packed = [float(x) for x in rec["packed_lower_triangular"]]
    except (KeyError, TypeError, ValueError) as exc:
        _fail(path, where, f"expected 'groups', 'group_count' and 'packed_lower_triangular' ({exc})")
    dims = sorted(x for g in groups for x in g)
    if n_groups != len(groups) or n_groups < 1 or dims != list(range(d)):
        _fail(path, where, f"groups must be {n_groups} non-overlapping groups covering dimensions 0..{d - 1}")
    m1 = (math.isqrt(8 * len(packed) + 1) - 1) // 2  # packed length = m1 (m1 + 1) / 2
    if m1 * (m1 + 1) // 2 != len(packed) or m1 < n_groups + 1:
        _fail(path, where, f"packed_lower_triangular: {len(packed)} numbers do not pack a lower triangle of at "
              f"least {n_groups + 1} rows")
    full = torch.zeros(m1, m1, dtype=torch.float64)
    rows, cols = torch.tril_indices(m1, m1)  # row by row: (0,0), (1,0), (1,1), (2,0), ...
    full[rows, cols] = torch.tensor(packed, dtype=torch.float64)
    if "expanded_quadratic_matrix" in rec:  # the file's own L L^T must agree with its L
        expanded = torch.tensor(rec["expanded_quadratic_matrix"], dtype=torch.float64)
        if expanded.shape != full.shape or not torch.allclose(full @ full.T, expanded, rtol=1e-4, atol=1e-6):
            _fail(path, where, "expanded_quadratic_matrix is not L L^T of packed_lower_triangular")
    if bool((full[n_groups + 1 :] != 0).any()):
        _fail(path, where, f"factor rows beyond group_count + 1 = {n_groups + 1} must be zero")
    ids = torch.empty(d, dtype=torch.long)
    for g, members in enumerate(groups):
        ids[members] = g
    factor = torch.zeros(size, size, dtype=torch.float64)
    g1 = n_groups + 1
    factor[:g1, :g1] = full[:g1, :g1]
    return ids, factor


def read_authors_calibration(path: str | Path, n_kv_heads: int, *, layers: Sequence[int] | None = None) -> dict:
    """{layer: OALMethod} from the authors' calibration JSON (`n_kv_heads`: the model's KV heads, not in the
    file; Qwen2.5-0.5B has 2). `layers` picks some (default: every layer in the file)."""
    from oal.methods import build_method

    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        d, eps, by_layer = int(doc["head_dim"]), float(doc["epsilon"]), doc["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected the authors' calibration JSON with head_dim, epsilon and layers "
                         f"({type(exc).__name__}: {exc})") from None
    wanted = sorted(int(i) for i in by_layer) if layers is None else sorted(layers)
    out = {}
    for layer in wanted:
        rec = by_layer.get(str(layer))
        if rec is None:
            _fail(path, f"layer {layer}", f"not in the file (it has {sorted(int(i) for i in by_layer)})")
        heads = rec.get("heads", {})
        n_heads = len(heads)
        if sorted(int(h) for h in heads) != list(range(n_heads)) or n_heads % n_kv_heads:
            _fail(path, f"layer {layer}", f"expected heads 0..Hq-1 with Hq a multiple of n_kv_heads={n_kv_heads}")
        size = max(int(heads[str(h)].get("group_count", 0)) for h in range(n_heads)) + 1
        parts = [_head(path, f"layer {layer} head {h}", heads[str(h)], d, size) for h in range(n_heads)]
        groups = torch.stack([g for g, _ in parts])
        factor = torch.stack([f for _, f in parts]).float()
        out[layer] = build_method("oal", n_heads, n_kv_heads, d, groups=groups, factor=factor, n_groups=size - 1,
                                  eps=eps, layer_idx=layer)
    return out


def import_authors_calibration(path: str | Path, out_dir: str | Path, n_kv_heads: int, *,
                               layers: Sequence[int] | None = None, base_model: str | None = None) -> Path:
    """Write the file's kernels as `out_dir/kernels.safetensors` + kernels.json (`calibration.kernels.save_kernels`),
    recording the source file's SHA256; returns the kernels.json path."""
    from oal.calibration.kernels import save_kernels
    from oal.rundir.hashes import sha256_file

    methods = read_authors_calibration(path, n_kv_heads, layers=layers)
    return save_kernels(methods, out_dir, base_model=base_model,
                        extra={"method": "oal", "source": {"format": "authors-json", "file": Path(path).name,
                                                           "sha256": sha256_file(path)}})
