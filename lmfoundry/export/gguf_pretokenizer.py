"""Which llama.cpp pre-tokenizer a checkpoint's BPE tokenizer needs (GGUF `tokenizer.ggml.pre`).

llama.cpp does not run tokenizer.json's pre-tokenizer: it splits text with a regex of its own,
chosen by the name in `tokenizer.ggml.pre` ("default" is GPT-2's split). A wrong name does not
fail; it feeds the model token sequences it was never trained on (a Qwen2 tokenizer written as
"default" splits digits and CJK text differently), so the name is derived here rather than guessed.

The identification is llama.cpp's own (convert_hf_to_gguf.py, `get_vocab_base_pre`): encode a
fixed check text with the tokenizer, as transformers does by default, and take the sha256 of the
id list's Python text; a hash llama.cpp recorded for a model names its pre-tokenizer. The text and
the hashes below are llama.cpp's, limited to the BPE families this project serves (Llama 3,
SmolLM/SmolLM2, Qwen 1.5-3). SentencePiece tokenizers (Llama 2, Mistral 7B, Phi-3, Gemma) need no
pre-tokenizer name, but llama.cpp reads them as its `llama` vocabulary with scores, which this
export does not write: they are refused rather than written as a BPE vocabulary.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

from lmfoundry.errors import UserError

# llama.cpp's `chktxt`, character for character
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256 of str(ids of CHECK_TEXT) -> llama.cpp's pre-tokenizer name (the model llama.cpp recorded it from)
KNOWN_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5-7B (Qwen2, 2.5)
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3-Embedding-0.6B
}


def check_text_hash(folder: Path) -> str:
    """llama.cpp's identifying hash of the folder's tokenizer."""
    from lmfoundry.checkpoint.tokenizer import load_tokenizer

    ids = load_tokenizer(folder).encode(CHECK_TEXT)
    return sha256(str(list(ids)).encode()).hexdigest()


def _sentencepiece_style(model: dict, spec: dict) -> bool:
    """A tokenizer.json that encodes SentencePiece's way: bytes the vocabulary lacks fall back to
    <0xNN> tokens, or words are marked with ▁ (a Metaspace step) instead of GPT-2's byte map."""
    steps = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer"), spec.get("decoder")])
    return bool(model.get("byte_fallback")) or "Metaspace" in steps or "\u2581" in steps


def tokenizer_pre(folder: Path, requested: str | None) -> str:
    """The `tokenizer.ggml.pre` to write for the tokenizer in `folder`.

    Without `requested`, the detected name, or a one-line refusal naming `--tokenizer-pre` and the
    hash when the tokenizer is not one llama.cpp's table (as kept here) knows. An explicit name is
    used as given for an unknown tokenizer (the user may know a name this table lacks), but one
    that contradicts a detected name is refused, not warned about: llama.cpp would apply it
    without complaint and every prompt would be split differently from the model's training, a
    loss nobody reads in a warning scrolled past; omitting the option gives the right name."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder}: no tokenizer.json (GGUF export embeds a BPE tokenizer)")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not readable as JSON ({exc})") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise UserError(f"{path}: a {kind or 'non-BPE'} tokenizer; GGUF export embeds BPE tokenizers only")
    if _sentencepiece_style(model, spec):
        raise UserError(f"{path}: a SentencePiece-style tokenizer (byte fallback or ▁ word marks), which llama.cpp "
                        "reads as its `llama` vocabulary with scores; this export writes BPE vocabularies only")
    digest = check_text_hash(folder)
    detected = KNOWN_PRE_TOKENIZERS.get(digest)
    if requested is None:
        if detected is None:
            raise UserError(f"{folder}: unknown BPE pre-tokenizer (llama.cpp check-text sha256 {digest}); pass "
                            f"--tokenizer-pre with llama.cpp's name for it (one of llama.cpp's known names, e.g. "
                            f"{', '.join(sorted(set(KNOWN_PRE_TOKENIZERS.values())))})")
        return detected
    if detected is not None and requested != detected:
        raise UserError(f"--tokenizer-pre {requested} contradicts the tokenizer, which llama.cpp identifies as "
                        f"{detected} (check-text sha256 {digest[:16]}); omit the option or pass {detected}")
    return requested
