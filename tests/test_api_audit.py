"""The Python API as a demanding notebook user drives it (an audit): the subpackages the docs name after a bare
`import oal`; `oal.linearize` refusing, before any work and naming the argument, a tokenizer that is not the
model's, a torch.compile'd model and one whose weights are not loaded; the method objects refusing sizes and
inputs they cannot compute on instead of failing deep in torch or answering wrongly; the softmax method agreeing
with its own reference when fewer queries than keys come in."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys

import pytest
import torch

import oal
from oal.methods import build_method
from tests._tiny import save_tiny_llama

TEXT = [inspect.getsource(argparse)]
QUICK = {"preset": "tiny", "max_steps": 2}


# --------------------------------------------------------------------------------------------- import oal

def test_a_bare_import_reaches_the_subpackages_the_docs_name():
    """api.md: "the operator is `oal.ops.oal_attention`"; linearize's docstring: `oal.methods.method_names()`.
    After `import oal` alone both raised AttributeError (nothing had imported the subpackage yet)."""
    code = ("import sys, oal; assert 'oal.ops' not in sys.modules; print(oal.ops.oal_attention.__name__, "
            "oal.methods.method_names()[0], 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["oal_attention", "oal", "False"]  # and still light: no transformers
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        oal.nope  # noqa: B018


# --------------------------------------------------------------------------------------------- oal.linearize

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))  # vocab 259 (bytes)


def _base(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_linearize_names_a_tokenizer_whose_ids_the_model_does_not_embed(folder):
    """The embedded default model's tokenizer (4096 ids) on a 259-id model failed with torch's IndexError from
    the embedding, deep in the analysis."""
    from transformers import AutoTokenizer

    from oal.models.registry import DEFAULT_MODEL_DIR

    model, _ = _base(folder)
    other = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match=r"^tokenizer: it gives token id \d+, and the model embeds 259 ids"):
        oal.linearize(model, other, TEXT, layers=[1], calib=QUICK, progress=False)


def test_linearize_refuses_a_compiled_model_before_any_work(folder):
    """torch.compile's wrapper forwards `config` and the layers: the whole analysis and calibration ran, then the
    swap failed with an AttributeError ('OptimizedModule' has no attribute 'config_class')."""
    model, tok = _base(folder)
    compiled = torch.compile(model)
    with pytest.raises(ValueError, match=r"^model: a torch.compile'd model"):
        oal.linearize(compiled, tok, TEXT, layers=[1], calib=QUICK, progress=False)
    assert not hasattr(model, "oal_converted") and type(model).__name__ == "LlamaForCausalLM"


def test_linearize_refuses_weights_on_the_meta_device(folder):
    """A model not loaded (meta tensors: device_map offload, `init_empty_weights`) failed with torch's
    NotImplementedError ('Cannot copy out of meta tensor') from the provenance record."""
    model, tok = _base(folder)
    with pytest.raises(ValueError, match="^model: some of its weights are on the meta device"):
        oal.linearize(model.to("meta"), tok, TEXT, layers=[1], calib=QUICK, progress=False)


@pytest.mark.parametrize("calib,key", [({"lr": float("inf")}, "lr"), ({"clip_norm": float("nan")}, "clip_norm"),
                                       ({"max_steps": True}, "max_steps")])
def test_linearize_names_a_calibration_setting_that_is_not_a_finite_number(folder, calib, key):
    """lr=inf passed CalibConfig's `lr > 0` and failed after the capture as 'factor: contains NaN or Inf values';
    max_steps=True calibrated with one update."""
    model, tok = _base(folder)
    with pytest.raises(ValueError, match=f"^calib: {key}: expected a finite number"):
        oal.linearize(model, tok, TEXT, layers=[1], calib={"preset": "tiny", **calib}, progress=False)


# --------------------------------------------------------------------------------------------- the method objects

@pytest.mark.parametrize("name", ["oal", "global", "global-swa", "softmax", "performer", "spectraformer", "dijiang",
                                  "taylorshift", "swa"])
@pytest.mark.parametrize("sizes,arg", [((0, 1, 8), "n_heads"), ((4, 2, 0), "head_dim"), ((4, 2, -3), "head_dim"),
                                       ((4.0, 2, 8), "n_heads"), ((4, True, 8), "n_kv_heads")])
def test_build_method_names_a_size_that_is_not_a_positive_integer(name, sizes, arg):
    """These failed deep in torch (`max(): Expected reduction dim`, `zeros(): Dimension size must be
    non-negative`, ZeroDivisionError, `math domain error`) or built a method nothing could call (softmax, swa)."""
    with pytest.raises(ValueError, match=f"^{arg}: expected an integer >= 1"):
        build_method(name, *sizes)


def test_build_method_takes_numpy_sizes():
    np = pytest.importorskip("numpy")
    m = build_method("oal", np.int64(4), np.int64(2), np.int64(8))
    assert (m.n_heads, m.n_kv_heads, m.head_dim) == (4, 2, 8) and type(m.head_dim) is int


def _qkv(n=5, m=9, hq=4, hkv=2, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, hq, n, d, dtype=dtype, generator=gen), torch.randn(1, hkv, m, d, dtype=dtype, generator=gen),
            torch.randn(1, hkv, m, 3, dtype=dtype, generator=gen))


@pytest.mark.parametrize("n,m", [(5, 9), (1, 9), (9, 9)])
def test_the_softmax_method_matches_its_reference_with_fewer_queries_than_keys(n, m):
    """The last n of m positions query (`causal_mask`, the reference, every decoding step); SDPA's is_causal aligned
    query i with key i, a silently different attention (max error 2.65 in float64 at n=5, m=9)."""
    method = build_method("softmax", 4, 2, 8)
    q, k, v = _qkv(n, m)
    torch.testing.assert_close(method(q, k, v), method.reference(q, k, v), rtol=1e-12, atol=1e-12)
    q_all = _qkv(m, m)[0]  # every position queries: the last n rows are those queries' attention
    torch.testing.assert_close(method(q_all[:, :, m - n:], k, v), method(q_all, k, v)[:, :, m - n:], rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_the_softmax_method_names_a_non_finite_input(name):
    """A NaN in q gave that query a row of zeros (SDPA on the CPU), where the reference and the other methods give
    NaN or refuse."""
    method = build_method("softmax", 4, 2, 8)
    q, k, v = _qkv(6, 6)
    {"q": q, "k": k, "v": v}[name][0, 0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=f"^{name}: contains NaN or Inf"):
        method(q, k, v)


def test_the_softmax_method_refuses_a_3d_query():
    """SDPA broadcast a [H, N, d] query against the 4-D keys and returned a 4-D result without a word."""
    q, k, v = _qkv(6, 6)
    with pytest.raises(ValueError, match=r"^q/k: expected 4-D"):
        build_method("softmax", 4, 2, 8)(q[0], k, v)


@pytest.mark.parametrize("name", ["performer", "spectraformer", "dijiang", "taylorshift", "softmax"])
def test_the_methods_name_an_integer_query(name):
    """Integer q was cast silently by the feature maps, or failed in torch's vector_norm (TaylorShift)."""
    q, k, v = _qkv(6, 6, dtype=torch.float32)
    with pytest.raises(ValueError, match="^q: expected a floating-point tensor, got torch.int64"):
        build_method(name, 4, 2, 8)(q.long(), k, v)


# --------------------------------------------------------------------------------------------- oal.add_lora

def _lora_a(peft_model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_A." in n}


def test_add_lora_seeds_its_initialisation_without_reseeding_the_callers_draws():
    """add_lora called torch.manual_seed(seed) on the global generator: a notebook's later draws (its data order,
    its dropout masks) restarted from seed 42 whatever it had seeded itself."""
    from tests._tiny import tiny_model

    models = [oal.convert(tiny_model("qwen2", 100), [1]) for _ in range(3)]  # tiny_model seeds the generator
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    first = _lora_a(oal.add_lora(models[0], seed=3))
    assert torch.equal(torch.rand(4), want)
    again, other = _lora_a(oal.add_lora(models[1], seed=3)), _lora_a(oal.add_lora(models[2], seed=4))
    assert first and all(torch.equal(first[n], again[n]) for n in first)  # the seed still fixes the LoRA init
    assert not all(torch.equal(first[n], other[n]) for n in first)


@pytest.mark.parametrize("bad", [3, None])
def test_load_names_a_directory_that_is_not_a_path(bad):
    """`oal.load(3)` and `oal.load(None)` raised pathlib's TypeError."""
    with pytest.raises(ValueError, match="directory: expected a folder's path, got"):
        oal.load(bad)
