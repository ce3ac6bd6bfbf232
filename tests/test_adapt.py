"""Joint LoRA + kernel adaptation (App. F.2): frozen backbone, kernel training, selection and exact resume."""

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.adaptation.adapter import load_adapter, save_adapter
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import adapt, kernel_parameter_names
from oal.methods import build_method
from oal.methods.base import AttentionMethod
from oal.models.convert import convert as convert_model
from oal.ops.kernel import perturbed_factor, taylor_factor

VOCAB = 53


def _tiny_model(seed=0, convert=None):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    if convert is not None:
        gen = torch.Generator().manual_seed(seed + 7)
        groups = torch.randint(0, 3, (4, 16), generator=gen)
        factor = perturbed_factor(taylor_factor(4, 3), 0.1, generator=gen)
        if convert == "global":
            factor = perturbed_factor(taylor_factor(4, 1), 0.1, generator=gen)
        method = build_method(convert, 4, 2, 16, groups=groups, factor=factor, layer_idx=1)
        convert_model(model, [1], {1: method})
    return model


def _blocks(n, length, seed):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


CFG = dict(steps=6, val_every=3, ckpt_every=2, warmup_frac=0.2, lr=5e-3, seed=3)


def test_lora_targets_every_layer_and_freezes_backbone():
    model = _tiny_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft_model, res = adapt(model, _blocks(4, 12, 0), _blocks(2, 12, 1), AdaptConfig(**CFG), progress=False)
    lora = [n for n, _ in peft_model.named_parameters() if "lora_A" in n]
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert any(f"layers.{layer}.self_attn.{proj}.lora_A" in n for n in lora), (layer, proj)
    assert res.n_kernel_params == 0 and res.kernel_change == 0.0
    for n, p in peft_model.named_parameters():
        if "lora_" not in n:
            name = n.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(p, base[name]), n
    assert any(float(p.detach().abs().sum()) > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)
    assert [v["step"] for v in res.validation] == [3, 6]
    lrs = [h["lr"] for h in res.history]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(5e-3) and lrs[-1] < max(lrs)  # warmup then cosine


def test_kernel_parameters_train_jointly_and_groups_stay_fixed():
    model = _tiny_model(convert="oal")
    method = model.model.layers[1].self_attn.oal_method
    assert kernel_parameter_names(model) == ["model.layers.1.self_attn.oal_method.factor"]
    factor0, groups0 = method.factor.detach().clone(), method.groups.clone()
    peft_model, res = adapt(model, _blocks(4, 12, 0), _blocks(2, 12, 1), AdaptConfig(**CFG), progress=False)
    # the paper's count: (G+1)(G+2)/2 lower-triangle entries per head, not the padded (G+1)^2 factor
    expected = sum((g + 1) * (g + 2) // 2 for g in (int(torch.unique(row).numel()) for row in groups0))
    assert res.n_kernel_params == expected < factor0.numel() and res.kernel_change > 0
    assert not torch.equal(method.factor.detach(), factor0)
    assert torch.equal(method.groups, groups0)


def test_training_never_builds_dense_attention(monkeypatch):
    """Converted layers train through the operator's chunked autograd: the O(N^2) paths must not be touched."""

    def boom(*args, **kwargs):
        raise AssertionError("dense N x N attention used during adaptation")

    monkeypatch.setattr(AttentionMethod, "reference", boom)
    monkeypatch.setattr(AttentionMethod, "dense_kernel", boom)
    monkeypatch.setattr(type(build_method("oal", 4, 2, 16)), "dense_kernel", boom)
    monkeypatch.setattr("oal.ops.reference_attention", boom)
    model = _tiny_model(convert="oal")
    _, res = adapt(model, _blocks(3, 150, 0), _blocks(1, 150, 1), AdaptConfig(**{**CFG, "steps": 2}),
                   progress=False)
    assert res.kernel_change > 0


def test_kernel_parameters_frozen_when_disabled():
    model = _tiny_model(convert="oal")
    factor0 = model.model.layers[1].self_attn.oal_method.factor.detach().clone()
    _, res = adapt(model, _blocks(4, 12, 0), _blocks(2, 12, 1), AdaptConfig(**CFG, train_kernel=False),
                   progress=False)
    assert res.n_kernel_params == 0
    assert torch.equal(model.model.layers[1].self_attn.oal_method.factor.detach(), factor0)


def test_best_validation_checkpoint_is_restored():
    model = _tiny_model(convert="global")
    seen = {}

    def record(step):
        seen[step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    cfg = AdaptConfig(**{**CFG, "val_every": 1, "lr": 0.05})
    peft_model, res = adapt(model, _blocks(4, 12, 0), _blocks(2, 12, 1), cfg, progress=False, on_step=record)
    nll = [v["val_nll"] for v in res.validation]
    assert res.best_step == 1 + nll.index(min(nll)) and res.best_val_nll == min(nll)
    for n, p in peft_model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), seen[res.best_step][n.removeprefix("base_model.model.")]), n


