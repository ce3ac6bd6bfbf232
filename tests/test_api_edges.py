"""The Python API's edges, as a notebook user meets them with plausible mistakes: `oal.load` given a device this
torch cannot use, a converted folder where a kernels folder or a base model belongs, a misspelt option;
`oal.save_kernels` given a dict of other things; `oal.pipeline.runs.run` given a preset's name; `CalibConfig`
given a flag or a non-finite number; a method setting misspelt; one method object in two layers; a peft model's
converted layers; `oal.linearize` on weights that hold a NaN. Each was a traceback from deep inside, a misleading
message, or silence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oal
from oal.methods import build_method
from tests._tiny import save_tiny_llama, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base folder, kernels folder, converted folder) of a tiny Llama converted on layer 1."""
    from oal.models.registry import load_model

    root = tmp_path_factory.mktemp("edges")
    base_dir = save_tiny_llama(root / "base")
    model, _, provenance = load_model(str(base_dir))
    methods = {1: build_method("oal", 4, 2, 8, layer_idx=1)}
    oal.save_kernels(methods, root / "kernels", base_model=str(base_dir), provenance=provenance)
    oal.convert(model, [1], methods).save_pretrained(root / "converted")
    return base_dir, root / "kernels", root / "converted"


# --------------------------------------------------------------------------------------------- oal.load

@pytest.mark.parametrize("with_base", [False, True])
def test_load_names_a_device_this_torch_cannot_use(saved, with_base):
    """device="cuda" without a GPU loaded the whole model, then raised torch's AssertionError ("Torch not compiled
    with CUDA enabled"); a hundredth GPU is missing on every machine."""
    base_dir, kernels, converted = saved
    args = (kernels, str(base_dir)) if with_base else (converted,)
    with pytest.raises(ValueError, match="^device: 'cuda:99' requested") as err:
        oal.load(*args, device="cuda:99")
    assert "\n" not in str(err.value)


def test_load_names_a_converted_folder_given_as_the_kernels(saved):
    """oal.load(CONVERTED, base) said "CONVERTED/kernels.json: is missing", after loading the base model."""
    from oal.models.registry import load_model

    base_dir, _, converted = saved
    for base in (str(base_dir), load_model(str(base_dir))[0]):
        with pytest.raises(ValueError, match=r"^directory: .* is a converted model's folder; load it without "):
            oal.load(converted, base)


@pytest.mark.parametrize("which,says", [("converted", "is a converted model's folder"),
                                        ("kernels", "is a kernels folder")])
def test_load_names_a_base_model_that_is_no_base_model(saved, which, says):
    """A converted folder given as the base model was 'name_or_path: ... unsupported architecture
    OALLlamaForCausalLM', a kernels folder 'name_or_path: ... no config.json': neither named base_model."""
    _, kernels, converted = saved
    with pytest.raises(ValueError, match=f"^base_model: .* {says}; pass the base model"):
        oal.load(kernels, str({"converted": converted, "kernels": kernels}[which]))


def test_load_names_the_base_model_argument_for_a_missing_folder(saved, tmp_path):
    _, kernels, _ = saved
    with pytest.raises(ValueError, match="^base_model: no such model folder"):
        oal.load(kernels, str(tmp_path / "nowhere" / "model"))


@pytest.mark.parametrize("with_base", [False, True])
def test_load_names_a_misspelt_option(saved, with_base):
    """`devcie="cpu"` was a TypeError of load_export / load_model, functions the caller never called."""
    base_dir, kernels, converted = saved
    args = (kernels, str(base_dir)) if with_base else (converted,)
    with pytest.raises(ValueError, match="^load_kwargs: devcie not among the options"):
        oal.load(*args, devcie="cpu")


def test_load_takes_a_dtype_by_name_with_a_base_model(saved):
    """A converted folder took dtype="float32", a base model by name refused it ('expected a torch.dtype')."""
    base_dir, kernels, _ = saved
    model = oal.load(kernels, str(base_dir), dtype="float32")
    assert sorted(oal.models.attention.converted_methods(model)) == [1]


# --------------------------------------------------------------------------------------------- oal.save_kernels

@pytest.mark.parametrize("bad,says", [({1: "oal"}, r"model_or_methods\[1\]: expected an AttentionMethod"),
                                      ({}, "model_or_methods: .* got an empty dict"),
                                      ({"a": None}, "model_or_methods: expected layer indices"),
                                      ({True: None}, "model_or_methods: expected layer indices"),
                                      ([1], "model_or_methods: expected a converted model or a dict")])
