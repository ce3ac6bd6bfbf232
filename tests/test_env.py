"""oal's on/off switches in the environment are read one way (`oal.errors.env_flag`): OAL_CPU_KERNEL=false left the
kernel on, OAL_NO_TUNE=false turned tuning off, OAL_DEBUG=0 showed tracebacks."""

from __future__ import annotations

import pytest
import torch

from oal.errors import env_flag as flag
from oal.ops import cpu_kernel


@pytest.mark.parametrize("value, default, want", [
    (None, True, True), (None, False, False), ("", True, True), ("", False, False),
    ("0", True, False), ("false", True, False), ("No", True, False), (" OFF ", True, False),
    ("1", False, True), ("true", False, True), ("yes", False, True), ("2", False, True),
])
def test_a_switch_is_read_one_way(monkeypatch, value, default, want):
    if value is None:
        monkeypatch.delenv("OAL_X", raising=False)
    else:
        monkeypatch.setenv("OAL_X", value)
    assert flag("OAL_X", default) is want


def test_the_switches_read_it(monkeypatch):
    from oal.lm_eval import show_traceback
    from oal.ops import tuning, workers

    monkeypatch.setenv("OAL_CPU_KERNEL", "false")
    monkeypatch.setenv("OAL_CPU_PIPELINE", "off")
    monkeypatch.setenv("OAL_DEBUG", "0")
    assert not cpu_kernel.enabled() and not workers.enabled() and not show_traceback()
    monkeypatch.setattr(tuning, "lookup", lambda dtype, threads: "the cached entry")
    for value, want in (("false", "the cached entry"), ("1", None)):
        monkeypatch.setenv("OAL_NO_TUNE", value)
        assert tuning.settings_for(torch.float32, 2) == want
