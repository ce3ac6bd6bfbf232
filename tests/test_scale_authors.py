"""The authors' calibration JSON (their format, a small file written here) read into our OAL kernels."""

import json
import math

import pytest
import torch

from oal.artefact.authors_format import import_authors_calibration, read_authors_calibration
from oal.calibration.kernels import load_kernels

D, HQ, HKV, MAX_G, EPS = 8, 4, 2, 3, 1e-6


def _head(gen, n_groups):
    perm = torch.randperm(D, generator=gen).tolist()
    cuts = sorted(torch.randperm(D - 1, generator=gen)[: n_groups - 1].add(1).tolist())
    groups = [sorted(perm[a:b]) for a, b in zip([0, *cuts], [*cuts, D], strict=True)]
    lower = torch.zeros(MAX_G + 1, MAX_G + 1, dtype=torch.float64)
    lower[: n_groups + 1, : n_groups + 1] = torch.randn(n_groups + 1, n_groups + 1, generator=gen,
                                                        dtype=torch.float64).tril()
    rows, cols = torch.tril_indices(MAX_G + 1, MAX_G + 1)
    return {"group_count": n_groups, "groups": groups, "special_dims": [x for g in groups[1:] for x in g],
            "packed_lower_triangular": lower[rows, cols].tolist(),
            "expanded_quadratic_matrix": (lower @ lower.T).tolist(), "validation_output_mse": 1e-4}


def _file(tmp_path, mutate=None):
    gen = torch.Generator().manual_seed(0)
    layers = {str(i): {"max_groups": MAX_G, "heads": {str(h): _head(gen, 1 + (h + i) % MAX_G) for h in range(HQ)}}
              for i in (2, 5)}
    doc = {"model_name": "tiny", "head_dim": D, "epsilon": EPS, "seq_len": 16, "layers": layers}
    if mutate:
        mutate(doc)
    path = tmp_path / "authors.json"
    path.write_text(json.dumps(doc))
    return path, doc


def _reference_kernel(rec, q, k):
    """eps + s_bar^T M s_bar, s_g = sum_{r in group g} q_r k_r / sqrt(d) (Eq. 7, with the file's expanded M)."""
    m = torch.tensor(rec["expanded_quadratic_matrix"], dtype=torch.float64)
    s = [torch.ones(q.shape[0], k.shape[0], dtype=torch.float64)]
    for g in rec["groups"]:
        s.append(q[:, g] @ k[:, g].T / math.sqrt(D))
    s += [torch.zeros_like(s[0])] * (MAX_G + 1 - len(s))
    s = torch.stack(s, -1)  # [n, m, MAX_G + 1]
    return EPS + torch.einsum("nmi,ij,nmj->nm", s, m, s)


def test_kernels_equal_the_files_kernel(tmp_path):
    path, doc = _file(tmp_path)
    methods = read_authors_calibration(path, HKV)
    assert sorted(methods) == [2, 5]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, HQ, 7, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, HKV, 9, D, generator=gen, dtype=torch.float64)
    for layer, method in methods.items():
        assert method.n_heads == HQ and method.n_kv_heads == HKV and method.eps == EPS
        got = method.dense_kernel(q, k)  # [1, Hq, 7, 9]
        for h in range(HQ):
            rec = doc["layers"][str(layer)]["heads"][str(h)]
            want = _reference_kernel(rec, q[0, h], k[0, h // (HQ // HKV)])
            torch.testing.assert_close(got[0, h], want, rtol=1e-5, atol=1e-6)  # factor stored in float32


def test_import_writes_our_kernel_files(tmp_path):
    path, _ = _file(tmp_path)
    import_authors_calibration(path, tmp_path / "run", HKV, layers=[5], base_model="tiny")
    loaded, meta = load_kernels(tmp_path / "run")
    ref = read_authors_calibration(path, HKV, layers=[5])[5]
    assert sorted(loaded) == [5] and meta["extra"]["source"]["format"] == "authors-json"
    assert torch.equal(loaded[5].groups, ref.groups) and torch.equal(loaded[5].factor, ref.factor)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["layers"]["2"]["heads"]["1"]["groups"][0].pop(), "layer 2 head 1: groups must"),
    (lambda d: d["layers"]["5"]["heads"]["0"]["expanded_quadratic_matrix"][0].__setitem__(0, 99.0), "L L\\^T"),
    (lambda d: d["layers"]["5"]["heads"].pop("3"), "layer 5: expected heads"),
    (lambda d: d.pop("epsilon"), "authors' calibration JSON"),
])
def test_bad_files_are_clear_errors(tmp_path, mutate, match):
    path, _ = _file(tmp_path, mutate)
    with pytest.raises(ValueError, match=match) as err:
        read_authors_calibration(path, HKV)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="layer 9: not in the file"):
        read_authors_calibration(_file(tmp_path)[0], HKV, layers=[9])
