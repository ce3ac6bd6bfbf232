"""Save/load of converted kernels: safetensors + JSON, identical logits, clear errors on mismatch."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

import oal
from oal.calibration.kernels import KERNELS_FILE, META_FILE, load_kernels
from oal.methods import build_method
from oal.models.attention import converted_methods
from oal.ops.kernel import perturbed_factor
from oal.rundir.hashes import sha256_file


def _base(hidden=32, heads=4):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=41, hidden_size=hidden, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def _converted():
    model = _base()
    gen = torch.Generator().manual_seed(1)
    methods = {}
    for i in (0, 2):
        m = build_method("oal", 4, 2, 8, groups=torch.randint(0, 3, (4, 8), generator=gen), n_groups=3,
                         layer_idx=i)
        with torch.no_grad():
            m.factor.copy_(perturbed_factor(m.factor, 0.4, gen))
        methods[i] = m
    methods[1] = build_method("global", 4, 2, 8, layer_idx=1)
    return oal.convert(model, [0, 1, 2], methods)


def test_round_trip_identical_logits(tmp_path):
    model = _converted()
    ids = torch.randint(0, 41, (2, 13), generator=torch.Generator().manual_seed(2))
    oal.save_kernels(model, tmp_path, base_model="tiny-qwen2", revision="abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == [META_FILE, KERNELS_FILE]
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["base_model"]["name_or_path"] == "tiny-qwen2" and meta["base_model"]["revision"] == "abc"
    assert meta["layers"]["1"]["method"] == "global" and meta["layers"]["0"]["init"]["n_groups"] == 3
    loaded = oal.load(tmp_path, _base())
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    for i, m in converted_methods(model).items():
        other = converted_methods(loaded)[i]
        assert other.name == m.name
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), other.state_dict().values(), strict=True))


def test_other_model_is_rejected(tmp_path):
    oal.save_kernels(_converted(), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        oal.load(tmp_path, _base(hidden=48, heads=6))


def test_mismatched_shapes_are_rejected(tmp_path):
    oal.save_kernels(_converted(), tmp_path)
    tensors = load_file(str(tmp_path / KERNELS_FILE))
    tensors["layers.0.factor"] = torch.zeros(4, 2, 2)
    save_file(tensors, str(tmp_path / KERNELS_FILE))
    with pytest.raises(ValueError, match="SHA256"):
        load_kernels(tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    meta["sha256"] = {KERNELS_FILE: sha256_file(tmp_path / KERNELS_FILE)}  # a consistent record of a bad file
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not fit"):
        load_kernels(tmp_path)


def test_missing_files_and_unconverted_model(tmp_path):
    with pytest.raises(ValueError, match="kernels.json"):
        load_kernels(tmp_path)
    with pytest.raises(ValueError, match="no converted layers"):
        oal.save_kernels(_base(), tmp_path)


def test_load_by_path_checks_file_hashes(tmp_path):
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    from oal.models.registry import load_model

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    ByT5Tokenizer(extra_ids=0).save_pretrained(model_dir)
    model, _, prov = load_model(str(model_dir))
    oal.convert(model, [1], "oal")
    oal.save_kernels(model, tmp_path / "k", base_model=str(model_dir), model_hashes=prov["sha256"])
    ids = torch.randint(0, 259, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(oal.load(tmp_path / "k", str(model_dir))(ids).logits, model(ids).logits)
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)  # same architecture, other weights
    with pytest.raises(ValueError, match="differ"):
        oal.load(tmp_path / "k", str(model_dir))


@pytest.mark.parametrize("name", ["oal", "global", "softmax", "performer", "spectraformer", "dijiang", "taylorshift"])
def test_every_method_round_trips(tmp_path, name):
    m = build_method(name, 4, 2, 16, layer_idx=1, seed=3)
    oal.save_kernels({1: m}, tmp_path)
    got = load_kernels(tmp_path)[0][1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 9, 16, generator=gen), torch.randn(1, 2, 9, 16, generator=gen), torch.randn(
        1, 2, 9, 16, generator=gen)
    assert type(got) is type(m)
    torch.testing.assert_close(got(q, k, v), m(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["dijiang", "spectraformer"])
def test_kernels_of_an_older_construction_are_refused(tmp_path, name):
    # version 1 of these baselines computed another function from the same tensor names and shapes: a file
    # written before versions were recorded (no "version") must not load silently into the new construction
    from oal.models.pretrained import build_methods, conversion_spec

    m = build_method(name, 4, 2, 16, layer_idx=1, seed=3)
    assert m.version == 2
    oal.save_kernels({1: m}, tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert meta["layers"]["1"]["version"] == 2
    del meta["layers"]["1"]["version"]
    # as that oal wrote them: a tensor header without the record's hash
    tensors = load_file(tmp_path / KERNELS_FILE)
    save_file(tensors, tmp_path / KERNELS_FILE, metadata={"format": meta["format"]})
    meta["sha256"][KERNELS_FILE] = sha256_file(tmp_path / KERNELS_FILE)
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="construction version 1"):
        load_kernels(tmp_path)
    spec = conversion_spec(oal.convert(_base(), [1], {1: build_method(name, 4, 2, 8, layer_idx=1)}))
    assert spec["layers"]["1"]["version"] == 2 and len(build_methods(spec)) == 1
    spec["layers"]["1"]["version"] = 1
    with pytest.raises(ValueError, match="config.oal: layer 1: .*construction version 1"):
        build_methods(spec)


@pytest.mark.parametrize("edit", [
    lambda meta: meta["layers"]["1"]["init"].update(eps=5.0),  # another function from the same tensors
    lambda meta: meta["base_model"].update(state_dict_sha256="0" * 64),  # kernels vouched for another model
])
def test_an_edited_kernels_record_is_refused(tmp_path, edit):
    """kernels.json's records are bound to the tensor file's header (record_sha256), which its SHA256 binds in
    turn: an eps changed by hand gave other outputs from files that verified."""
    oal.save_kernels({1: build_method("oal", 4, 2, 16, layer_idx=1, seed=3)}, tmp_path)
    load_kernels(tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    edit(meta)
    (tmp_path / META_FILE).write_text(json.dumps(meta, indent=1))
    with pytest.raises(ValueError, match="kernels.json: its records .* are not those kernels.safetensors was saved"):
        load_kernels(tmp_path)


def test_a_damaged_layer_record_of_older_kernels_is_one_error(tmp_path):
    """Kernels saved before the record was bound (no record_sha256): a layer field of the wrong type gave a
    TypeError traceback from the method's constructor."""
    oal.save_kernels({1: build_method("oal", 4, 2, 16, layer_idx=1, seed=3)}, tmp_path)
    meta = json.loads((tmp_path / META_FILE).read_text())
    meta["layers"]["1"]["init"]["n_groups"] = "x"
    save_file(load_file(tmp_path / KERNELS_FILE), tmp_path / KERNELS_FILE)  # as an older oal wrote it
    meta["sha256"][KERNELS_FILE] = sha256_file(tmp_path / KERNELS_FILE)
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"kernels.json: damaged layer record '1' \(TypeError"):
        load_kernels(tmp_path)
