"""The sliding windows (swa, oal-swa, global-swa; issue 29) inside converted HF models: prefill + decode with the
cache equals one forward, generate with and without a cache, left padding, beam search; a non-default window and
sinks survive the kernel files, save_pretrained / from_pretrained, and export / oal.load of an adapted arm."""

import copy

import pytest
import torch
from _tiny import save_tiny_llama
from test_decode import HKV, HQ, D, V, _generate, _ids, chunked_prefill_matches_one_prefill  # tiny Qwen2, greedy
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, Qwen2ForCausalLM

import oal
from oal.calibration.kernels import kernel_dir, load_kernels, method_from_record, method_record, save_kernels
from oal.methods import build_method
from oal.models.attention import converted_methods
from oal.models.cache import OALStateLayer, cache_kwargs
from oal.models.convert import convert
from oal.ops.window import window_state_size

NAMES = ("swa", "oal-swa", "global-swa")
WINDOW, SINKS = 5, 2  # not the defaults (64, 4): a reload that fell back to them would change the logits


def _methods(name, layers, n_heads=HQ, n_kv=HKV, head_dim=D, seed=3):
    """Seeded window methods for `layers`, the hybrids' factors moved off their Taylor start."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in layers:
        kw = {"window": WINDOW, "sinks": SINKS}
        if name == "oal-swa":
            kw.update(groups=torch.randint(0, 3, (n_heads, head_dim), generator=gen), n_groups=3)
        m = build_method(name, n_heads, n_kv, head_dim, layer_idx=i, **kw)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
        out[i] = m
    return out


def _model(name, layers=(0, 1)):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=HQ * D, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=128)
    return convert(Qwen2ForCausalLM(cfg).double().eval(), list(layers), _methods(name, layers))


def _in_chunks(model, ids, sizes):
    """Logits of `ids` fed in consecutive chunks of `sizes` tokens through one cache, and that cache."""
    cache, parts, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for n in sizes:
            parts.append(model(ids[:, start : start + n], **cache_kwargs(model, cache), use_cache=True).logits)
            start += n
    return torch.cat(parts, 1), cache


@pytest.mark.parametrize("name", NAMES)
def test_incremental_logits_equal_one_forward(name):
    """Prefill inside the window then one token at a time far past it, or a chunk of 7 on the state (the banded
    path): the logits of one forward."""
    model = _model(name)
    ids = _ids(2, 19)
    with torch.no_grad():
        full = model(ids).logits
    for sizes in ([3] + [1] * 16, [12, 7]):
        got, cache = _in_chunks(model, ids, sizes)
        torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-10)
    layer = cache.layers[1]
    assert isinstance(layer, OALStateLayer) and layer.stateful and cache.get_seq_length() == 19
    size = window_state_size(D, D, WINDOW, SINKS, name != "swa")
    assert layer.state.shape == (2, HKV, size)  # O(W + S) [+ OAL's prefix for the hybrids], not O(N)


@pytest.mark.parametrize("name", NAMES)
def test_generate_with_cache_matches_full_forwards(name):
    model = _model(name)
    ids = _ids(3, 12)
    seq_c, sc_c = _generate(model, ids, True)
    seq_f, sc_f = _generate(model, ids, False)
    assert torch.equal(seq_c, seq_f)
    torch.testing.assert_close(sc_c, sc_f, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_left_padding_matches_unpadded_rows(name):
    """Batched generate with left padding: each row's tokens and scores are those of the row run alone."""
    model = _model(name)
    lengths = (10, 6, 8)
    rows = [_ids(1, n, seed=s + 1) for s, n in enumerate(lengths)]
    batch = torch.cat([torch.nn.functional.pad(r, (10 - r.shape[1], 0)) for r in rows])
    mask = (torch.arange(10)[None] >= 10 - torch.tensor(lengths)[:, None]).long()
    seq, sc = _generate(model, batch, True, attention_mask=mask)
    for b, r in enumerate(rows):
        seq_r, sc_r = _generate(model, r, True)
        assert torch.equal(seq[b, 10:], seq_r[0, r.shape[1] :])
        torch.testing.assert_close(sc[b], sc_r[0], rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_of_a_left_padded_batch(name):
    chunked_prefill_matches_one_prefill(_model(name))


def test_beam_search_reorders_the_window_state():
    model = _model("oal-swa", layers=(1,))
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0)
    ids = _ids(2, 7)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("name", NAMES)
