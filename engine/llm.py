"""The offline, single-process engine: ``LLM(model).generate(prompts, SamplingParams(...))``.

All prompts are submitted at once and served with continuous batching; outputs come back in
the order of the prompts. Also the colocated baseline that disaggregation is judged against.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.named_models import DEFAULT_MODEL
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | Seq[int]


class LLM:
    def __init__(
        self, model: str | Path = DEFAULT_MODEL, *, progress: bool = True, **options: Any
    ) -> None:
        """``options`` are EngineConfig fields (dtype, kv_cache_dtype, block_size, ...)."""
        self.engine = LLMEngine(model, EngineConfig(**options), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """End the engine's tensor-parallel ranks, if any (also done when it is collected)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        engine = self.engine
        # add_request validates; a bad prompt aborts those queued before it (nothing left behind).
        order = {}
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
            try:
                seq = engine.add_request(prompt, params)
            except Exception:
                for request_id in order:
                    engine.abort(request_id)
                raise
            order[seq.request_id] = index
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm)
        while engine.has_unfinished():
            for output in engine.step().finished:
                results[order[output.request_id]] = output
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def chat(
        self, messages: list[dict], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        return self.generate([self.chat_prompt(messages)], sampling_params)[0]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of ``messages`` rendered with the chat template, the assistant's
        turn opened."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(prompt, add_special_tokens=False)
