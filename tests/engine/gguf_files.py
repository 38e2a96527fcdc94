"""Small synthetic GGUF files, written with gguf's writer the way llama.cpp's converter writes
them: from a tiny random transformers model, Q/K rows permuted (llama, mistral), 2-D weights
in the chosen tensor type, norms in F32, a tokenizer in the metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. 12345 apples and 678 pears. "
    "Once upon a time, in a small village, there lived an old woman who loved the sea. "
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
) * 4

# Block types gguf can quantise itself; the K-quants it only dequantises are written as
# random blocks with sane scales.
QUANTISABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# where each K-quant block keeps its fp16 scale(s), and a scale giving weights of ~0.1-0.5
K_QUANT_SCALES = {"Q4_K": (0, 4, 5e-4), "Q5_K": (0, 4, 3e-4), "Q6_K": (208, 210, 5e-5)}


def byte_level_tokenizer(vocab_size: int = 320):
    """A GPT-2-style byte-level BPE trained on CORPUS, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS], trainer)
    return tokenizer


def sentencepiece_vocab(vocab_size: int = 320) -> tuple[list[str], list[float], list[int]]:
    """A llama-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces with scores
    (best first), as a SentencePiece BPE model lists them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 3 - 256, show_progress=False)
    tokenizer.train_from_iterator([CORPUS], trainer)
    pieces = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


def hf_model(kind: str, vocab_size: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    config = (
        Qwen2Config(**kwargs, tie_word_embeddings=True)
        if kind == "qwen2"
        else LlamaConfig(**kwargs, tie_word_embeddings=False)
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_gguf(
    path: Path, *, arch: str = "llama", tensor_type: str = "F32", tokenizer: str = "gpt2"
) -> Path:
    """Write a 2-layer model of ``arch`` whose 2-D weights are ``tensor_type``."""
    from gguf import GGMLQuantizationType, GGUFWriter

    if tokenizer == "gpt2":
        bpe = byte_level_tokenizer()
        by_id = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
        tokens = [token for token, _ in by_id]
        types = [3 if token in SPECIALS else 1 for token in tokens]
        merges = [" ".join(pair) for pair in _merges(bpe)]
    else:
        tokens, scores, types = sentencepiece_vocab()
    model = hf_model(arch, len(tokens))
    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        writer.add_token_scores(scores)
        writer.add_add_bos_token(True)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_chat_template(CHAT_TEMPLATE)
    kind = GGMLQuantizationType[tensor_type]
    rng = np.random.default_rng(0)
    for name, tensor in _gguf_tensors(model, arch):
        data = tensor.detach().float().numpy()
        if data.ndim == 1:
            writer.add_tensor(name, data.astype(np.float32))
        else:
            encoded = _encode(data, tensor_type, rng)
            writer.add_tensor(name, encoded, raw_dtype=None if tensor_type == "F32" else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(data: np.ndarray, tensor_type: str, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if tensor_type == "F32":
        return data.astype(np.float32)
    if tensor_type == "F16":
        return data.astype(np.float16)
    if tensor_type in ("BF16", *QUANTISABLE):
        return quants.quantize(data, GGMLQuantizationType[tensor_type])
    # Random K-quant blocks: quantised values and sub-block scales at random, the block's
    # fp16 scale(s) set so values land near the model's own magnitude.
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[tensor_type]]
    rows, cols = data.shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    start, end, value = K_QUANT_SCALES[tensor_type]
    scale = np.array([value], dtype=np.float16).view(np.uint8)
    raw[..., start:end] = np.tile(scale, (end - start) // 2)
    return raw.reshape(rows, -1)


def _gguf_tensors(model, arch: str):
    c = model.config
    yield "token_embd.weight", model.model.embed_tokens.weight
    yield "output_norm.weight", model.model.norm.weight
    if not c.tie_word_embeddings:
        yield "output.weight", model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if arch in ("llama", "mistral"):  # llama.cpp's converter does this for its rope
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        yield f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight
        yield f"blk.{i}.attn_q.weight", q
        yield f"blk.{i}.attn_k.weight", k
        yield f"blk.{i}.attn_v.weight", attn.v_proj.weight
        if attn.q_proj.bias is not None:
            yield f"blk.{i}.attn_q.bias", attn.q_proj.bias
            yield f"blk.{i}.attn_k.bias", attn.k_proj.bias
            yield f"blk.{i}.attn_v.bias", attn.v_proj.bias
        yield f"blk.{i}.attn_output.weight", attn.o_proj.weight
        yield f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight
        yield f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight
        yield f"blk.{i}.ffn_up.weight", mlp.up_proj.weight
        yield f"blk.{i}.ffn_down.weight", mlp.down_proj.weight


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _merges(tokenizer) -> list[tuple[str, str]]:
    import json

    model = json.loads(tokenizer.to_str())["model"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