def test_save_kernels_names_a_mapping_of_other_things(tmp_path, bad, says):
    """{1: "oal"} raised AttributeError ('str' object has no attribute 'state_dict'); {} and {"a": method} wrote
    kernels files that oal.load then refused (no layer to convert, a damaged layer record)."""
    with pytest.raises(ValueError, match=f"^{says}"):
        oal.save_kernels(bad, tmp_path / "k")
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("arg,value,says", [("extra", {"x": np.float32(1)}, "not JSON-able"),
                                            ("extra", [1, 2], "expected a dict, got list"),
                                            ("provenance", "local", "expected a dict .load_model's., got str"),
                                            ("model_hashes", ["a"], "expected a dict, got list"),
                                            ("directory", None, "expected a folder's path, got NoneType")])
def test_save_kernels_names_a_record_it_cannot_write(tmp_path, arg, value, says):
    """extra={"x": np.float32(1)} was the JSON writer's TypeError, a list or string in place of a dict a bare
    "dictionary update sequence element #0 ...", and no directory pathlib's TypeError: none named the argument."""
    kwargs = {"directory": tmp_path / "k", arg: value}
    with pytest.raises(ValueError, match=f"^{arg}: {says}"):
        oal.save_kernels({1: build_method("global", 4, 2, 8)}, **kwargs)
    assert not (tmp_path / "k").exists()


def test_save_kernels_takes_numpy_layer_indices(tmp_path):
    from oal.calibration.kernels import load_kernels

    method = build_method("global", 4, 2, 8, layer_idx=2)
    oal.save_kernels({np.int64(2): method}, tmp_path / "k")
    loaded, _ = load_kernels(tmp_path / "k")
    assert list(loaded) == [2] and torch.equal(loaded[2].factor, method.factor)


# --------------------------------------------------------------------------------------------- runs, CalibConfig

@pytest.mark.parametrize("entry", ["run", "run_seed", "run_selection"])
def test_runs_name_a_config_that_is_not_a_run_config(tmp_path, entry):
    """run("default", DIR) raised AttributeError: 'str' object has no attribute 'device'."""
    from oal.pipeline import runs

    with pytest.raises(ValueError, match=r"^cfg: expected a RunConfig \(RunConfig.from_preset\('default'\)\), got str"):
        getattr(runs, entry)("default", tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seeds", ["1,x", [-1, 3], 0.5])
def test_run_reads_its_seeds_as_the_command_line_does(tmp_path, seeds):
    """run(cfg, DIR, seeds="1,x") ran the "seeds" "1", "," and "x" (making DIR/seed-1/ before torch refused a
    string seed), [-1, 3] a negative seed, and 0.5 raised TypeError from len()."""
    from oal.pipeline.config import RunConfig
    from oal.pipeline.runs import run

    with pytest.raises(ValueError, match="^seeds: expected"):
        run(RunConfig.from_preset("default"), tmp_path / "run", seeds=seeds)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field,value,says", [("max_steps", True, "an integer >= 1"), ("queries", 2.0, "an integer"),
                                              ("seed", -1, "an integer >= 0"), ("seed", True, "an integer >= 0"),
                                              ("lr", float("inf"), "a finite number > 0"),
                                              ("lr", float("nan"), "a finite number > 0"),
                                              ("clip_norm", float("inf"), "a finite number > 0"),
                                              ("perturb_std", float("nan"), "a finite number >= 0"),
                                              ("lr", "0.1", "a finite number > 0")])
def test_calib_config_names_a_field_out_of_its_range(field, value, says):
    """CalibConfig(max_steps=True) calibrated one update, lr=inf passed `lr > 0` (the factor overflowed later),
    lr="0.1" raised TypeError from a comparison, and a NaN's message named "lr/clip_norm" together."""
    from oal.calibration.data import CalibConfig

    with pytest.raises(ValueError, match=f"^{field}: expected {says}"):
        CalibConfig(**{field: value})
    assert CalibConfig(lr=1, perturb_std=0).lr == 1  # an int where a float is asked is still a number


# --------------------------------------------------------------------------------------------- methods

def test_build_method_names_a_misspelt_setting():
    """Several constructors took `**_ignored`, so `windw=64` built a method silently without it."""
    for name in ("dijiang", "performer", "spectraformer", "taylorshift", "global", "oal"):
        with pytest.raises(ValueError, match=f"^windw: not a setting of method '{name}' \\(its settings: "):
            build_method(name, 4, 2, 8, windw=64)
    from oal.methods.dijiang import DiJiangMethod

    with pytest.raises(TypeError, match="windw"):
        DiJiangMethod(4, 2, 8, windw=64)


def test_spectraformer_refuses_a_feature_count_it_would_not_use():
    """n_features=37 was dropped silently (head_dim sets spectraformer's count); the saved records' own count
    still builds it."""
    m = build_method("spectraformer", 4, 2, 8)
    assert build_method("spectraformer", 4, 2, 8, n_features=m.n_features).n_features == m.n_features
    with pytest.raises(ValueError, match="^n_features: spectraformer has p \\+ 1 = 9 features"):
        build_method("spectraformer", 4, 2, 8, n_features=37)


