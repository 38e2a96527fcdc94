"""A bf16 decode step's layers as one C call each (engine.kernels.decode_layers_cpu): the
op-by-op path's bits, and only where every op of that path would have run its C kernel."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams, cpu_isa
from engine.kernels.amx_gemm import amx_available
from engine.kernels.decode_layers_cpu import NativeDecodeLayers
from tests.engine.checkpoints import make_checkpoint

needs_amx = pytest.mark.skipif(
    not amx_available(), reason=f"{cpu_isa.why_missing('amx')}: the layers run op by op"
)

# Lengths that end inside a block, on a block's end and past several blocks (block size 16).
PROMPTS = [[5, 9, 13], list(range(3, 19)), [(7 * i) % 250 + 3 for i in range(41)]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: biases on q, k, v
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_checkpoint(directory, request.param)
    return directory


def _counting(monkeypatch) -> list[int]:
    """Counts the steps NativeDecodeLayers runs (their row counts)."""
    rows: list[int] = []
    real = NativeDecodeLayers.__call__

    def counted(self, hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return real(self, hidden, *args, **kwargs)

    monkeypatch.setattr(NativeDecodeLayers, "__call__", counted)
    return rows


def _generate(llm: LLM) -> list[tuple]:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=5)
    outputs = llm.generate(PROMPTS, params)
    return [(out.token_ids, out.logprobs) for out in outputs]


@needs_amx
def test_native_decode_layers_give_the_op_by_op_bits(checkpoint, monkeypatch):
    rows = _counting(monkeypatch)
    llm = LLM(checkpoint, dtype="bfloat16", cpu_gemm="amx", num_kv_blocks=64, progress=False)
    model = llm.engine.model
    assert model.native_decode is not None
    native = _generate(llm)
    # every decode step of the batch went through it: 19 steps after each prompt's prefill
    assert len(rows) >= 19 and set(rows) <= {1, 2, 3}
    model.use_native_decode(None)
    calls = len(rows)
    assert _generate(llm) == native  # token ids and every logprob, exactly
    assert len(rows) == calls


@needs_amx
def test_fp8_caches_and_prompt_steps_run_op_by_op(checkpoint, monkeypatch):
    rows = _counting(monkeypatch)
    llm = LLM(
        checkpoint,
        dtype="bfloat16",
        cpu_gemm="amx",
        kv_cache_dtype="fp8",
        num_kv_blocks=64,
        progress=False,
    )
    assert llm.engine.model.native_decode is not None  # built, but no step of an fp8 cache
    assert all(len(ids) == 20 for ids, _ in _generate(llm))
    assert rows == []


def test_it_is_not_built_where_no_step_could_take_it(checkpoint):
    for options in (
        {"dtype": "float32"},  # the exactness tests' dtype: never the AMX GEMM
        {"dtype": "bfloat16", "cpu_gemm": "torch"},  # a plan without AMX
    ):
        llm = LLM(checkpoint, num_kv_blocks=64, progress=False, **options)
        assert llm.engine.model.native_decode is None


@needs_amx
def test_a_slot_past_the_cache_is_refused_before_the_c_code_runs(checkpoint, monkeypatch):
    llm = LLM(checkpoint, dtype="bfloat16", cpu_gemm="amx", num_kv_blocks=64, progress=False)
    real = NativeDecodeLayers.__call__

    def past_the_cache(self, hidden, rope, meta, cache, layer_done=None):
        capacity = cache.k.shape[1] * cache.k.shape[2]
        bad = meta.slot_mapping.clone()
        bad[-1] = capacity
        meta = type(meta)(bad, meta.block_runs, meta.num_decode_tokens, meta.decode, meta.prefill)
        return real(self, hidden, rope, meta, cache, layer_done)

    monkeypatch.setattr(NativeDecodeLayers, "__call__", past_the_cache)
    with pytest.raises(ValueError, match="past the cache"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0))
