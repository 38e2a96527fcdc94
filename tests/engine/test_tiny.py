"""The built-in tiny preset: deterministic, and the same model transformers computes."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.tiny import save_tiny_checkpoint


def test_tiny_is_deterministic_and_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ours = LLM("tiny", num_kv_blocks=32, progress=False).generate(["Hello tiny"], params)[0]
    again = LLM("tiny", num_kv_blocks=32, progress=False).generate(["Hello tiny"], params)[0]
    assert ours.token_ids == again.token_ids
    save_tiny_checkpoint(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([ours.prompt_token_ids])
    expected = hf.generate(
        ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert ours.token_ids == expected[0, ids.shape[1] :].tolist()