class _Kill(Exception):
    pass


def _run(tmp, kill_after=None, convert="oal", *, steps=7, device=None):
    """Adapt a fresh tiny model (on `device`) with checkpoints in `tmp`, raising `_Kill` after step `kill_after`:
    what a killed process leaves, and what a new one resumes from."""
    model = _tiny_model(convert=convert)
    if device is not None:
        model = model.to(device)

    def maybe_kill(step):
        if kill_after is not None and step == kill_after:
            raise _Kill

    return adapt(model, _blocks(5, 12, 0), _blocks(2, 12, 1), AdaptConfig(**{**CFG, "steps": steps}),
                 ckpt_dir=tmp, progress=False, on_step=maybe_kill)


@pytest.mark.parametrize("kill_after, mid_swap", [(1, False), (5, False), (5, True)])
def test_resume_after_kill_matches_uninterrupted_run(tmp_path, kill_after, mid_swap):
    ref_model, ref = _run(tmp_path / "ref")
    with pytest.raises(_Kill):
        _run(tmp_path / "killed", kill_after=kill_after)
    if mid_swap:  # killed between atomic_dir's two renames: only the previous checkpoint is on disk
        (tmp_path / "killed").rename(tmp_path / ".killed.old")
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger, level = logging.getLogger("oal"), logging.getLogger("oal").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as the command line sets it
    try:
        model, res = _run(tmp_path / "killed")  # a fresh process would rebuild the same model, then resume
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # the rerun says where it resumes (it said nothing); killed before the first checkpoint (every 2 updates), it
    # starts over
    assert any("resuming at update 4 of" in m for m in said) == (kill_after >= CFG["ckpt_every"]), said
    assert res.history == ref.history and res.validation == ref.validation
    assert res.best_step == ref.best_step and res.best_val_nll == ref.best_val_nll
    a = dict(ref_model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, a[n]), n


def test_save_and_load_adapter_roundtrip(tmp_path):
    model, res = adapt(_tiny_model(convert="oal"), _blocks(4, 12, 0), _blocks(2, 12, 1), AdaptConfig(**CFG),
                       progress=False)
    save_adapter(model, tmp_path / "adapter", res)
    assert (tmp_path / "adapter" / "oal_adapter.json").exists()  # and no adapter_config.json: see test_routes
    assert (tmp_path / "adapter" / "kernel_params.safetensors").exists()
    ids = _blocks(2, 10, 5)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        loaded = load_adapter(_tiny_model(convert="oal"), tmp_path / "adapter")
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="adapter_dir"):
        load_adapter(_tiny_model(convert="oal"), tmp_path)
    # the manifest's peft config is bound to the LoRA file's header: a lora_alpha edited by hand (the LoRA's
    # scale) gave other outputs from files that all verified
    manifest = tmp_path / "adapter" / "oal_adapter.json"
    record = json.loads(manifest.read_text())
    record["lora"]["lora_alpha"] *= 4
    manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="oal_adapter.json: its peft config or base model is not the one"):
        load_adapter(_tiny_model(convert="oal"), tmp_path / "adapter")


@pytest.mark.parametrize("kw, name", [({"steps": 0}, "steps"), ({"lr": -1.0}, "lr"),
                                      ({"warmup_frac": 1.0}, "warmup_frac"), ({"val_every": 0}, "val_every")])
