"""The public Python API as a notebook uses it: `oal.linearize`, `oal.add_lora`, `oal.convert`, `oal.load`,
`oal.save_kernels` and `oal.ops.oal_attention`. Bad arguments get one ValueError naming the argument (not a deep
traceback, not a silent misreading); every parameter is documented; the operator matches the dense reference in
float64 at odd sizes; conversions round-trip through save_pretrained, `oal.load`, the Auto classes and
`oal.save_kernels` with the same logits."""

from __future__ import annotations

import argparse
import inspect
import re

import numpy as np
import pytest
import torch

import oal
from oal.models.attention import converted_methods
from oal.ops import oal_attention
from tests._tiny import save_tiny_llama, tiny_model

TEXT = [inspect.getsource(argparse)]  # enough bytes for the grouping prompts and the calibration blocks
QUICK = {"preset": "tiny", "max_steps": 2}  # the calibration runs, briefly: these tests check the plumbing


def _ids(n: int = 11, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(3))


# --------------------------------------------------------------------------------------------- oal.ops.oal_attention

def _operands(b=2, hq=6, hkv=3, n=9, d=5, g=3, dv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, e, dtype=torch.float64, generator=gen) for h, e in ((hq, d), (hkv, d), (hkv, dv)))
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factor = torch.randn(hq, g + 1, g + 1, dtype=torch.float64, generator=gen)
    return q, k, v, groups, factor


def _dense(q, k, v, groups, factor, *, eps, scale, causal):
    """Eq. 7 written out, no code shared with oal: kappa_ij = eps + |L^T [1, s_1..s_G]|^2, out = kappa v / sum kappa."""
    hq, hkv, g = q.shape[1], k.shape[1], factor.shape[-1] - 1
    onehot = torch.nn.functional.one_hot(groups.long(), g).to(q.dtype)  # [Hq, d, G]
    kk, vv = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    s = torch.einsum("bhid,bhjd,hdg->bhijg", q * scale, kk, onehot)
    s_bar = torch.cat([torch.ones_like(s[..., :1]), s], dim=-1)
    kappa = eps + torch.einsum("bhijg,hgf->bhijf", s_bar, torch.tril(factor)).pow(2).sum(-1)
    if causal:
        kappa = kappa * torch.ones(q.shape[2], q.shape[2], dtype=q.dtype).tril()
    return (kappa @ vv) / kappa.sum(-1, keepdim=True)


@pytest.mark.parametrize("shape", [dict(b=1, hq=1, hkv=1, n=1, d=1, g=1, dv=1), dict(b=2, hq=6, hkv=3, n=13, d=5),
                                   dict(b=1, hq=4, hkv=1, n=37, d=3, g=2, dv=7)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend,chunk_size", [("auto", None), ("reference", None), ("recurrent", None),
                                                ("chunked", None), ("chunked", 4)])
def test_the_operator_and_its_gradients_match_eq_7_in_float64(shape, causal, backend, chunk_size):
    q, k, v, groups, factor = (t.requires_grad_() if t.is_floating_point() else t for t in _operands(**shape))
    out = oal_attention(q, k, v, groups, factor, eps=1e-3, scale=0.41, causal=causal, backend=backend,
                        chunk_size=chunk_size)
    want = _dense(q, k, v, groups, factor, eps=1e-3, scale=0.41, causal=causal)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, factor))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v, factor))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("backend", ["auto", "reference", "recurrent", "chunked"])
def test_the_state_continues_a_sequence_in_float64(backend):
    q, k, v, groups, factor = _operands(n=11)
    full, final = oal_attention(q, k, v, groups, factor, backend=backend, output_final_state=True)
    for cut in (0, 3, 8):  # 8: a 3-token tail, the token loop of `auto`
        head, state = oal_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], groups, factor, backend=backend,
                                    output_final_state=True)
        tail, end = oal_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], groups, factor, backend=backend,
                                  initial_state=state, output_final_state=True)
        torch.testing.assert_close(torch.cat([head, tail], 2), full, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(end, final, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs,match", [
    ({"causal": None}, "^causal:"),  # was run as causal=False: every query saw the future
    ({"causal": "no"}, "^causal:"),  # was run as causal=True
    ({"causal": 0}, "^causal:"),
    ({"output_final_state": "yes"}, "^output_final_state:"),
    ({"scale": True}, "^scale:"),
])
def test_the_operator_refuses_flags_that_are_not_bools(kwargs, match):
    with pytest.raises(ValueError, match=match):
        oal_attention(*_operands(), **kwargs)


@pytest.mark.parametrize("name", ["q", "factor"])
def test_the_operator_names_an_argument_that_is_not_a_tensor(name):
    q, k, v, groups, factor = _operands()
    args = {"q": q.float().half(), "k": k.half(), "v": v.half(), "groups": groups, "factor": factor}
    args[name] = args[name].tolist()
    with pytest.raises(ValueError, match=f"^{name}:"), torch.enable_grad():
        oal_attention(args["q"], args["k"], args["v"], args["groups"], args["factor"])


