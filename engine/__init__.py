"""pdcluster's engine: the Llama-family model, paged KV cache, kernels and the offline LLM."""

from engine.config import EngineConfig, ModelConfig
from engine.errors import CheckpointError, EngineError, InvalidRequestError, UnsupportedModelError
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

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
