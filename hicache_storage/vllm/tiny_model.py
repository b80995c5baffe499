"""A small random-weight Llama written to a local directory, for vLLM to serve without downloads.

The tests and ``hicache-storage bench --engine vllm`` make one at run time. Its weights are
random (seeded), scaled so that greedy decoding does not settle on one token; vLLM serves it with
``skip_tokenizer_init=True`` and token-id prompts, so no tokenizer is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 512
    max_positions: int = 8192
    seed: int = 0


def make_tiny_llama(directory: str | Path, shape: TinyLlama = TinyLlama()) -> Path:
    """Write ``shape``'s model (config.json, model.safetensors) into ``directory``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(shape.seed)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).bfloat16().save_pretrained(directory)
    return directory
