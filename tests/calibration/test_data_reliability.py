"""Issue 16, calibration part: calibration text is read bounded, refused when it is not text, and
user mistakes in it are one `UserError`, while sources below the read budget give exactly the
windows they always gave (checkpoints stay bit-identical for the same inputs).

| case | before | after | test |
|------|--------|-------|------|
| source larger than the read budget | read whole (a 100 GB file is read into memory) | first budget bytes, cut at a line end; `source_bytes_used` in the manifest | test_large_source_is_read_only_up_to_the_budget |
| saved dataset larger than the budget | every row rendered | rows stop at the budget | test_large_dataset_stops_at_the_budget |
| source below the budget (every built-in text) | whole file | whole file, same windows and hash as a reference computed from the whole file | test_small_source_is_read_whole_and_unchanged (regression guard) |
| chat template raising on a record | jinja TemplateError traceback | UserError with file:line | test_chat_template_error_is_a_user_error |
| seed outside 0..2**64-1 through the API | ValueError from torch | UserError | test_seed_out_of_range_is_a_user_error |
| valid UTF-8 that is binary (control characters) | calibrated on it | UserError | test_control_character_junk_is_refused |
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from helpers import tiny_tokenizer

from lmfoundry.calibration import data
from lmfoundry.calibration.data import load_calibration, tokenize_stream
from lmfoundry.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _lines(n: int) -> str:
    return "".join(f"line {i} the model layer weight scale token cache\n" for i in range(n))


def test_large_source_is_read_only_up_to_the_budget(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(data, "MIN_READ_BYTES", 4096)
    monkeypatch.setattr(data, "MAX_READ_BYTES", 8192)
    f = tmp_path / "big.txt"
    text = _lines(5000)  # ~250 KB
    f.write_text(text)
    cal = load_calibration(str(f), tok, 2, 16, seed=0)
    used = cal.describe()["source_bytes_used"]
    assert 0 < used <= 4096 and text.encode()[:used].endswith(b"\n")
    assert cal.describe()["source_sha256"] == hashlib.sha256(text.encode()[:used]).hexdigest()
    # every window comes from the prefix that was read
    prefix = tokenize_stream([text[:used]], tok)
    for row in cal.token_ids:
        assert any(torch.equal(prefix[s:s + 16], row) for s in range(prefix.numel() - 15))
    # a bigger request reads more, up to the cap
    assert 4096 < load_calibration(str(f), tok, 64, 16, seed=0).describe()["source_bytes_used"] <= 8192


def test_large_dataset_stops_at_the_budget(tmp_path, tok, monkeypatch):
    import datasets

    monkeypatch.setattr(data, "MIN_READ_BYTES", 2000)
    monkeypatch.setattr(data, "MAX_READ_BYTES", 2000)
    rows = [f"row {i} " + "cache block group value " * 4 for i in range(500)]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    cal = load_calibration(str(tmp_path / "ds"), tok, 2, 16, seed=0)
    assert 0 < cal.describe()["source_bytes_used"] <= 2000


def test_small_source_is_read_whole_and_unchanged(tmp_path, tok):
    """Below the budget nothing changes: windows, source hash and manifest keys are those of the
    whole file (the reference below is the sampling as it always was)."""
    f = tmp_path / "small.txt"
    f.write_text(_lines(400))
    cal = load_calibration(str(f), tok, 4, 32, seed=7)
    stream = tokenize_stream([f.read_text()], tok)
    gen = torch.Generator().manual_seed(7)
    starts = torch.randint(0, stream.numel() - 32 + 1, (4,), generator=gen)
    assert torch.equal(cal.token_ids, torch.stack([stream[s:s + 32] for s in starts.tolist()]))
    assert cal.describe()["source_sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert "source_bytes_used" not in cal.describe()
    assert data.read_budget(128, 512) >= data.MIN_READ_BYTES > 300_000  # the c4 text is ~330 KB


def test_chat_template_error_is_a_user_error(tmp_path):
    tok = tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                         "{% endif %}{{ m['content'] }}\n{% endfor %}")
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"text": "the model " * 40}) + "\n"
                 + json.dumps({"messages": [{"role": "tool", "content": "x"}]}) + "\n")
    with pytest.raises(UserError, match=r"chat\.jsonl:2: the chat template failed.*no tools"):
        load_calibration(str(f), tok, 2, 16, seed=0)


@pytest.mark.parametrize("seed", [2**64, -1])
def test_seed_out_of_range_is_a_user_error(tmp_path, tok, seed):
    f = tmp_path / "a.txt"
    f.write_text(_lines(200))
    with pytest.raises(UserError, match="seed"):
        load_calibration(str(f), tok, 2, 16, seed=seed)


def test_control_character_junk_is_refused(tmp_path, tok):
    f = tmp_path / "junk.txt"
    f.write_bytes(bytes(range(1, 9)) * 5000 + b"some text\n")
    with pytest.raises(UserError, match="binary data"):
        load_calibration(str(f), tok, 2, 16, seed=0)
