"""Recurrent decoding: O(1) state in the cache for converted layers, identical tokens/logits to full forwards."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from oal.methods import build_method
from oal.models.cache import OALStateLayer, cache_kwargs, state_nbytes
from oal.models.convert import convert
from oal.ops.kernel import perturbed_factor

HQ, HKV, D, V = 4, 2, 8, 53


def _model(family="qwen2", layers=(1,), method="oal"):
    torch.manual_seed(0)
    kw = dict(vocab_size=V, hidden_size=HQ * D, intermediate_size=48, num_hidden_layers=3, num_attention_heads=HQ,
              num_key_value_heads=HKV, max_position_embeddings=128)
    model = (Qwen2ForCausalLM(Qwen2Config(**kw)) if family == "qwen2" else LlamaForCausalLM(LlamaConfig(**kw))).eval()
    gen = torch.Generator().manual_seed(3)
    methods = {}
    for i in layers:
        if method == "oal":
            m = build_method("oal", HQ, HKV, D, groups=torch.randint(0, 3, (HQ, D), generator=gen), n_groups=3)
            with torch.no_grad():
                m.factor.copy_(perturbed_factor(m.factor, 0.3, gen))
        else:
            m = build_method(method, HQ, HKV, D)
        methods[i] = m
    return convert(model, list(layers), methods)


def _ids(b, n, seed=0):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, use_cache, **kw):
    out = model.generate(ids, max_new_tokens=7, do_sample=False, use_cache=use_cache, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_generate_with_cache_matches_full_forwards(family):
    model = _model(family, layers=(0, 1))
    ids = _ids(3, 12)
    seq_c, sc_c = _generate(model, ids, True)
    seq_f, sc_f = _generate(model, ids, False)
    assert torch.equal(seq_c, seq_f)
    torch.testing.assert_close(sc_c, sc_f, rtol=1e-4, atol=1e-5)


def test_incremental_logits_equal_one_forward_and_cache_holds_state():
    model = _model(layers=(0, 1))
    ids = _ids(2, 19)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        parts = [model(ids[:, :9], **cache_kwargs(model, cache), use_cache=True).logits]
        for t in range(9, 19):
            parts.append(model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits)
        full = model(ids).logits
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    assert isinstance(cache.layers[0], OALStateLayer) and isinstance(cache.layers[1], OALStateLayer)
    assert type(cache.layers[2]).__name__ == "DynamicLayer"
    assert cache.get_seq_length() == 19 and cache.layers[1].state.shape == (2, HKV, 1 + D + D * (D + 1) // 2, D + 1)


def test_the_cache_layer_answers_every_transformers_5_release():
    """In transformers 5.0-5.12 a cache layer must define get_max_cache_shape (abstract there: every cached generate
    of a converted model failed to make its OALStateLayer), and in 5.0-5.3 get_mask_sizes gets the cache_position
    tensor, not the query length; pyproject allows transformers >= 5.0."""
    layer = OALStateLayer()
    layer.update(torch.zeros(1, HKV, 4, D), torch.zeros(1, HKV, 4, D))
    assert layer.get_max_cache_shape() == layer.get_max_length() == -1
    assert layer.get_mask_sizes(3) == layer.get_mask_sizes(torch.arange(4, 7)) == (7, 0)


def test_state_memory_constant_in_context_length():
    model = _model(layers=(1,))
    sizes = []
    for n in (8, 40):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(_ids(1, n), **cache_kwargs(model, cache), use_cache=True)
        sizes.append(state_nbytes(cache))
    assert sizes[0][1] == sizes[1][1] > 0  # converted layer: same bytes at 8 and 40 tokens
    assert sizes[1][0] == 5 * sizes[0][0]  # softmax layer: K/V grows with the context


def test_left_padding_matches_unpadded_rows():
    model = _model(layers=(0, 1))
    a, b = _ids(1, 10, seed=1), _ids(1, 6, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    seq, sc = _generate(model, batch, True, attention_mask=mask)
    seq_a, sc_a = _generate(model, a, True)
    seq_b, sc_b = _generate(model, b, True)
    assert torch.equal(seq[0, 10:], seq_a[0, 10:]) and torch.equal(seq[1, 10:], seq_b[0, 6:])
    torch.testing.assert_close(sc[0], sc_a[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sc[1], sc_b[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["oal", "performer"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_right_padding_matches_unpadded_rows(method, use_cache):
    """Right padding (what scorers use): real positions equal each row run alone, padded positions are zero in the
    converted layer, with or without a cache; a cache's state is kept and covers each row's real tokens only (what
    decoding after the prompt reads)."""
    model = _model(layers=(0, 1), method=method).double()
    lengths = (11, 5, 8)
    rows = [_ids(1, n, seed=s) for s, n in enumerate(lengths)]
    batch = torch.cat([torch.nn.functional.pad(r, (0, 11 - r.shape[1])) for r in rows])
    mask = (torch.arange(11)[None] < torch.tensor(lengths)[:, None]).long()
    cache = DynamicCache(config=model.config) if use_cache else None
    kw = cache_kwargs(model, cache) if use_cache else {}
    with torch.no_grad():
        got = model(batch, attention_mask=mask, use_cache=use_cache, **kw).logits
        for b, r in enumerate(rows):
            alone = DynamicCache(config=model.config) if use_cache else None
            want = model(r, use_cache=use_cache, **(cache_kwargs(model, alone) if use_cache else {})).logits
            torch.testing.assert_close(got[b, : r.shape[1]], want[0], rtol=1e-9, atol=1e-9)
            for i in (0, 1) if use_cache else ():  # the state covers the row's real tokens only
                assert cache.layers[i].state is not None, "the padded forward dropped the converted layer's state"
                torch.testing.assert_close(cache.layers[i].state[b], alone.layers[i].state[0], rtol=1e-9, atol=1e-9)


def chunked_prefill_matches_one_prefill(model):
    """generate(prefill_chunk_size=...) on a left-padded batch: the tokens and scores of one prefill, also for a row
    whose padding fills whole chunks (no real token in them) and then starts a chunk."""
    lengths = (20, 11, 3)
    rows = [_ids(1, n, seed=s + 1) for s, n in enumerate(lengths)]
    batch = torch.cat([torch.nn.functional.pad(r, (20 - r.shape[1], 0)) for r in rows])
    mask = (torch.arange(20)[None] >= 20 - torch.tensor(lengths)[:, None]).long()
    seq, sc = _generate(model, batch, True, attention_mask=mask, prefill_chunk_size=6)
    want_seq, want_sc = _generate(model, batch, True, attention_mask=mask)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(sc, want_sc, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("method", ["oal", "performer", "softmax"])
def test_chunked_prefill_of_a_left_padded_batch(method):
    chunked_prefill_matches_one_prefill(_model(layers=(0, 1), method=method).double())


def test_padded_queries_get_zero_output():
    model = _model(layers=(1,))
    seen = {}
    attn = model.model.layers[1].self_attn
    attn.register_forward_hook(lambda mod, args, out: seen.setdefault("out", out[0]))
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=False)
    o_bias = attn.o_proj.bias if attn.o_proj.bias is not None else 0.0
    torch.testing.assert_close(seen["out"][1, 4:], torch.zeros_like(seen["out"][1, 4:]) + o_bias)
    assert seen["out"][1, :4].abs().sum() > 0


def test_inner_padding_is_a_clear_error():
    model = _model()
    ids = _ids(2, 8)
    mask = torch.ones_like(ids)
    mask[1, 3] = 0
    with pytest.raises(ValueError, match="left or right padding"), torch.no_grad():
        model(ids, attention_mask=mask)


def test_a_pad_token_inside_a_prompt_names_the_inferred_mask():
    """generate without an attention_mask infers one from pad_token_id (when it is not the eos token): a pad token
    inside a prompt then reads as padding between real tokens, which the error must explain."""
    model = _model()
    ids = _ids(1, 8)
    ids[0, 3] = 5
    with pytest.raises(ValueError, match="left or right padding.*pad_token_id"), torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=5, eos_token_id=1)


def test_left_padding_after_earlier_tokens_is_a_clear_error():
    """A cache already holds a row's earlier tokens: padding before that row's new tokens would sit between real
    tokens, which the recurrent state cannot skip, so it is refused (naming attention_mask), not silently merged."""
    model = _model()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(2, 6), **cache_kwargs(model, cache), use_cache=True)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6] = 0  # row 1: its first new token is padding
        with pytest.raises(ValueError, match="attention_mask: padding after earlier tokens"):
            model(_ids(2, 3, seed=1), attention_mask=mask, **cache_kwargs(model, cache), use_cache=True)


def test_stateless_method_falls_back_to_cached_kv():
    """A converted layer whose method has no recurrent state (here exact softmax) keeps K/V and stays exact."""
    model = _model(layers=(1,), method="softmax")
    ids = _ids(2, 9)
    seq_c, sc_c = _generate(model, ids, True)
    seq_f, sc_f = _generate(model, ids, False)
    assert torch.equal(seq_c, seq_f)
    torch.testing.assert_close(sc_c, sc_f, rtol=1e-4, atol=1e-5)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
    assert isinstance(cache.layers[1], OALStateLayer) and not cache.layers[1].stateful
    assert cache.layers[1].keys.shape[-2] == 9


def test_beam_search_runs_and_matches_no_cache():
    model = _model(layers=(1,))
    ids = _ids(2, 7)
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=2, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


def test_prefilled_softmax_cache_is_rejected():
    model = _model(layers=(1,))
    cache = DynamicCache(config=model.config)
    cache.update(torch.zeros(1, HKV, 3, D), torch.zeros(1, HKV, 3, D), 1)
    with pytest.raises(ValueError, match="already holds softmax K/V"), torch.no_grad():
        model(_ids(1, 2), **cache_kwargs(model, cache), use_cache=True)


def test_embedded_model_generate_with_cache_matches_full_forwards():
    """On the embedded default model (shipped with the package): cached decoding == full recompute, batch 2."""
    from oal.models.registry import load_model

    model, _, _ = load_model("default")
    from oal.models.registry import default_layers

    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    methods = {}
    for i in default_layers(model):
        m = build_method("oal", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx=i,
                         groups=torch.randint(0, 3, (cfg.num_attention_heads, cfg.head_dim), generator=gen))
        with torch.no_grad():
            m.factor.copy_(perturbed_factor(m.factor, 0.3, gen))
        methods[i] = m
    convert(model, list(methods), methods)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seq_c, sc_c = _generate(model, ids, True)
    seq_f, sc_f = _generate(model, ids, False)
    assert torch.equal(seq_c, seq_f)
    torch.testing.assert_close(sc_c, sc_f, rtol=1e-4, atol=1e-4)


def test_cache_kwargs_names_the_keyword_the_forward_takes():
    """transformers renamed `past_key_values` to `cache` (5.17 on the lent GPU machine takes the first, 5.25 the
    second); each ignores the other's name silently, leaving the caller's cache empty. `cache_kwargs` picks the one
    the model's forward (or a peft model's base model's) takes, and that one fills the cache."""

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    class Wrapped(torch.nn.Module):  # peft's PeftModel: forward(*args, **kwargs), the base model behind it
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    marker = object()
    assert cache_kwargs(Old(), marker) == {"past_key_values": marker}
    assert cache_kwargs(New(), marker) == {"cache": marker}
    assert cache_kwargs(Wrapped(Old()), marker) == {"past_key_values": marker}
    assert Wrapped(New())(None, **cache_kwargs(Wrapped(New()), marker)) is marker
    model = _model(layers=(1,))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(_ids(1, 5), **cache_kwargs(model, cache), use_cache=True)
    assert cache.get_seq_length() == 5 and isinstance(cache.layers[1], OALStateLayer)