# --------------------------------------------------------------------------------------------- oal.convert

@pytest.mark.parametrize("layers,match", [(1, "^layers:"), ([1.5], "^layers:"), ([], "^layers:"), ("1", "^layers:"),
                                          ([True], "^layers:"), ([np.bool_(True)], "^layers:"),
                                          ([torch.tensor(True)], "^layers:")])
def test_convert_names_bad_layers(layers, match):
    """A bool is an index to `operator.index` (True is layer 1): a mask passed as layers converted layer 1."""
    with pytest.raises(ValueError, match=match):
        oal.convert(tiny_model("qwen2", 100), layers, "oal")


def test_convert_takes_numpy_and_tensor_layer_indices():
    model = oal.convert(tiny_model("qwen2", 100), [np.int64(1), torch.tensor(2)], "global")
    assert sorted(converted_methods(model)) == [1, 2]


def test_convert_takes_the_method_name_as_linearize_does():
    model = oal.convert(tiny_model("qwen2", 100), [1], method="global")
    assert {i: m.name for i, m in converted_methods(model).items()} == {1: "global"}
    with pytest.raises(ValueError, match="^method:"):
        oal.convert(tiny_model("qwen2", 100), [1], "swa", method="global")


@pytest.mark.parametrize("name", ["dijiang", "performer", "global", "oal"])
def test_convert_names_a_setting_the_method_does_not_take(name):
    """Several methods take `**_ignored` (the calibration gives every method the same settings): a misspelt setting
    of `convert(model, layers, name, ...)` was dropped without a word."""
    with pytest.raises(ValueError, match=f"^method_kwargs: {name} takes no setting 'windw'"):
        oal.convert(tiny_model("qwen2", 100), [1], name, windw=64)
    model = oal.convert(tiny_model("qwen2", 100), [1], "swa", window=8, sinks=2)  # the settings it names still apply
    assert converted_methods(model)[1].window == 8


def test_convert_names_an_unsupported_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="^model:"):
        oal.convert(gpt2, [1])


# --------------------------------------------------------------------------------------------- round trips

