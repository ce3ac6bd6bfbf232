"""A converted model under what users routinely do to a Hugging Face model (a helper's audit, 2026-12-07): autocast,
casts of the whole model, torch.compile, torch.export and torch.func. Each defect it found is a test here; what
already worked (gradient checkpointing, inference mode, peft, resizing, reloading in bf16, pipelines) is covered by
test_decode, test_convert, test_export and test_hf_usage."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_model

import oal
from oal.models.attention import converted_methods

LAYER = 1


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # the compiled frames of this file's tests stay out of the next file's


def _converted(seed: int = 0):
    from benchmarks.model import random_kernels

    model = tiny_model("qwen2", vocab_size=67)
    return oal.convert(model, [LAYER], random_kernels(model, (LAYER,), seed=seed)).eval()


def _ids(n=24, b=2, seed=1):
    return torch.randint(0, 67, (b, n), generator=torch.Generator().manual_seed(seed))


def _method(model):
    return converted_methods(model)[LAYER]


def _capture(model):
    """Record the converted layer's inputs and output (a forward hook on its method)."""
    seen = []
    handle = _method(model).register_forward_hook(
        lambda mod, args, out: seen.append((tuple(a.detach() for a in args), out)))
    return seen, handle


@pytest.mark.parametrize("grad", [False, True])
def test_autocast_does_not_reach_into_the_converted_layers(grad):
    """Under `torch.autocast` (what Trainer(bf16=True) and accelerate's mixed precision run) the operator's
    matmuls ran in bf16 although it had cast its inputs to fp32 (its states and, when the factor trains, its features
    are fp32 by design): outputs 0.5% off and the factor's gradient as far. The converted layer now gets its inputs in
    autocast's dtype, as from a bf16 model, and computes what it computes on them outside autocast."""
    model = _converted()
    model.train(grad)
    seen, handle = _capture(model)
    ids = _ids()
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, use_cache=False)
    handle.remove()
    (q, k, v), out = seen[0]
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16  # as from a bf16 model (RoPE had made q, k fp32)
    with torch.set_grad_enabled(grad):
        want = _method(model)(q, k, v)
    assert out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_factor_gradient_under_autocast_matches_float64():
    """The factor's gradient is a small remainder of cancelling terms (ops.oal_attention): under autocast it came
    from bf16 GEMMs. Against float64 on the same bf16 q/k/v it is now float32-exact."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from oal.methods.oal import OALMethod

    model = _converted()
    model.train()
    seen, handle = _capture(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(_ids(), use_cache=False)
    handle.remove()
    (q, k, v), _ = seen[0]
    weights = (torch.arange(v.shape[-1], dtype=torch.float64) - 3.5) / 4  # exact in bf16: no rounding of the seed
    method = _method(model)
    ref = OALMethod(method.n_heads, method.n_kv_heads, method.head_dim, groups=method.groups,
                    factor=method.factor.detach()).double()
    (ref(q.double(), k.double(), v.double()) * weights).sum().backward()
    attention = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(model.model.layers[LAYER].self_attn, q, k, v, None)  # [B, N, Hq, dv]
    (out.transpose(1, 2).double() * weights).sum().backward()
    want, got = ref.factor.grad, method.factor.grad.double()
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("backend", ["chunked", "recurrent", "reference"])
def test_the_operator_called_under_autocast_keeps_its_precision(backend):
    """`oal.ops.oal_attention` called directly (or by a method outside a model) under autocast ran its GEMMs in bf16
    on the fp32 inputs it had been given; it now computes what it computes outside autocast, its output and the
    factor's gradient alike."""
    from oal.ops import oal_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 37, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    groups = torch.randint(0, 3, (4, 8), generator=gen)
    factor = (torch.eye(4) + 0.1 * torch.randn(4, 4, 4, generator=gen).tril()).requires_grad_(True)
    runs = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = oal_attention(q, k, v, groups, factor, backend=backend)
        (grad,) = torch.autograd.grad(out.square().sum(), factor)
        runs.append((out, grad))
    assert runs[1][0].dtype == torch.float32
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@pytest.mark.parametrize("cast", ["to_bf16", "half", "to_dtype_kw"])
def test_casting_the_model_to_half_precision_keeps_the_kernels_in_float32(cast):
    """`model.to(torch.bfloat16)` / `.half()` cast the kernel factors too (bf16 factors: rounded coefficients, and
    AdamW's updates below bf16's resolution lost), where `from_pretrained(dtype=bf16)`, `oal.load` and `oal export`
    keep them float32 (oal.device's precision rules). A cast of the model now leaves the kernels' dtype as it is."""
    model = _converted()
    factor = _method(model).factor.detach().clone()
    half = {"to_bf16": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half(),
            "to_dtype_kw": lambda m: m.to(device="cpu", dtype=torch.bfloat16)}[cast](model)
    low = torch.float16 if cast == "half" else torch.bfloat16
    assert half.model.embed_tokens.weight.dtype == low  # the base model was cast
    assert _method(half).factor.dtype == torch.float32
    assert torch.equal(_method(half).factor, factor)
    # and it still trains: an update far below bf16's resolution at the factor's scale is kept
    half.train()
    half(_ids(), labels=_ids()).loss.backward()
    grad = _method(half).factor.grad
    assert grad is not None and grad.dtype == torch.float32
    with torch.no_grad():
        _method(half).factor -= 1e-5 * grad.sign()
    assert not torch.equal(_method(half).factor, factor)