def test_no_model_call_names_the_cache_keyword_itself():
    """CI runs one transformers release, which takes one of the two names: a call that writes `cache=` or
    `past_key_values=` itself passes there and silently loses its cache on the other (see above)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    call = re.compile(r"\bmodel\([^)]*\b(cache|past_key_values)=")
    found = [f"{path.relative_to(root)}:{i}" for folder in ("src", "benchmarks", "scripts", "tests")
             for path in sorted((root / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if call.search(line)]
    assert not found, f"pass the cache with oal.models.cache.cache_kwargs(model, cache): {found}"


def test_caches_and_decoding_it_cannot_keep_a_state_in_are_refused_by_name():
    """docs/guides/convert.md: a static cache, and assisted decoding (which crops the cache back), are refused
    (by `OALStateLayer.crop`, or first by transformers itself, which knows the cache cannot be cropped)."""
    model = _model()
    ids = _ids(1, 9)
    with pytest.raises(ValueError, match="static/sliding/quantized caches are not supported"):
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)
    torch.manual_seed(7)  # an assistant whose drafts the model rejects, so that the cache must be cropped back
    assistant = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=HQ * D, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=HQ, num_key_value_heads=HKV,
                                             max_position_embeddings=128)).eval()
    with pytest.raises(ValueError, match="(?i)assisted"):  # transformers 5.2x refuses first; 5.17 reaches crop()
        model.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=assistant, pad_token_id=0)


def test_sampling_several_sequences_and_a_continued_cache_give_the_tokens_of_no_cache():
    """docs/guides/convert.md: sampled decoding with num_return_sequences (the cache repeated per sequence) and a
    second turn continuing a returned past_key_values give the tokens that full forwards (use_cache=False) give."""
    model = _model(layers=(0, 1))
    ids = _ids(2, 7) % (V - 1) + 1  # no pad token (0) inside the prompts: generate would read it as padding
    kw = dict(max_new_tokens=5, do_sample=True, top_k=0, num_return_sequences=3, pad_token_id=0)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        runs.append(model.generate(ids, use_cache=use_cache, **kw))
    assert runs[0].shape == (6, 12) and torch.equal(runs[0], runs[1])

    first = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, _ids(2, 3, seed=5) % (V - 1) + 1], 1)  # the user's next message
    cont = model.generate(turn, past_key_values=first.past_key_values, max_new_tokens=4, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(cont, model.generate(turn, max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=False))