@pytest.mark.parametrize("name", ["global", "spectraformer", "performer", "taylorshift", "oal-swa"])
def test_a_saved_method_reloads_with_its_recorded_settings(tmp_path, name):
    """What a converted folder records (global's n_groups, spectraformer's n_features) still rebuilds the method
    now that a constructor takes no setting it does not name."""
    model = tiny_model("qwen2", 64)
    methods = {1: build_method(name, 6, 2, 8, layer_idx=1, seed=5)}
    with torch.no_grad():
        for p in methods[1].parameters():
            p.add_(0.25)
    oal.convert(model, [1], methods).save_pretrained(tmp_path / "m")
    again = oal.models.attention.converted_methods(oal.load(tmp_path / "m"))[1]
    want = methods[1].state_dict()
    assert type(again) is type(methods[1]) and all(torch.equal(v, want[k]) for k, v in again.state_dict().items())


def test_one_method_object_in_two_layers_is_refused():
    """{1: m, 2: m} converted both layers with one set of parameters: training one trained the other, and a save
    and reload split them into two."""
    model = tiny_model("qwen2", 64)
    m = build_method("global", 6, 2, 8)
    with pytest.raises(ValueError, match=r"^methods\[2\]: the same method object as layer 1's"):
        oal.convert(model, [1, 2], {1: m, 2: m})
    oal.convert(model, [1], {1: m})
    oal.convert(model, [1], {1: m})  # the same layer again: its own method, replaced by itself
    with pytest.raises(ValueError, match=r"^methods\[2\]: the same method object as layer 1's"):
        oal.convert(model, [2], {2: m})
    assert list(oal.models.attention.converted_methods(model)) == [1]


def test_a_peft_models_converted_layers_are_found():
    """converted_methods(oal.add_lora(model)) raised "expected an HF causal LM with `model.model.layers`", so
    kernel_parameters(peft_model), which the convert docs use after get_peft_model, did too."""
    from oal.models.attention import converted_methods, kernel_parameters

    model = oal.convert(tiny_model("qwen2", 64), [1, 2], "global")
    before = converted_methods(model)
    peft_model = oal.add_lora(model)
    found = converted_methods(peft_model)
    assert sorted(found) == [1, 2] and all(found[i] is before[i] for i in found)
    assert {id(p) for p in kernel_parameters(peft_model)} == {id(p) for m in before.values() for p in m.parameters()}


def test_save_kernels_refuses_a_peft_model(tmp_path):
    """Its tensors (LoRA's included) are no base model's, so oal.load would refuse what it wrote."""
    peft_model = oal.add_lora(oal.convert(tiny_model("qwen2", 64), [1], "global"))
    with pytest.raises(ValueError, match="^model_or_methods: it carries LoRA"):
        oal.save_kernels(peft_model, tmp_path / "k")


# --------------------------------------------------------------------------------------------- oal.linearize

def test_linearize_names_the_weight_that_holds_a_nan(tmp_path):
    """A NaN in layer 2's weights failed after the analysis's capture as "q, k: non-finite values" (or in the
    calibration as "v: non-finite values ... captured attention tensors"), naming no layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = save_tiny_llama(tmp_path / "base")
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^model: NaN or inf in model\.layers\.2\.self_attn\.v_proj\.weight;"):
        oal.linearize(model, tok, ["a few words " * 2000], layers=[1, 2], calib={"preset": "tiny"}, progress=False)


def test_convert_takes_a_dict_of_methods_given_as_layers():
    """convert(model, {1: m}) kept the dict's keys as the layers and converted layer 1 with a fresh, uncalibrated
    OAL method: `m` (calibrated, say) was dropped without a word."""
    model = tiny_model("qwen2", 64)
    m = build_method("global", 6, 2, 8)
    oal.convert(model, {1: m})
    assert oal.models.attention.converted_methods(model) == {1: m}
    for extra in ({"methods": "swa"}, {"method": "swa"}, {"eps": 1e-3}):
        with pytest.raises(ValueError, match=r"^layers: got a dict; a dict layer index -> AttentionMethod goes in"):
            oal.convert(model, {2: build_method("global", 6, 2, 8)}, **extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_a_cuda_device_without_a_gpu_is_refused_with_advice_for_python_too():
    """`oal.load(..., device="cuda")` on a CPU-only torch advised `--device cpu`, an option a Python caller has not."""
    from oal.device import resolve_device

    with pytest.raises(ValueError, match=r"^device: 'cuda' requested .*; use 'cpu' or 'auto' \(on the command line: "):
        resolve_device("cuda")
