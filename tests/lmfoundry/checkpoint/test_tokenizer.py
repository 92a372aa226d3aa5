"""A checkpoint's tokenizer: a folder naming transformers' generic backend loads that class
directly (without AutoTokenizer's model-config import chain) and gets the tokenizer AutoTokenizer
would have built; every other folder goes through AutoTokenizer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmfoundry.checkpoint.tokenizer import _generic_backend, load_tokenizer
from tests.helpers import tiny_model_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("tok") / "m")


def _edit(folder: Path, name: str, **changes) -> None:
    data = json.loads((folder / name).read_text())
    data.update(changes)
    (folder / name).write_text(json.dumps(data))


def test_the_generic_backend_is_the_tokenizer_autotokenizer_builds(folder) -> None:
    from transformers import AutoTokenizer

    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert _generic_backend(folder) is not None
    ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    text = "Hello, world! 123 <s> tabs\tand\nnew lines"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert ours.all_special_ids == auto.all_special_ids and len(ours) == len(auto)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("case", ["remote code", "other class", "model type with a wrong hub class",
                                  "no config", "config not an object"])
def test_every_other_folder_is_left_to_autotokenizer(case, folder, tmp_path) -> None:
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "m"))
    if case == "remote code":
        _edit(copy, "tokenizer_config.json", auto_map={"AutoTokenizer": ["x.Tok", None]})
    elif case == "other class":
        _edit(copy, "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    elif case == "model type with a wrong hub class":
        from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

        _edit(copy, "config.json", model_type=sorted(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)[0])
    elif case == "no config":
        (copy / "config.json").unlink()
    else:
        (copy / "config.json").write_text("[1, 2]")
    assert _generic_backend(copy) is None


def test_loading_it_beside_torch_skips_the_model_config_chain(folder) -> None:
    """In a serving engine (torch imported), AutoTokenizer's config lookup imported transformers'
    model configuration modules, torch.distributed.tensor and sympy: tens of MiB held for nothing."""
    code = ("import sys, torch\nfrom lmfoundry.checkpoint.tokenizer import load_tokenizer\n"
            f"load_tokenizer({str(folder)!r})\n"
            "print(sorted(m for m in ('sympy', 'torch.distributed.tensor', 'transformers.models.llama') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
