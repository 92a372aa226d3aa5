"""`tokenizer.ggml.pre` is identified as llama.cpp's converter identifies it, never guessed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import assert_one_error, run_cli

from lmfoundry.errors import UserError
from lmfoundry.export.gguf_pretokenizer import check_text_hash, tokenizer_pre


@pytest.fixture(scope="module")
def smollm_tokenizer(tmp_path_factory) -> Path:
    from lmfoundry.checkpoint.sources import resolve_model

    smol = resolve_model("smollm2-135m")
    folder = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / name).is_file():
            shutil.copy(smol / name, folder / name)
    return folder


def test_smollm2_is_identified_as_smollm(smollm_tokenizer: Path) -> None:
    assert tokenizer_pre(smollm_tokenizer, None) == "smollm"
    assert tokenizer_pre(smollm_tokenizer, "smollm") == "smollm"


def test_a_contradicting_name_is_refused(smollm_tokenizer: Path) -> None:
    with pytest.raises(UserError, match="--tokenizer-pre qwen2 contradicts the tokenizer, which llama.cpp "
                                        "identifies as smollm"):
        tokenizer_pre(smollm_tokenizer, "qwen2")


def with_prefix_space(src: Path, dst: Path) -> Path:
    """SmolLM2's tokenizer with a space put before the text (GPT-2's add_prefix_space): still BPE,
    but it gives other ids on llama.cpp's check text, so its hash is in no table."""
    dst.mkdir()
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["pre_tokenizer"]["type"] == "ByteLevel"
    spec["pre_tokenizer"]["add_prefix_space"] = True
    (dst / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return dst


def test_an_unknown_bpe_tokenizer_is_refused_unless_named(smollm_tokenizer: Path, tmp_path: Path) -> None:
    folder = with_prefix_space(smollm_tokenizer, tmp_path / "tok")
    digest = check_text_hash(folder)
    assert digest != check_text_hash(smollm_tokenizer)
    with pytest.raises(UserError, match=f"unknown BPE pre-tokenizer \\(llama.cpp check-text sha256 {digest}\\); "
                                        "pass --tokenizer-pre"):
        tokenizer_pre(folder, None)
    assert tokenizer_pre(folder, "gpt-2") == "gpt-2"  # the user's name, for a tokenizer the table lacks


def test_a_sentencepiece_style_tokenizer_is_refused(smollm_tokenizer: Path, tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    spec = json.loads((smollm_tokenizer / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["byte_fallback"] = True
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(UserError, match="SentencePiece-style tokenizer"):
        tokenizer_pre(tmp_path / "tok", "llama-bpe")


def test_export_cli_refuses_an_unknown_tokenizer_in_one_line(smollm_tokenizer: Path, tmp_path: Path,
                                                             capsys) -> None:
    """Through the verb, before any file is written."""
    from helpers import tiny_model_folder

    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.recipe import Recipe

    src = tiny_model_folder(tmp_path / "src", "llama", vocab_size=49152)
    for f in with_prefix_space(smollm_tokenizer, tmp_path / "tok").iterdir():
        shutil.copy(f, src / f.name)
    run_job(QuantizeJob(str(src), tmp_path / "q", Recipe().with_overrides(method="rtn", scheme="w4a16",
                                                                          group_size=32), progress=False))
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(["export", str(tmp_path / "q"), "-o", str(out), "--quiet"], capsys)
    assert_one_error(code, err, "unknown BPE pre-tokenizer", "--tokenizer-pre")
    assert not out.exists() and not list(tmp_path.glob(".m.gguf*"))