def test_config_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        AdaptConfig(**kw)


def test_bad_blocks_rejected():
    with pytest.raises(ValueError, match="train_blocks"):
        adapt(_tiny_model(), torch.zeros(3, dtype=torch.long), _blocks(2, 8, 0), AdaptConfig(**CFG), progress=False)


def test_a_checkpoint_of_another_conversion_is_not_resumed(tmp_path):
    """swa has no tensors, so layer 0 or layer 1 converted give one tensor fingerprint; the checkpoint key still
    tells them apart, and a finished checkpoint of one is not taken for the other."""
    cfg = AdaptConfig(**{**CFG, "steps": 2, "val_every": 2, "ckpt_every": 1})
    steps = {}
    for layer in (0, 1):
        model = _tiny_model()
        convert_model(model, [layer], {layer: build_method("swa", 4, 2, 16, window=4, sinks=1, layer_idx=layer)})
        steps[layer] = []
        adapt(model, _blocks(4, 12, 0), _blocks(2, 12, 1), cfg, ckpt_dir=tmp_path / "ckpt", progress=False,
              on_step=steps[layer].append)
    assert steps == {0: [1, 2], 1: [1, 2]}  # the second trained from the start


def test_gradients_are_clipped_to_grad_clip():
    """App. F.2 clips the gradient norm (to 1.0, cfg.grad_clip): with a clip far below the raw norm, every update
    the optimizer takes sees a global gradient norm of exactly grad_clip (up to clip_grad_norm_'s 1e-6)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen = []

    def before_step(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        adapt(_tiny_model(convert="oal"), _blocks(4, 12, 0), _blocks(2, 12, 1),
              AdaptConfig(**{**CFG, "steps": 3, "grad_clip": 1e-3}), progress=False)
    finally:
        handle.remove()
    assert len(seen) == 3 and all(n == pytest.approx(1e-3, rel=1e-3) for n in seen), seen


def test_training_blocks_follow_a_seeded_shuffle(monkeypatch):
    """App. F.2: one training-block order per backbone, fixed by the seed: concatenated seeded permutations of the
    blocks (each block once per pass), another order for another seed, and the one adapt actually feeds."""
    import oal.adaptation.train as train

    order = train._block_order(5, 12, seed=3)
    assert sorted(order[:5]) == sorted(order[5:10]) == list(range(5)) and len(set(order[10:])) == 2
    assert order == train._block_order(5, 12, seed=3)
    orders = {tuple(train._block_order(5, 12, seed=s)) for s in range(4)}
    assert len(orders) == 4  # another seed, another order

    fed = []

    class Spy(train.CausalLMLoss):
        def forward(self, input_ids, labels=None):
            fed.append(input_ids)
            return super().forward(input_ids, labels)

    monkeypatch.setattr(train, "CausalLMLoss", Spy)
    blocks = _blocks(4, 12, 0)
    adapt(_tiny_model(), blocks, _blocks(2, 12, 1), AdaptConfig(**{**CFG, "steps": 6}), progress=False)
    rows = [next(i for i in range(4) if torch.equal(ids[0], blocks[i])) for ids in fed]
    assert rows == train._block_order(4, 6, seed=CFG["seed"])


@pytest.mark.parametrize("edit", ["step", "sha256"])
def test_an_edited_checkpoint_is_not_resumed(tmp_path, edit):
    """state.json's loop state is bound to trainable.safetensors' header, and it must hash every file the resume
    reads: a step edited by hand, or a file left out of its hashes, is a damaged checkpoint (adaptation starts
    over) rather than a resume from what it says."""
    from safetensors.torch import load_file

    from oal.adaptation.checkpoint import read_checkpoint

    with pytest.raises(_Kill):
        _run(tmp_path, kill_after=5)
    path = tmp_path / "state.json"
    state = json.loads(path.read_text())
    names = set(load_file(tmp_path / "trainable.safetensors"))
    assert read_checkpoint(tmp_path, state["key"], names, 1) is not None
    if edit == "step":
        state["step"] -= 2
    else:
        del state["sha256"]["rng.safetensors"]
    path.write_text(json.dumps(state))
    assert read_checkpoint(tmp_path, state["key"], names, 1) is None
