"""Folders a user did not make (a colleague's export, a downloaded run directory): whatever they hold, oal reads
nothing outside them, imports nothing, allocates nothing a file could not justify, and fails with one ValueError
that names the file. Each hostile folder here is written the way its author would: edited, then its hashes and
bindings recomputed (`write_manifest`, `save_kernels`' header), so only the checks under test can refuse it."""

import json
import os
import shutil
import threading

import pytest
import torch
from _runs import make_run
from _tiny import save_tiny_llama
from safetensors.torch import load_file

import oal
from oal.artefact.arms import load_converted
from oal.artefact.export import export
from oal.calibration.kernels import kernel_dir, load_kernels
from oal.errors import InputError
from oal.models.pretrained import MANIFEST, write_manifest
from oal.rundir.claim import claim_run_dir, multi_seed_layout
from oal.rundir.files import atomic_save_safetensors, load_json
from oal.rundir.hashes import record_header, sha256_file
from oal.rundir.metrics import record_evaluation, verified_evaluations
from oal.rundir.stages import StageLog

HUGE = 10**6  # sizes whose construction would ask for terabytes: the old code tried to allocate them


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def run_dir(base_dir, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("r"), base_dir, {"oal": True})


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    return export(run_dir, "oal", tmp_path_factory.mktemp("x") / "oal")


@pytest.fixture
def folder(exported, tmp_path):
    """A private copy of the export (tests make it hostile)."""
    return shutil.copytree(exported, tmp_path / "export")


@pytest.fixture
def run(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / "run")


def _edit_config(folder, edit):
    """Change config.json and record the new hashes, as the folder's author could."""
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_manifest(folder, json.loads((folder / MANIFEST).read_text())["source"])


def _layer(cfg):
    return cfg["oal"]["layers"]["1"]


# ----------------------------------------------------------------------------------------------- exported folders


@pytest.mark.parametrize("edit, needle", [
    (lambda c: _layer(c)["init"].update(n_groups=HUGE), "would allocate"),
    (lambda c: _layer(c).update(n_heads=-4), "built for (Hq, Hkv, d) = (-4, 2, 8)"),
    (lambda c: (c.update(num_attention_heads=HUGE, num_key_value_heads=2, head_dim=HUGE),
                [v.update(n_heads=HUGE, head_dim=HUGE) for v in c["oal"]["layers"].values()]), "would allocate"),
    (lambda c: _layer(c)["init"].update(eps=float("nan")), "eps is nan"),
    (lambda c: _layer(c)["init"].update(dtype="load"), "dtype must be one of"),
    (lambda c: c["oal"]["layers"].update({"7": _layer(c)}), "layers 0..2"),
], ids=["n_groups", "negative_heads", "model_shape", "nan_eps", "dtype_name", "layer_index"])
def test_export_config_sizes_checked_before_building(folder, edit, needle):
    _edit_config(folder, edit)
    with pytest.raises(ValueError, match="config.json: config.oal") as info:
        oal.load(folder)
    assert needle in str(info.value)


@pytest.mark.parametrize("edit, needle", [
    ({"hidden_size": -32}, "cannot load the converted model (RuntimeError: "),  # transformers: a RuntimeError
    ({"num_hidden_layers": "3"}, "config.json: StrictDataclassFieldValidationError: "),  # several lines
], ids=["negative_size", "wrong_type"])
def test_export_config_transformers_refuses_is_one_line(folder, edit, needle):
    _edit_config(folder, lambda c: c.update(edit))
    with pytest.raises(ValueError) as info:
        oal.load(folder)
    assert str(info.value).startswith(str(folder)) and needle in str(info.value) and "\n" not in str(info.value)


