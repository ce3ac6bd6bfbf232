"""A converted model used as a demanding Hugging Face user would (a helper's audit, 2026-12-07): what it found wrong,
each now right or refused with one line. What it found right is covered by test_hf_usage, test_interop, test_decode
and test_export."""

from __future__ import annotations

import pytest
import torch
from test_hf_usage import _converted, _ids
from transformers import AutoModelForCausalLM

import oal
from oal.artefact.export import save_converted


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize("merged", [True, False])
def test_a_folder_in_a_subfolder_loads_with_subfolder(tmp_path, merged):
    """from_pretrained(REPO, subfolder="converted"), as for any model kept beside others in one repo: the manifest
    was looked for in REPO itself ("REPO/oal.json: missing"), and the folder did not load."""
    model, ids = _converted(), _ids()
    if merged:
        want = _logits(model, ids)
        model.save_pretrained(tmp_path / "repo" / "converted")
    else:
        base = _logits(model, ids)
        model = oal.add_lora(model, dropout=0.0)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a LoRA that changes the logits
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
        want = _logits(model, ids)
        assert not torch.allclose(want, base)
        save_converted(model, tmp_path / "repo" / "converted")  # `oal export --no-merge`'s writer
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="converted")
    torch.testing.assert_close(_logits(got, ids), want)
    (tmp_path / "repo" / "converted" / "pytorch_model.bin").write_bytes(b"")  # the folder's own manifest is checked
    with pytest.raises(ValueError, match=r"converted/pytorch_model.bin: not recorded in oal.json"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder="converted")


def _hub_snapshot(folder, cache):
    """`folder` laid out as the hub's download cache holds a repo: snapshots/<revision>/NAME -> ../../blobs/<hash>."""
    import hashlib
    import os

    repo = cache / "models--me--converted"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(f.read_bytes())
        os.symlink(f"../../blobs/{digest}", snapshot / f.name)
    return snapshot


def test_a_snapshot_of_the_hub_cache_loads_and_is_checked(tmp_path):
    """from_pretrained(snapshot_download(ID)), the hub cache's own folder: its files are links to the repo's blobs,
    and every one was refused as leading outside the folder, while from_pretrained(ID) loaded unchecked."""
    import os

    model, ids = _converted(), _ids()
    model.save_pretrained(tmp_path / "saved")
    snapshot = _hub_snapshot(tmp_path / "saved", tmp_path / "hub")
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(snapshot), ids), _logits(model, ids))
    torch.testing.assert_close(_logits(oal.load(snapshot), ids), _logits(model, ids))
    blob, text = (snapshot / "config.json").resolve(), (snapshot / "config.json").read_text()
    blob.write_text(text + " ")
    with pytest.raises(ValueError, match=r"config.json: SHA256 does not match oal.json"):  # still checked
        AutoModelForCausalLM.from_pretrained(snapshot)
    blob.write_text(text)
    os.symlink(tmp_path / "saved" / "config.json", snapshot / "notes.txt")  # a link out of the repo's blobs
    with pytest.raises(ValueError, match=r"notes.txt: a symbolic link to .*, outside"):
        AutoModelForCausalLM.from_pretrained(snapshot)
