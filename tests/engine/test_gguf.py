"""GGUF checkpoints against transformers loading the same file (``gguf_file=``): one small
synthetic file per supported tensor type, both tokenizer models, and bad files."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, CheckpointError, SamplingParams, UnsupportedModelError, cpu_isa
from engine.checkpoint import Checkpoint
from engine.gguf_file import GGUFFile
from tests.engine.gguf_files import write_gguf

NUM_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 100, 7, 50, 60], [1] + [(i * 37) % 300 + 3 for i in range(40)]]
TEXTS = [
    "The quick brown fox",
    "12345 apples and 678 pears",
    " hello  world\n\n",
    "<|im_start|>user\nhi<|im_end|>",
    "Once upon a time, the sea.",
    "déjà vu ✓",
]
# (architecture, tensor type of the 2-D weights, tokenizer model)
CASES = [
    ("llama", "F32", "gpt2"),
    ("llama", "F16", "gpt2"),
    ("llama", "BF16", "gpt2"),
    ("llama", "Q8_0", "gpt2"),
    ("llama", "Q4_0", "gpt2"),
    ("llama", "Q4_1", "gpt2"),
    ("llama", "Q4_K", "gpt2"),
    ("llama", "Q5_K", "gpt2"),
    ("llama", "Q6_K", "gpt2"),
    ("qwen2", "Q8_0", "gpt2"),  # QKV bias, tied embeddings, no Q/K permutation
    ("llama", "Q4_1", "llama"),  # SentencePiece vocabulary with scores, byte fallback
]


def transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize(
    "arch, tensor_type, tokenizer", CASES, ids=["-".join(case) for case in CASES]
)
def test_greedy_tokens_and_logits_equal_transformers(tmp_path, arch, tensor_type, tokenizer):
    path = write_gguf(tmp_path / "m.gguf", arch=arch, tensor_type=tensor_type, tokenizer=tokenizer)
    hf = transformers_model(path)
    llm = LLM(path, num_kv_blocks=64, progress=False)
    for prompt in PROMPTS:
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert llm.generate([prompt], GREEDY)[0].token_ids == expected
    logits = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, logprobs=5))[0]
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPTS[1]])).logits[0, -1].log_softmax(-1)
    top = reference.topk(5)
    assert logits.logprobs[0].top.keys() == set(top.indices.tolist())
    for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert logits.logprobs[0].top[token] == pytest.approx(value, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("tokenizer", ["gpt2", "llama"])
def test_tokenizer_from_metadata_equals_transformers(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", tokenizer=tokenizer)
    ours = Checkpoint(path).tokenizer()
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_ids == (2,)
    assert "<|im_start|>assistant" in ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_config_comes_from_the_metadata(tmp_path):
    config = GGUFFile(write_gguf(tmp_path / "q.gguf", arch="qwen2")).model_config()
    assert (config.architecture, config.num_layers, config.num_heads) == ("qwen2", 2, 4)
    assert (config.num_kv_heads, config.head_dim, config.hidden_size) == (2, 64, 256)
    assert config.qkv_bias and config.tie_word_embeddings and config.vocab_size == 320


def test_truncated_file_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tensor_type="Q8_0")
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, 3):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="cut.gguf .*(truncated|not a readable)"):
            LLM(tmp_path / "cut.gguf", progress=False)


def test_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'phi2'.*supported: llama"):
        LLM(path, progress=False)


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "pre.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = "made-up" if name == "tokenizer.ggml.pre" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        shape = list(reversed(tensor.shape.tolist()))
        writer.add_tensor(tensor.name, tensor.data, raw_shape=shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'made-up'"):
        Checkpoint(tmp_path / "pre.gguf").tokenizer()


def test_not_a_gguf_and_missing_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="junk.gguf is not a readable GGUF"):
        LLM(tmp_path / "junk.gguf", progress=False)
    with pytest.raises(CheckpointError, match="not found"):
        LLM(tmp_path / "absent.gguf", progress=False)


@pytest.mark.parametrize("tensor_type, paired", [("Q4_1", True), ("Q8_0", True), ("Q4_K", False)])
def test_every_gemm_weight_keeps_its_blocks_where_the_quantised_gemm_takes_them(
    tmp_path, tensor_type, paired
):
    from engine.kernels import cpu_native
    from engine.quantized_weights import gguf_gemm_blocks

    if cpu_native.library() is None:
        pytest.skip(f"{cpu_isa.why_missing('none')}: GEMMs stay dense")
    path = write_gguf(tmp_path / "m.gguf", arch="llama", tensor_type=tensor_type)
    checkpoint = Checkpoint(path)
    model = checkpoint.load_model(torch.float32, torch.device("cpu"), 256, progress=False)
    pairs = gguf_gemm_blocks(checkpoint._gguf, model)
    assert len(pairs) == (len(model.gemm_weights()) if paired else 0)
    for weight, blocks in pairs:  # Q/K rows unpermuted, parts fused, as the dense weights
        assert blocks.kind == tensor_type and blocks.out_features == weight.shape[0]
    bf16 = checkpoint.load_model(torch.bfloat16, torch.device("cpu"), 256, progress=False)
    assert checkpoint.gemm_blocks(bf16) == []  # the kernel takes fp32 activations only
    if paired:
        on = LLM(path, num_kv_blocks=16, progress=False, dtype="float32")
        off = LLM(path, num_kv_blocks=16, progress=False, dtype="float32", gguf_gemm=False)
        assert len(on.engine.gemm_plan.quantized.blocks) == len(pairs)
        assert len(off.engine.gemm_plan.quantized.blocks) == 0
