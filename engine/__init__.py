"""pdcluster's engine: the Llama-family model, paged KV cache, kernels and the offline LLM."""

from engine.cpu_isa import forward_to_libraries

forward_to_libraries()  # before torch's first op: oneDNN and ATen read their caps once

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.errors import CheckpointError, EngineError, InvalidRequestError, UnsupportedModelError  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "CheckpointError",
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
]