def test_kernel_files_keep_window_and_sinks(tmp_path, name):
    methods = _methods(name, (0, 2))
    save_kernels(methods, tmp_path)
    back, meta = load_kernels(tmp_path)
    for i, m in methods.items():
        assert type(back[i]) is type(m) and back[i].window == WINDOW
        assert getattr(back[i], "sinks", None) == getattr(m, "sinks", None)
        assert meta["layers"][str(i)]["init"]["window"] == WINDOW
        assert back[i].state_dict().keys() == m.state_dict().keys()
        assert all(torch.equal(back[i].state_dict()[k], t) for k, t in m.state_dict().items())
        again = method_from_record(i, *method_record(m))  # what another process of a launch rebuilds
        assert again.window == WINDOW and all(torch.equal(again.state_dict()[k], t) for k, t in m.state_dict().items())
    if name == "oal-swa":  # the groups come back with the factor (a G = 1 default would not fit it)
        assert torch.equal(back[0].groups, methods[0].groups) and back[0].n_groups == 3


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_roundtrip_keeps_the_window(tmp_path, name):
    model = _model(name)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    for i, m in converted_methods(reloaded).items():
        assert m.name == name and m.window == WINDOW and m.sinks == SINKS, i
    ids = _ids(1, 17)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-12, atol=1e-12)


def test_export_and_reload_an_adapted_hybrid(tmp_path):
    """`oal export` of an oal-swa arm with a LoRA adapter and trained kernels, reloaded by oal.load and by
    transformers' Auto class: the window, the groups and the logits of the merged model; generate with the cache."""
    from oal.adaptation.adapter import converted_model_sha256, save_adapter
    from oal.adaptation.config import AdaptConfig
    from oal.adaptation.train import wrap_lora
    from oal.artefact.arms import adapter_dir, load_converted
    from oal.artefact.export import export
    from oal.models.registry import load_model

    base = save_tiny_llama(tmp_path / "base")
    run = tmp_path / "run"
    mdl, _, provenance = load_model(str(base))
    cfg = mdl.config
    methods = _methods("oal-swa", (1, 2), cfg.num_attention_heads, cfg.num_key_value_heads,
                       cfg.hidden_size // cfg.num_attention_heads)
    save_kernels(methods, kernel_dir(run, "oal-swa"), base_model=str(base), provenance=provenance)
    convert(mdl, [1, 2], copy.deepcopy(methods))
    trained_on = converted_model_sha256(mdl)
    peft_model, names = wrap_lora(mdl, AdaptConfig(lora_r=2, lora_alpha=4, lora_dropout=0.0))
    assert any("factor" in n for n in names)  # the hybrid's kernel adapts jointly with LoRA
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # LoRA B starts at zero: move every trainable tensor so that the adapter matters
        for _, p in sorted(peft_model.named_parameters()):
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    save_adapter(peft_model, adapter_dir(run, "oal-swa"), kernel_names=names, base_sha256=trained_on)

    adapted, _, info = load_converted(run, "oal-swa")
    assert info["adapter"]
    path = export(run, "oal-swa", tmp_path / "export")
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 130, 64, 12, 200, 33]])
    with torch.no_grad():
        want = adapted(ids).logits
        for reloaded in (oal.load(path), AutoModelForCausalLM.from_pretrained(path)):
            got = converted_methods(reloaded)
            assert sorted(got) == [1, 2] and all(m.name == "oal-swa" and m.window == WINDOW for m in got.values())
            assert torch.equal(got[1].groups, methods[1].groups)
            assert (reloaded(ids).logits - want).abs().max() < 1e-5  # merging LoRA into the weights only rounds
    reloaded = oal.load(path)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(reloaded.generate(ids, **kw), reloaded.generate(ids, use_cache=False, **kw))
