"""Adaptation audit (2026-12): a checkpoint is resumed only by a model of the precision that wrote it, and settings
that wrecked training without a word (a NaN grad_clip, adam_eps 0, lora_alpha 0, ...) are refused, naming the
setting."""

import math

import pytest
import torch
from test_adapt import CFG, _blocks, _Kill, _tiny_model

from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import adapt


def _steps_taken(ckpt, model, kill_after=None):
    """The updates `adapt` runs on `model` with checkpoints in `ckpt` (raising _Kill after `kill_after`)."""
    seen = []

    def on_step(step):
        seen.append(step)
        if step == kill_after:
            raise _Kill

    adapt(model, _blocks(5, 12, 0), _blocks(2, 12, 1), AdaptConfig(**{**CFG, "steps": 7}), ckpt_dir=ckpt,
          progress=False, on_step=on_step)
    return seen


def test_a_checkpoint_is_not_resumed_by_a_model_in_another_precision(tmp_path):
    """The base fingerprint hashes tensors as float32, so a bfloat16 model and its float32 upcast share it: a float32
    run resumed a bfloat16 adaptation's checkpoint (its updates 5-7 in float32 after 1-4 in bfloat16), a result
    neither precision gives. It starts over; a bfloat16 rerun still resumes."""
    def bf16():
        return _tiny_model(convert="oal").to(torch.bfloat16)

    with pytest.raises(_Kill):
        _steps_taken(tmp_path, bf16(), kill_after=5)  # checkpoint at update 4 (ckpt_every 2)
    assert _steps_taken(tmp_path, bf16().float())[0] == 1
    with pytest.raises(_Kill):
        _steps_taken(tmp_path, bf16(), kill_after=5)
    assert _steps_taken(tmp_path, bf16())[0] == 5


@pytest.mark.parametrize("name, value", [("grad_clip", math.nan), ("adam_eps", 0.0), ("lora_alpha", 0),
                                         ("weight_decay", -0.01), ("weight_decay", math.nan),
                                         ("betas", (1.0, 0.999))])
def test_settings_that_wreck_training_are_refused_by_name(name, value):
    """A NaN grad_clip and adam_eps 0 made the parameters NaN at the first update (the run then failed with 'q:
    contains NaN or Inf values' from the operator), lora_alpha 0 trained the kernels alone with LoRA scaled to
    nothing, and a negative or NaN weight_decay reached AdamW."""
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        AdaptConfig(**{name: value})


def test_an_infinite_grad_clip_means_no_clipping():
    """inf stays allowed (torch's clip with max_norm inf leaves the gradients as they are): a run with it equals a
    run with a clip far above any gradient norm."""
    runs = []
    for clip in (math.inf, 1e30):
        cfg = AdaptConfig(**{**CFG, "steps": 2, "grad_clip": clip, "lora_dropout": 0.0})
        runs.append(adapt(_tiny_model(convert="oal"), _blocks(4, 12, 0), _blocks(2, 12, 1), cfg, progress=False))
    (a, ra), (b, rb) = runs
    assert ra.history == rb.history
    other = dict(a.named_parameters())
    for n, p in b.named_parameters():
        assert torch.equal(p, other[n]), n


def _trained_lora():
    """`oal.add_lora`'s peft model with every trainable tensor (LoRA and the kernel factor) moved off its start."""
    import oal

    model = oal.add_lora(_tiny_model(convert="oal"), dropout=0.0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.add_(0.05)
    return model.eval()


@pytest.mark.parametrize("where", ["subfolder", "hub"])
def test_load_adapter_reads_the_kernels_wherever_peft_read_the_lora(tmp_path, where):
    """add_lora's load_adapter looked for the kernels in `model_id / oal_kernels.safetensors` only: an adapter read
    with `subfolder=` (a Trainer's checkpoint-N under its output folder) or from a hub repository (a Trainer that
    pushes its checkpoints) got its LoRA and kept the calibrated kernels, without a word (other logits). The hub
    is a repository in a private cache, read offline."""
    import oal

    trained = _trained_lora()
    ids = _blocks(2, 10, 5)
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    if where == "subfolder":
        trained.save_pretrained(str(tmp_path / "out" / "checkpoint-2"))
        source, kwargs = str(tmp_path / "out"), {"subfolder": "checkpoint-2"}
    else:  # the layout huggingface_hub gives a downloaded repository
        commit = "0" * 40
        repo = tmp_path / "cache" / "models--someone--adapter"
        trained.save_pretrained(str(repo / "snapshots" / commit))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
        source, kwargs = "someone/adapter", {"cache_dir": str(tmp_path / "cache"), "local_files_only": True}
    fresh = oal.add_lora(_tiny_model(convert="oal"), dropout=0.0)
    fresh.load_adapter(source, "default", **kwargs)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_token_blocks_that_are_not_ids_are_refused_by_name(dtype):
    """Float token ids (a tokenizer's output cast by the user) failed deep inside the embedding with torch's message;
    the check said "integer tensor" but looked at the shape only."""
    with pytest.raises(ValueError, match=f"^train_blocks: expected a non-empty integer tensor .*{dtype}"):
        adapt(_tiny_model(convert="oal"), _blocks(5, 12, 0).to(dtype), _blocks(2, 12, 1), AdaptConfig(**CFG),
              progress=False)


def test_a_global_batch_beyond_the_training_blocks_is_said(caplog):
    """A batch larger than the dataset repeated blocks within one update without a word."""
    with caplog.at_level("WARNING", logger="oal"):
        adapt(_tiny_model(convert="oal"), _blocks(3, 12, 0), _blocks(2, 12, 1),
              AdaptConfig(**{**CFG, "steps": 1, "batch_size": 2, "grad_accum": 2}), progress=False)
    assert "an update takes 4 blocks (batch 2 x grad_accum 2 x 1 processes) and there are 3 training blocks" \
        in caplog.text
