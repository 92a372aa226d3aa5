"""The built-in model names: a near miss is one error line that lists every built-in name."""

from __future__ import annotations

import pytest

from lmfoundry.checkpoint.sources import resolve_model
from lmfoundry.errors import UserError


@pytest.mark.parametrize("typo", ["qwen2.5-coder-05b", "gemma3-27m", "smollm2-135"])
def test_a_misspelt_builtin_lists_the_builtins(typo, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as exc:
        resolve_model(typo)
    assert str(exc.value) == (f"{typo}: no such file or folder "
                              "(built-in models: smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m)")
