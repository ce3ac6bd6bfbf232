"""A converted model used as users use any Hugging Face model (a helper's audit, 2026-12-06): what it found wrong, each
now right or refused with one line. The rest of that audit (generation modes, padding, caches, save/load, dtypes,
peft, gradient checkpointing) is covered by test_decode, test_convert and test_export."""

from __future__ import annotations

import threading

import pytest
import torch
from _tiny import tiny_model

import oal
from oal.models import attention

LAYERS = (1,)


def _converted(seed: int = 0):
    from benchmarks.model import random_kernels

    model = tiny_model("qwen2", vocab_size=67)
    return oal.convert(model, list(LAYERS), random_kernels(model, LAYERS, seed=seed)).eval()


def _ids(n=9, seed=1):
    return torch.randint(0, 67, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0, **kw)


def test_each_thread_has_its_own_cache_slot():
    """The slot of the forward in flight lived on the shared attention module: a second thread's pre-hook replaced
    the first thread's before its attention read it, and each wrote into the other's cache."""
    from transformers import DynamicCache

    model = _converted()
    module = attention._attention(model, LAYERS[0])
    mine, theirs = DynamicCache(), DynamicCache()
    attention._pre_hook(module, (), {"past_key_values": mine})
    other = threading.Thread(target=attention._pre_hook, args=(module, (), {"past_key_values": theirs}))
    other.start()
    other.join()
    assert attention._slots()[module] is mine.layers[LAYERS[0]]
    attention._post_hook(module, (), {}, None)
    assert attention._slots().get(module) is None


