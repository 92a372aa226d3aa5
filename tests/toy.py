"""A tiny random Llama and a byte-level tokenizer with a chat template.

For tests and smoke runs that must exercise the whole runtime (engine, server, streaming, chat
template, UTF-8 split across tokens) in seconds, with nothing downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lmfoundry.model.config import ModelConfig
from lmfoundry.model.reference import CausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level BPE with no merges (one token per UTF-8 byte) plus ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def toy_config(**overrides: Any) -> ModelConfig:
    cfg = {
        "model_type": "llama",
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>"),
        "bos_token_id": None,
    }
    cfg.update(overrides)
    return ModelConfig.from_dict(cfg)


def save_toy_checkpoint(folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a toy model (config `overrides` make it larger) and its tokenizer as a Hugging Face
    folder (config.json, safetensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = toy_model(seed, **overrides)
    raw = dict(model.config.raw, architectures=["LlamaForCausalLM"], torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    byte_tokenizer().save_pretrained(str(folder))
    return folder


def toy_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> CausalLM:
    """A random CausalLM with weights large enough that its next-token choices are not near ties."""
    torch.manual_seed(seed)
    model = CausalLM(toy_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "lm_head" in name else 0.15)
    return model.to(dtype).eval()


def toy_engine(seed: int = 0, step_delay: float = 0.0, **config: Any) -> Any:
    """An LLMEngine over `toy_model(seed)` and the byte tokenizer with `EngineConfig(**config)`;
    `step_delay` seconds are added to every step (tests whose requests must outlive a deadline).
    Module-level, so an `EngineSpec` can name it for an engine process."""
    import time

    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine(toy_model(seed), byte_tokenizer(), EngineConfig(**config))
    if step_delay:
        step = engine.step

        def slow_step() -> Any:
            time.sleep(step_delay)
            return step()

        engine.step = slow_step  # type: ignore[method-assign]
    return engine
