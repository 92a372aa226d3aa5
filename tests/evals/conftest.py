"""A tiny random Llama checkpoint (HF folder: config, safetensors, byte-level BPE tokenizer) that
both our loader and lm-eval's `hf` backend can load, built once per test session in a few seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: What do plants need to grow?\nAnswer: water and light",
    "A model that is quantized must still answer the same questions.",
    "Perplexity is the exponential of the mean negative log-likelihood per token.",
    "Paired statistics compare two models on the same documents.",
] * 4


def build_tiny_model(folder: Path, seed: int = 0) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=320, min_frequency=1, special_tokens=["<s>", "</s>"],
                            show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      initializer_range=0.3, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