def test_threads_generating_with_one_model_get_the_sequential_text():
    model = _converted()
    prompts = [_ids(seed=s) for s in range(4)]
    want = [_greedy(model, p) for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = _greedy(model, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_switching_the_attention_implementation_keeps_the_converted_layers(impl):
    """It made them softmax again (logits of the base model), and generating with a cache fed softmax the OAL
    slot's one new key at a time."""
    model = _converted()
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == f"oal_{impl}"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(_greedy(model, ids), _greedy(model, ids, use_cache=False))


def test_output_attentions_is_refused():
    """transformers dropped the converted layers' missing weights, so attentions[1] was layer 2's."""
    model = _converted()
    with pytest.raises(ValueError, match=r"output_attentions: converted layers compute no attention weights .* "
                                         r"layers \[1\]"):
        model(_ids(), output_attentions=True)


def test_a_converted_model_in_memory_is_known_to_pipeline():
    """pipeline() logged "The model 'OALQwen2ForCausalLM' is not supported for text-generation" with ~300 names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model = _converted()
    assert type(model) in MODEL_FOR_CAUSAL_LM_MAPPING.values()  # what pipeline() checks the class against


def test_add_lora_refuses_a_model_that_carries_an_adapter():
    """On an unmerged export, peft added a fresh "default" adapter over the loaded one, which then sat outside
    training and the merge (0.063 of logits lost without a word)."""
    model = _converted()
    model._hf_peft_config_loaded = True  # what transformers' load_adapter sets (oal.load of an unmerged export)
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        oal.add_lora(model)


def test_trainer_checkpoints_carry_the_kernel_coefficients(tmp_path):
    """They were not peft adapter weights: a Trainer checkpoint (peft's save_pretrained) and its resume
    (load_adapter) kept the LoRA matrices and lost the jointly trained kernels (0.075 of logits)."""
    from transformers import Trainer, TrainingArguments

    from oal.adaptation.peft_kernels import KERNELS_FILE

    model = oal.add_lora(_converted(), dropout=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if ".oal_method." in n}
    ids = _ids(n=16)
    train = [{"input_ids": ids[0], "labels": ids[0]}] * 2
    args = TrainingArguments(str(tmp_path / "out"), max_steps=2, save_steps=2, per_device_train_batch_size=1,
                             learning_rate=1e-2, report_to=[], remove_unused_columns=False, use_cpu=True)
    Trainer(model=model, args=args, train_dataset=train).train()
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters() if n in start)  # kernels trained
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / KERNELS_FILE).is_file()
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
    fresh = oal.add_lora(_converted(), dropout=0.0)
    fresh.load_adapter(str(checkpoint), "default", is_trainable=True)  # what the Trainer's resume calls
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-5, atol=1e-5)
    other = oal.add_lora(_converted(), dropout=0.0)
    other.save_pretrained(str(tmp_path / "other"))
    (checkpoint / KERNELS_FILE).write_bytes((tmp_path / "other" / KERNELS_FILE).read_bytes())
    with pytest.raises(ValueError, match="saved beside another adapter_model.safetensors"):
        oal.add_lora(_converted(), dropout=0.0).load_adapter(str(checkpoint), "default")


# A second audit (2026-12-07): masks that the converted layers could not honour were run as plain causal attention.

NOT_CAUSAL = "converted layers attend exactly the earlier real tokens of each row"


def test_packed_sequences_are_refused():
    """position_ids that restart (packed sequences, no attention_mask, no cache: DataCollatorWithFlattening) make
    transformers build a block-causal mask; the converted layer attended across the packed sequences, the second
    sequence's logits 0.2 off those of the sequence run alone."""
    model = _converted()
    ids = torch.cat([_ids(n=7, seed=3), _ids(n=5, seed=4)], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad(), pytest.raises(ValueError, match=NOT_CAUSAL):
        model(ids, position_ids=pos, use_cache=False)


@pytest.mark.parametrize("shape", ["blocks", "bidirectional"])
def test_a_custom_4d_mask_that_is_not_causal_is_refused(shape):
    model = _converted()
    ids = _ids(n=12)
    mask = torch.ones(12, 12, dtype=torch.bool)
    if shape == "blocks":
        mask[:7, 7:] = mask[7:, :7] = False
        mask = mask.tril()
    with torch.no_grad(), pytest.raises(ValueError, match=NOT_CAUSAL):
        model(ids, attention_mask=mask[None, None], use_cache=False)
    with torch.no_grad():  # the causal mask itself is taken, as a bool or an additive float mask
        want = model(ids).logits
        causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
        for m in (causal, torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)):
            torch.testing.assert_close(model(ids, attention_mask=m, use_cache=False).logits, want)


def test_a_sliding_window_model_still_takes_padding():
    """The mask of a sliding-window layer hides the tokens out of its window: not refused (a converted layer
    attends its whole prefix), and a left-padded row gives the tokens of the row run alone."""
    from benchmarks.model import random_kernels

    base = tiny_model("mistral", vocab_size=67)
    base.config.sliding_window = 4
    model = oal.convert(base, list(LAYERS), random_kernels(base, LAYERS, seed=0)).eval()
    alone = _ids(n=6, seed=2)
    batch = torch.cat([_ids(n=9, seed=1), torch.cat([torch.zeros(1, 3, dtype=torch.long), alone], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    got = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got[1, 9:], _greedy(model, alone)[0, 6:12])
    with torch.no_grad():
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        torch.testing.assert_close(model(batch, attention_mask=mask, position_ids=pos, use_cache=False).logits[1, 3:],
                                   model(alone).logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["flex_attention", "flash_attention_2"])
def test_attention_implementations_without_a_padding_mask_are_refused(impl):
    """flex_attention hands attention functions a BlockMask: the converted layers saw no padding, and a left-padded
    row's logits were 0.27 off those of the row run alone."""
    model = _converted()
    with pytest.raises(ValueError, match=f"attention implementation '{impl}' .* use 'sdpa' or 'eager'"):
        model.set_attn_implementation(impl)
    assert model.config._attn_implementation == "oal_sdpa"


def test_a_trainer_checkpoint_of_a_converted_model_loads(tmp_path):
    """A full fine-tune's checkpoint-N holds the Trainer's own state beside the model (optimizer.pt, rng_state.pth,
    training_args.bin...): from_pretrained refused it as pickle files added after oal.json. Added weights still are.
    (Trainer's resume_from_checkpoint and load_best_model_at_end look for model.safetensors only, and so do not find
    the converted weights, model.oal.safetensors.)"""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = _converted()
    ids = _ids(n=16)
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, save_steps=1, per_device_train_batch_size=1,
                             learning_rate=1e-2, report_to=[], remove_unused_columns=False, use_cpu=True)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": ids[0], "labels": ids[0]}]).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "training_args.bin").is_file()
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(checkpoint).eval()(ids).logits,
                                   model.eval()(ids).logits)
    (checkpoint / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: not recorded in oal.json"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_a_family_with_its_own_score_scale_is_refused():
    """The methods score q.k / sqrt(d) (Eq. 2, 7) whatever the `scaling` transformers passes: a family that scales
    otherwise (a query_pre_attn_scalar, an attention multiplier) got its converted layers silently wrong."""
    model = _converted()
    ids = _ids()
    with torch.no_grad():
        model(ids)  # qwen2: scaling = head_dim ** -0.5, accepted
        model.model.layers[LAYERS[0]].self_attn.scaling = 0.5
        with pytest.raises(ValueError, match=r"scales attention scores by 0.5, not 1/sqrt\(head_dim\)"):
            model(ids)
        model.model.layers[0].self_attn.scaling = 0.5  # a softmax layer takes any scale
        model.model.layers[LAYERS[0]].self_attn.scaling = model.model.layers[2].self_attn.scaling
        model(ids)