def test_export_config_with_more_layers_than_weights_is_refused_before_building(folder, base_dir, tmp_path):
    """num_hidden_layers 3 -> 40: transformers allocated and initialised 37 layers before the weights were found
    not to fit (the size bounded by the config alone); the headers of the weights are read first now."""
    _edit_config(folder, lambda c: c.update(num_hidden_layers=40))
    with pytest.raises(ValueError, match="num_hidden_layers is 40, but its weights hold 3 layers") as info:
        oal.load(folder)
    assert str(info.value).startswith(str(folder / "config.json"))
    # a base model folder as well (`--model DIR`)
    from oal.models.registry import load_model

    base = shutil.copytree(base_dir, tmp_path / "base")
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 40}))
    with pytest.raises(InputError, match="num_hidden_layers is 40, but its weights hold 3 layers"):
        load_model(str(base))


@pytest.mark.parametrize("name", ["tok\x00enizer.json", "tokenizer.json\n"])
def test_manifest_name_with_nul_or_newline_names_the_manifest(folder, name):
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["sha256"][name] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"{MANIFEST}: file name .* is not a plain relative path"):
        oal.load(folder)


def test_export_link_out_of_the_folder_is_refused(folder, tmp_path):
    # generation_config.json is not hashed (a routine edit), yet transformers reads it: through a link, from anywhere
    outside = tmp_path / "elsewhere.json"
    outside.write_text((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to(outside)
    with pytest.raises(ValueError, match="generation_config.json: a symbolic link to .*, outside"):
        oal.load(folder)


# ----------------------------------------------------------------------------------------------- run directories


def _rebind_kernels(kdir, edit_meta=None, edit_tensors=None):
    """Edit kernels.json / kernels.safetensors and bind them to each other again, as save_kernels does."""
    meta = json.loads((kdir / "kernels.json").read_text())
    meta.pop("sha256")
    tensors = load_file(str(kdir / "kernels.safetensors"))
    (edit_meta or (lambda m: None))(meta)
    (edit_tensors or (lambda t: None))(tensors)
    atomic_save_safetensors(kdir / "kernels.safetensors", tensors, metadata=record_header(meta))
    meta["sha256"] = {"kernels.safetensors": sha256_file(kdir / "kernels.safetensors")}
    (kdir / "kernels.json").write_text(json.dumps(meta))


def _huge_group_id(tensors):
    tensors["layers.1.groups"][0, 0] = HUGE  # OAL builds a factor for its largest id: [Hq, HUGE + 1, HUGE + 1]


@pytest.mark.parametrize("edit_meta, edit_tensors, needle", [
    (None, _huge_group_id, "would allocate"),
    (lambda m: m["layers"]["1"]["init"].update(n_groups=HUGE), None, "would allocate"),
    (lambda m: m["layers"]["1"].update(n_heads=-4), None, "built for (Hq, Hkv, d)"),
    (lambda m: m["layers"]["1"]["init"].update(eps=float("inf")), None, "eps is inf"),
], ids=["group_id", "n_groups", "negative_heads", "inf_eps"])
def test_run_kernels_sizes_checked_before_building(run, edit_meta, edit_tensors, needle):
    _rebind_kernels(run, edit_meta, edit_tensors)
    with pytest.raises(ValueError, match="kernels.json: ") as info:
        load_converted(run, "oal")
    assert needle in str(info.value)


def test_run_kernels_sizes_checked_where_a_run_resumes(run):
    """`oal run`'s resume and `oal evaluate` read kernels with no model at hand: the file's own fingerprint bounds
    them (a group id of HUGE asked for a factor of HUGE^2 per head)."""
    _rebind_kernels(run, None, _huge_group_id)
    with pytest.raises(ValueError, match="kernels.json: .*would allocate"):
        load_kernels(kernel_dir(run, "oal"))


def test_method_name_stays_in_the_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "elsewhere")  # kernels/../../elsewhere: a run's config.json names the methods
    (run / "kernels").mkdir()  # (as a run with other methods has it)
    with pytest.raises(InputError, match="is not a method name"):
        load_converted(run, "../../elsewhere")


def test_run_link_out_of_the_directory_is_refused(run, tmp_path):
    moved = shutil.move(run / "adapter" / "oal", tmp_path / "adapter_elsewhere")
    (run / "adapter" / "oal").symlink_to(moved)
    with pytest.raises(InputError, match="adapter/oal is a symbolic link to .*, outside"):
        load_converted(run, "oal")


def test_run_config_changed_since_setup_is_refused(run):
    (run / "config.json").write_text(json.dumps({"config": {"dtype": "float32"}}))
    StageLog(run).mark("setup", "k", 0.0, outputs=["config.json"])
    load_converted(run, "oal", adapter=False)  # as recorded: loads
    (run / "config.json").write_text(json.dumps({"config": {"dtype": "float64"}}))  # unrecorded: fp64 numerics
    with pytest.raises(ValueError, match="config.json: changed since `oal run` wrote it"):
        load_converted(run, "oal", adapter=False)


@pytest.mark.parametrize("record, needle", [
    ({"outputs": 5}, "'outputs' must be a list"),
    ({"outputs": ["a\x00b"]}, "a path outside the run directory"),
    ({"outputs": [], "inputs": ["config.json"]}, "'inputs' must be a JSON object"),
])
def test_stage_records_of_the_wrong_shape(tmp_path, record, needle):
    (tmp_path / ".oal").mkdir()
    (tmp_path / ".oal" / "stages.json").write_text(json.dumps({"setup": {"key": "k", **record}}))
    with pytest.raises(ValueError, match="stages.json: ") as info:
        StageLog(tmp_path)
    assert needle in str(info.value)


def test_verified_evaluation_of_the_wrong_shape(tmp_path):
    record_evaluation(tmp_path, "fidelity", [(("fidelity", "oal"), {"mse": 1.0})], {})
    value = tmp_path / ".oal" / "evaluate" / "fidelity.json"
    value.write_text(json.dumps([1, 2]))  # and its record updated: it verifies
    records = json.loads((tmp_path / ".oal" / "evaluations.json").read_text())
    records["fidelity"]["sha256"][".oal/evaluate/fidelity.json"] = sha256_file(value)
    (tmp_path / ".oal" / "evaluations.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match="fidelity.json: damaged"):
        verified_evaluations(tmp_path)
    records["fidelity"]["seq"] = "first"
    (tmp_path / ".oal" / "evaluations.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match="evaluations.json: damaged, a record's 'seq'"):
        verified_evaluations(tmp_path)


def test_run_config_of_the_wrong_shape_is_refused_not_a_crash(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"config": {}, "model": [1]}))
    with pytest.raises(InputError, match="another configuration"):
        claim_run_dir(tmp_path, {"config": {}, "model": {"state_dict_sha256": "ab12"}})
    (tmp_path / "config.json").write_text(json.dumps({"config": {}, "seeds": 5}))
    with pytest.raises(InputError, match="'seeds' must be a list"):
        multi_seed_layout(tmp_path, [0, 1])


# ----------------------------------------------------------------------------------------------- JSON records


def test_json_nested_too_deep_or_too_large(tmp_path, monkeypatch):
    from oal.rundir import files

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep.json: damaged, JSON nested too deeply"):
        load_json(deep)
    monkeypatch.setattr(files, "MAX_JSON_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(list(range(1000))))
    with pytest.raises(ValueError, match=r"big.json: \d+ bytes, larger than any JSON record"):
        load_json(big)


def test_json_that_is_a_fifo_is_refused_unread(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    # a writer, so that an old reader returns rather than blocks forever; released below when nothing read it
    def write():
        try:
            fifo.write_text("{}")
        except BrokenPipeError:  # an old reader that closed early
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        with pytest.raises(ValueError, match="config.json: not a regular file"):
            load_json(fifo)
    finally:  # a reader held open until the writer is done (it may not have opened its end yet)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(fd)


def test_untouched_folders_still_load(exported, run_dir):
    assert torch.is_tensor(next(oal.load(exported).parameters()))
    assert load_converted(run_dir, "oal")[2]["adapter"]
