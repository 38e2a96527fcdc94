"""Tensor parallelism in the engine (CPU, gloo): tp t gives tp 1's greedy tokens and logits
on Llama GQA, Qwen2 (QKV bias, tied embeddings), a single KV head (replicated) and the real
default model at tp 3; every rank loads only its slice; bad degrees are clear errors."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.llm import LLM
from engine.loader import empty_model, load_weights, read_model_config, shard_layout
from engine.tensor_parallel import ShardLayout, check_tensor_parallel
from engine.tp_group import TPGroup
from tests.engine.checkpoints import make_checkpoint

PROMPTS = [[1, 17, 5, 99, 23, 8, 41], [1, 200, 3, 3, 64]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def greedy_and_logits(directory, dtype_="float32", **options):
    """Greedy tokens of PROMPTS and every step's logits, from one engine."""
    llm = LLM(directory, progress=False, dtype=dtype_, num_kv_blocks=64, **options)
    steps = []
    run = llm.engine.runner.run

    def capture(batch, layer_done=None, rank_data=None):
        logits, sampling, prompt_hidden = run(batch, layer_done, rank_data)
        steps.append(logits.clone())
        return logits, sampling, prompt_hidden

    llm.engine.runner.run = capture
    with llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return tokens, steps


def assert_same_as_tp1(directory, tp, scaled=False, **options):
    """tp ``tp`` gives tp 1's greedy tokens, and logits within 1e-5 (times the largest
    logit of the step when ``scaled``)."""
    expected_tokens, expected_logits = greedy_and_logits(directory, **options)
    tokens, logits = greedy_and_logits(directory, tensor_parallel_size=tp, **options)
    assert tokens == expected_tokens
    assert len(logits) == len(expected_logits)
    for ours, theirs in zip(logits, expected_logits, strict=True):
        atol = 1e-5 * (theirs.abs().max().item() if scaled else 1.0)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "kind, tp, overrides",
    [
        ("llama", 2, {}),  # 8 query heads, 2 KV heads: one KV head per rank
        ("qwen2", 2, {}),  # QKV bias, tied embeddings
        ("llama", 2, {"num_key_value_heads": 1}),  # one KV head, replicated on both ranks
    ],
    ids=["llama-gqa", "qwen2-bias-tied", "single-kv-head"],
)
def test_tp_equals_tp1(tmp_path, kind, tp, overrides):
    make_checkpoint(tmp_path, kind, **overrides)
    assert_same_as_tp1(tmp_path, tp)


def test_tp_with_fp8_cache_and_sharded_checkpoint(tmp_path):
    """fp8 scales per (block, local head); tensors read as slices across weight shards."""
    make_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_same_as_tp1(tmp_path, 2, kv_cache_dtype="fp8")


def test_each_rank_holds_only_its_slice(tmp_path):
    """Rank r's parameters are exactly its rows / columns of the whole model's, KV heads
    replicated where t > num_kv_heads; the LM head only on rank 0."""
    make_checkpoint(tmp_path, "llama", num_key_value_heads=2)
    config = read_model_config(tmp_path)
    whole = dict(_load(tmp_path, config, 1, 0).named_parameters())
    d, hq, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, 160
    q, kv = hq * d, hkv * d
    for size in (2, 4):
        for rank in range(size):
            part = dict(_load(tmp_path, config, size, rank).named_parameters())
            heads = hq // size
            kv_head = rank * hkv // size if size <= hkv else rank // (size // hkv)
            q_rows = slice(rank * heads * d, (rank + 1) * heads * d)
            kv_rows = slice(kv_head * d, (kv_head + 1) * d)
            mlp = slice(rank * inter // size, (rank + 1) * inter // size)
            qkv = whole["layers.1.qkv_weight"]
            expected_qkv = torch.cat(
                [qkv[:q][q_rows], qkv[q : q + kv][kv_rows], qkv[q + kv :][kv_rows]]
            )
            assert torch.equal(part["layers.1.qkv_weight"], expected_qkv)
            assert torch.equal(part["layers.1.o_weight"], whole["layers.1.o_weight"][:, q_rows])
            gate_up = whole["layers.1.gate_up_weight"]
            expected_gate_up = torch.cat([gate_up[:inter][mlp], gate_up[inter:][mlp]])
            assert torch.equal(part["layers.1.gate_up_weight"], expected_gate_up)
            assert torch.equal(part["layers.1.down_weight"], whole["layers.1.down_weight"][:, mlp])
            assert torch.equal(part["embed_weight"], whole["embed_weight"])
            assert ("lm_head_weight" in part) == (rank == 0)


def _load(directory, config: ModelConfig, size: int, rank: int):
    tp = TPGroup(rank, size)  # no peers: loading alone never communicates
    layout = shard_layout(config, tp)
    model = empty_model(layout, tp, torch.float32, torch.device("cpu"), 64)
    load_weights(model, directory, layout, progress=False)
    return model


@pytest.mark.parametrize(
    "heads, kv_heads, size, message",
    [
        (9, 3, 2, "does not divide the model's 9 query heads (choose a divisor of 9: 1, 3, 9)"),
        (8, 4, 8, None),
        (8, 2, 8, None),
        (12, 6, 4, "does not divide the model's 6 KV heads"),
        (8, 2, 0, "must be a positive integer"),
    ],
)
def test_degrees_the_heads_allow(heads, kv_heads, size, message):
    config = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=heads * 8, intermediate_size=64,
        num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
        max_position_embeddings=64,
    )  # fmt: skip
    if message is None:
        check_tensor_parallel(config, size)
        layouts = [ShardLayout(config, size, r) for r in range(size)]
        assert all(len(layout.kv_heads) >= 1 for layout in layouts)
        return
    with pytest.raises(EngineError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(config, size)


def test_tp_ranks_end_with_the_engine(tmp_path):
    make_checkpoint(tmp_path, "llama")
    llm = LLM(tmp_path, progress=False, num_kv_blocks=16, tensor_parallel_size=2)
    processes = llm.engine._tp_processes
    assert [p.is_alive() for p in processes] == [True]
    llm.close()
    assert [p.is_alive() for p in processes] == [False]


def test_default_model_tp3_equals_tp1(default_model_file):
    """smollm2-135m: 9 query heads and 3 KV heads — tp 3 holds one KV head per rank, tp 2
    divides neither and is refused before anything loads."""
    with pytest.raises(EngineError, match="does not divide the model's 9 query heads"):
        LLM("smollm2-135m", progress=False, tensor_parallel_size=2)
    # The all-reduce adds the ranks' partial sums in another order than one GEMM does: over
    # 30 layers that moves fp32 logits of magnitude ~10-20 by up to ~5e-5.
    assert_same_as_tp1("smollm2-135m", 3, scaled=True)


@pytest.mark.gpu
def test_tp2_on_cuda_over_nccl_equals_tp1(tmp_path):
    """The NCCL path: two GPUs, bf16; greedy tokens equal and logits close to tp 1's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallel 2 over NCCL needs two CUDA GPUs")
    make_checkpoint(tmp_path, "llama")
    expected_tokens, expected_logits = greedy_and_logits(tmp_path, device="cuda", dtype_="bf16")
    tokens, logits = greedy_and_logits(
        tmp_path, device="cuda", dtype_="bf16", tensor_parallel_size=2
    )
    assert tokens == expected_tokens
    for ours, theirs in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.05)
