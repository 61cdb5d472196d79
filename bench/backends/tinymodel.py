"""Builds a tiny random-weight llama GGUF so tests can run a real llama.cpp server offline.

The weights are shaped, not trained: every word piece gets a large output logit, so samples read
as whole words, and the EOS logit decides whether generations can end with ``"stop"``.
"""

from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX_TRAIN = 512
HEAD_DIM = N_EMBD // N_HEAD
SEED = 20240611

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

NATO = (
    "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
    "juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu",
)  # fmt: skip

# Dimension 0 of the residual stream is held near-constant (large in every embedding, tiny layer
# outputs), so column 0 of the output matrix acts as a per-token logit bias: the llama
# architecture has no output bias tensor. Small output noise keeps the word distribution flat
# enough that different seeds give different text.
BIAS_DIM = 0
WORD_BIAS = 1.0
BLOCKED_BIAS = -3.0
# Tuned by hand: with max_tokens=16 roughly 2 of 3 seeds end with "stop", the rest "length".
EOS_REACHABLE_BIAS = 1.35
OUTPUT_NOISE = 0.15
LAYER_OUT_SCALE = 0.005
IN_SCALE = 0.1


def _word_pieces(rng: np.random.Generator) -> list[str]:
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    words = list(NATO)
    seen = set(words)
    while len(words) < 320:
        a, b = rng.choice(len(syllables), size=2)
        word = syllables[a] + syllables[b]
        if word not in seen:
            seen.add(word)
            words.append(word)
    return ["\u2581" + w for w in words]


def _vocabulary(rng: np.random.Generator) -> tuple[list[str], list[int], list[float]]:
    """Returns (pieces, token types, scores) in SentencePiece order: specials, bytes, pieces."""
    pieces = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    # Single characters let the tokenizer spell any ASCII prompt without byte fallback.
    singles = ["\u2581", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]
    singles += list("|<>.,!?'\"-:;()[]{}/_=+*#@&%$")
    pieces += singles
    types += [gguf.TokenType.NORMAL] * len(singles)
    words = _word_pieces(rng)
    pieces += words
    types += [gguf.TokenType.NORMAL] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)]
    return pieces, [int(t) for t in types], scores


def _normal(rng: np.random.Generator, *shape: int, scale: float) -> npt.NDArray[np.float16]:
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def _output_bias(pieces: list[str], *, eos_reachable: bool) -> npt.NDArray[np.float32]:
    bias = np.full(len(pieces), BLOCKED_BIAS, dtype=np.float32)
    for i, piece in enumerate(pieces):
        if piece.startswith("\u2581") and len(piece) > 2:
            bias[i] = WORD_BIAS
    bias[EOS_ID] = EOS_REACHABLE_BIAS if eos_reachable else BLOCKED_BIAS
    return bias


def build_tiny_gguf(path: Path, *, eos_reachable: bool) -> Path:
    """Writes the model to ``path`` (byte-identical for the same flag) and returns ``path``."""
    rng = np.random.default_rng(SEED)
    pieces, types, scores = _vocabulary(rng)
    n_vocab = len(pieces)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("n-proxy tiny test model")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    embd = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32) * 0.02
    embd[:, BIAS_DIM] = 1.0
    writer.add_tensor("token_embd.weight", embd.astype(np.float16))

    ones = np.ones(N_EMBD, dtype=np.float32)
    n_kv = N_HEAD_KV * HEAD_DIM
    for i in range(N_LAYER):
        tensors: dict[str, npt.NDArray[np.generic]] = {
            "attn_norm": ones,
            "attn_q": _normal(rng, N_EMBD, N_EMBD, scale=IN_SCALE),
            "attn_k": _normal(rng, n_kv, N_EMBD, scale=IN_SCALE),
            "attn_v": _normal(rng, n_kv, N_EMBD, scale=IN_SCALE),
            "attn_output": _normal(rng, N_EMBD, N_EMBD, scale=LAYER_OUT_SCALE),
            "ffn_norm": ones,
            "ffn_gate": _normal(rng, N_FF, N_EMBD, scale=IN_SCALE),
            "ffn_up": _normal(rng, N_FF, N_EMBD, scale=IN_SCALE),
            "ffn_down": _normal(rng, N_EMBD, N_FF, scale=LAYER_OUT_SCALE),
        }
        for name, tensor in tensors.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor)

    writer.add_tensor("output_norm.weight", ones)
    out = rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32) * OUTPUT_NOISE
    out[:, BIAS_DIM] = _output_bias(pieces, eos_reachable=eos_reachable)
    writer.add_tensor("output.weight", out.astype(np.float16))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