def test_double_still_casts_the_kernels_for_float64_references():
    model = _converted().double()
    assert _method(model).factor.dtype == torch.float64


def test_torch_compile_runs_forward_backward_and_generate():
    """The operator's host checks read values: torch.compile graph-breaks around them and runs (kept so by the
    refusals of export and torch.func below, which must not catch compile)."""
    model = _converted()
    ids = _ids(n=9, b=1)
    with torch.no_grad():
        want = model(ids).logits
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, want, rtol=0, atol=0)
    model.train()
    compiled(ids, labels=ids).loss.backward()
    got = _method(model).factor.grad.clone()
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    torch.testing.assert_close(got, _method(model).factor.grad)
    model.eval()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(compiled.generate(ids, **kw), model.generate(ids, **kw))


def test_torch_compile_fullgraph_names_the_cause():
    """fullgraph=True failed on `WeakIdKeyDictionary.__init__` (an internal of the cache hooks), naming no cause."""
    torch._dynamo.reset()  # an earlier test's compiled frames (graph breaks allowed) would be reused
    model = _converted()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="converted OAL layers read tensor values on the host"):
        with torch.no_grad():
            compiled(_ids(n=9, b=1))


def test_torch_export_is_refused_with_one_line():
    """It failed deep inside the padding check ("Cannot access data pointer of Tensor (e.g. FakeTensor ...)")."""
    model = _converted()
    with pytest.raises(ValueError, match=r"^model: converted layers .* torch\.export") as info:
        torch.export.export(model, (_ids(),))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_with_one_line(transform):
    """torch.func.grad failed on a data pointer, vmap on `.item()` inside the operator's checks."""
    from torch.func import functional_call, grad, vmap

    model = _converted()
    ids = _ids()
    with pytest.raises(ValueError, match=r"^model: converted layers .* torch\.func") as info:
        if transform == "grad":
            grad(lambda p: functional_call(model, p, (ids,), {"labels": ids}).loss)(dict(model.named_parameters()))
        else:
            vmap(lambda row: model(row[None]).logits[0])(ids)
    assert "\n" not in str(info.value)


def test_functional_call_without_a_transform_uses_the_given_kernel():
    """torch.func.functional_call alone is plain autograd: it runs, with the factor passed in."""
    from torch.func import functional_call

    model, other = _converted(), _converted()
    with torch.no_grad():
        _method(other).factor.mul_(1.2)
    ids = _ids()
    params = {**dict(model.named_parameters()), f"model.layers.{LAYER}.self_attn.oal_method.factor":
              _method(other).factor.detach().clone()}
    with torch.no_grad():
        torch.testing.assert_close(functional_call(model, params, (ids,)).logits, other(ids).logits)
