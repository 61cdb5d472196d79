"""Builds a tiny random-weight Llama in Hugging Face layout, offline, for vLLM to serve in tests.

Run with the vLLM venv's Python (it needs ``torch``, ``transformers`` and ``tokenizers``, which the
proxy's own environment does not have): ``python -m bench.backends.vllm_model DIR``. The weights are
random, so the text is noise, but a seeded sample is the same on every run: that is all the
native-n comparison needs.
"""

from __future__ import annotations

import sys
from pathlib import Path

HIDDEN = 64
HEADS = 2  # head_dim 32: the smallest vLLM's CPU attention backend serves
LAYERS = 2
FFN = 128
MAX_POSITIONS = 1024
VOCAB = 512
SEED = 20261203
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
    "the quick brown fox jumps over the lazy dog; say something, hello world! 0123456789 "
)


def build(directory: Path) -> Path:
    """Writes config, weights and tokenizer to ``directory`` (skipped when already there)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([CORPUS] * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharper than the default init so samples are not flat noise, and a reachable EOS so
        # some choices finish with "stop" and others with "length".
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