def test_save_pretrained_then_load_and_the_auto_class_give_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = oal.convert(tiny_model("qwen2", 100).double(), [1, 2], "oal")
    oal.convert(model, [2], "global")  # a second call replaces layer 2's method
    want = model(_ids()).logits
    model.save_pretrained(tmp_path)
    for again in (oal.load(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert {i: m.name for i, m in converted_methods(again).items()} == {1: "oal", 2: "global"}
        assert again(_ids()).logits.dtype == torch.float64
        torch.testing.assert_close(again(_ids()).logits, want, rtol=0, atol=0)


def test_save_kernels_then_load_on_the_base_model_gives_the_same_logits(tmp_path):
    model = oal.convert(tiny_model("llama", 100).double(), [0, 2], "oal")
    want = model(_ids()).logits
    assert oal.save_kernels(model, tmp_path) == tmp_path / "kernels.json"
    again = oal.load(tmp_path, tiny_model("llama", 100).double())
    torch.testing.assert_close(again(_ids()).logits, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="^base_model:.*another model"):
        oal.load(tmp_path, tiny_model("qwen2", 100))


def test_load_of_a_kernels_folder_without_its_base_model_says_to_pass_it(tmp_path):
    oal.save_kernels(oal.convert(tiny_model("qwen2", 100), [1]), tmp_path)
    with pytest.raises(ValueError, match="^base_model:.*oal.load"):
        oal.load(tmp_path)


def test_load_refuses_loading_options_for_a_model_already_loaded(tmp_path):
    oal.save_kernels(oal.convert(tiny_model("qwen2", 100), [1]), tmp_path)
    with pytest.raises(ValueError, match="^load_kwargs:"):  # dtype was dropped: the model stayed float32
        oal.load(tmp_path, tiny_model("qwen2", 100), dtype=torch.float64)


def test_save_kernels_names_a_directory_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^directory:"):
        oal.save_kernels(oal.convert(tiny_model("qwen2", 100), [1]), tmp_path / "file")


# --------------------------------------------------------------------------------------------- oal.linearize

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _base(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("method", ["global", "swa"])
def test_the_out_dir_of_linearize_reconverts_its_base_model_for_every_method(folder, tmp_path, method):
    model, tok = _base(folder)
    model = oal.linearize(model, tok, TEXT, layers=[1], method=method, window=8, sinks=1, calib=QUICK,
                          out_dir=tmp_path, progress=False).double()
    again = oal.load(tmp_path, _base(folder)[0]).double()  # as linearize's docstring says
    assert {i: m.name for i, m in converted_methods(again).items()} == {1: method}
    torch.testing.assert_close(again(_ids(40, 259)).logits, model(_ids(40, 259)).logits, rtol=0, atol=0)


@pytest.mark.parametrize("change,match", [
    ({"model": "a model"}, "^model:"),
    ({"tokenizer": None}, "^tokenizer:"),
    ({"layers": 1}, "^layers:"),
    ({"layers": [1.5]}, "^layers:"),  # was converted as layer 1
    ({"calib": "tiny"}, "^calib:"),
    ({"calib": [1]}, "^calib:"),
    ({"progress": "no"}, "^progress:"),
    ({"out_dir": "FILE"}, "^out_dir:"),
])
def test_linearize_names_a_bad_argument_before_any_work(folder, tmp_path, change, match):
    model, tok = _base(folder)
    kwargs = {"model": model, "tokenizer": tok, "layers": [1], "calib": QUICK, "progress": False}
    (tmp_path / "FILE").write_text("x")
    kwargs.update({k: tmp_path / v if v == "FILE" else v for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        oal.linearize(kwargs.pop("model"), kwargs.pop("tokenizer"), TEXT, **kwargs)


def test_linearize_refuses_a_model_already_converted(folder):
    """A second linearize of a converted model ran without a word: its captures were of the converted layers'
    model, not of the base model whose softmax attention the kernels are to match."""
    model, tok = _base(folder)
    with pytest.raises(ValueError, match=r"^model: layers \[1\] are already converted"):
        oal.linearize(oal.convert(model, [1], "global"), tok, TEXT, layers=[2], calib=QUICK, progress=False)


# --------------------------------------------------------------------------------------------- oal.add_lora

@pytest.mark.parametrize("kwargs,match", [
    ({"r": 0}, "^r:"),
    ({"alpha": "16"}, "^alpha:"),
    ({"alpha": 0}, "^alpha:"),
    ({"dropout": 1.0}, "^dropout:"),
    ({"target_modules": ["nope"]}, "^target_modules:"),
    ({"target_modules": []}, "^target_modules:"),
    ({"train_kernel": "no"}, "^train_kernel:"),
    ({"seed": -1}, "^seed:"),
])
def test_add_lora_names_a_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        oal.add_lora(oal.convert(tiny_model("qwen2", 100), [1]), **kwargs)


def test_add_lora_takes_one_module_name_as_a_string():
    peft_model = oal.add_lora(oal.convert(tiny_model("qwen2", 100), [1]), target_modules="q_proj")
    lora = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft_model.named_parameters() if ".lora_A" in n}
    assert lora == {"q_proj"}


def test_add_lora_refuses_its_own_result_with_a_hint():
    peft_model = oal.add_lora(oal.convert(tiny_model("qwen2", 100), [1]))
    with pytest.raises(ValueError, match="^model:.*merge_and_unload"):
        oal.add_lora(peft_model)


# --------------------------------------------------------------------------------------------- signatures and docs

PUBLIC = ["linearize", "add_lora", "convert", "load", "save_kernels"]


def _public():
    return [getattr(oal, name) for name in PUBLIC] + [oal_attention]


@pytest.mark.parametrize("fn", _public(), ids=lambda f: f.__name__)
def test_every_parameter_is_described_in_the_args_section(fn):
    doc = inspect.getdoc(fn)
    assert "Args:" in doc and "Returns:" in doc, fn.__name__
    args = doc.split("Args:")[1].split("Returns:")[0]
    for name, p in inspect.signature(fn).parameters.items():
        label = f"**{name}" if p.kind is p.VAR_KEYWORD else name
        assert re.search(rf"(^|[\s;,]){re.escape(label)}:", args, re.M), (fn.__name__, name)
    assert inspect.signature(fn).return_annotation is not inspect.Signature.empty, fn.__name__


def test_the_same_concept_has_the_same_keyword():
    params = {name: inspect.signature(getattr(oal, name)).parameters for name in PUBLIC}
    assert "method" in params["linearize"] and "method" in params["convert"]
    assert "layers" in params["linearize"] and "layers" in params["convert"]
    assert "base_model" in params["load"] and "base_model" in params["save_kernels"]
    assert list(params["load"])[0] == "directory" and list(params["save_kernels"])[1] == "directory"


def test_load_names_a_bad_device(tmp_path):
    oal.convert(tiny_model("qwen2", 100), [1]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^device:"):  # was torch's RuntimeError from deep inside .to()
        oal.load(tmp_path, device="gpu0")


def test_dir_of_oal_offers_the_public_names():
    """A notebook's completion of `oal.` offered `annotations` and `importlib` (the module's own imports)."""
    names = dir(oal)
    assert set(oal.__all__) | {"__version__"} <= set(names)
    assert not {"annotations", "importlib"} & set(names)
