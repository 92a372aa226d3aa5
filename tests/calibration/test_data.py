import json

import pytest
import torch
from helpers import tiny_tokenizer, write_text

from lmfoundry.calibration.data import load_calibration
from lmfoundry.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_text_file_deterministic(tmp_path, tok):
    f = write_text(tmp_path / "a.txt")
    a = load_calibration(str(f), tok, 4, 32, seed=0)
    b = load_calibration(str(f), tok, 4, 32, seed=0)
    c = load_calibration(str(f), tok, 4, 32, seed=1)
    assert a.token_ids.shape == (4, 32) and torch.equal(a.token_ids, b.token_ids)
    assert a.token_sha256 == b.token_sha256 != c.token_sha256
    assert a.describe()["source_sha256"] == b.describe()["source_sha256"]


def test_jsonl_text_and_messages(tmp_path, tok):
    f = tmp_path / "d.jsonl"
    rows = [{"text": "the model is quantized " * 20},
            {"messages": [{"role": "user", "content": "hello " * 20}, {"role": "assistant", "content": "hi " * 20}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    cal = load_calibration(str(f), tok, 2, 16, seed=0)
    assert cal.token_ids.shape == (2, 16)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    with pytest.raises(UserError, match="needs a `text` string"):
        load_calibration(str(bad), tok, 2, 16, seed=0)


def test_datasets_folder(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["cache block group value " * 30] * 3})
    ds.save_to_disk(str(tmp_path / "ds"))
    cal = load_calibration(str(tmp_path / "ds"), tok, 3, 24, seed=0)
    assert cal.token_ids.shape == (3, 24)


@pytest.mark.parametrize("content", ["", "   \n\n"])
def test_empty_file_refused(tmp_path, tok, content):
    f = tmp_path / "empty.txt"
    f.write_text(content)
    with pytest.raises(UserError, match="empty"):
        load_calibration(str(f), tok, 2, 16, seed=0)


def test_too_short(tmp_path, tok):
    f = tmp_path / "short.txt"
    f.write_text("abc")
    with pytest.raises(UserError, match="fewer than --seq-len"):
        load_calibration(str(f), tok, 2, 64, seed=0)
