"""Validated configuration: the model's shape (from a Hugging Face config.json) and the engine's options."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cpu_gemm import BACKEND_NAMES
from engine.errors import EngineError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
KV_CACHE_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# What a preempted sequence becomes (engine/scheduler.py): see EngineConfig.preemption_mode
PREEMPTION_MODES = ("auto", "recompute", "swap")


def parse_dtype(name: str | torch.dtype, *, allow_fp8: bool = False) -> torch.dtype:
    """Turn 'bf16', 'float32', torch.float16, ... into a torch dtype, or raise a clear error."""
    if isinstance(name, torch.dtype):
        allowed = set(KV_CACHE_DTYPES.values() if allow_fp8 else DTYPES.values())
        if name not in allowed:
            raise EngineError(f"unsupported dtype {name}")
        return name
    table = KV_CACHE_DTYPES if allow_fp8 else DTYPES
    if name not in table:
        raise EngineError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings: theta plus optional 'linear' or 'llama3' frequency scaling."""

    theta: float = 10000.0
    scaling_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.scaling_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(
                f"rope scaling type {self.scaling_type!r} is not supported "
                "(supported: default, linear, llama3)"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise UnsupportedModelError("rope theta and factor must be positive")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder. Built from config.json by ``from_hf_dict``."""

    architecture: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype, informational

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(
                    f"config {name} must be a positive integer, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(
                f"head_dim must be even for rotary embeddings, got {self.head_dim}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window caps it (attention is then full)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def fingerprint(self) -> dict[str, Any]:
        """What two workers must agree on to exchange KV cache blocks."""
        return {
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope": dataclasses.asdict(self.rope),
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        architectures = hf.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES),
            None,
        )
        if arch is None:
            model_type = hf.get("model_type")
            by_type = {v: v for v in SUPPORTED_ARCHITECTURES.values()}
            if not architectures and model_type in by_type:
                arch = by_type[model_type]
            else:
                raise UnsupportedModelError(
                    f"unsupported architecture {architectures or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)"
            )
        try:
            hidden = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            config = dict(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            )
        except KeyError as missing:
            raise UnsupportedModelError(f"config.json lacks required key {missing}") from None
        except (TypeError, ValueError) as bad:
            raise UnsupportedModelError(f"config.json has a malformed value: {bad}") from None
        sliding_window = hf.get("sliding_window")
        if arch == "qwen2" and not hf.get("use_sliding_window", False):
            sliding_window = None
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            **config,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        )


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Read rope settings from both the transformers 4.x (rope_theta + rope_scaling) and
    5.x (rope_parameters) spellings of config.json."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return RopeConfig(
        theta=float(theta),
        scaling_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance (a prefill or decode worker, or the offline LLM)."""

    dtype: str = "auto"  # auto = bfloat16 on CUDA; on CPU measured (engine.cpu_dtype)
    kv_cache_dtype: str = "auto"  # auto = the model dtype; or fp8
    device: str = "auto"  # auto = cuda if available else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None = the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step; longer prompts are chunked
    enable_prefix_caching: bool = True
    seed: int = 0
    # CPU GEMM library: auto = the fastest per row count, measured at start-up
    # (engine.cpu_gemm); or torch, onednn, onednn-packed, openblas for every GEMM.
    cpu_gemm: str = "auto"
    # CPU, fp32, GGUF Q4_0/Q4_1/Q8_0 models: keep each GEMM weight's blocks too, and let the
    # plan run a row count on them where measured faster (engine.kernels.quantized_cpu)
    gguf_gemm: bool = True
    # CUDA: capture the decode forward as CUDA graphs at start-up (False: always eager)
    cuda_graphs: bool = True
    # ranks of one replica, each holding 1/t of the heads and MLP (engine.tensor_parallel)
    tensor_parallel_size: int = 1
    # A host-memory KV tier beside the device cache (engine.host_kv_tier): evicted prefix
    # blocks and swapped-out sequences. 0 = none; num_host_kv_blocks overrides the size.
    host_kv_cache_gb: float = 0.0
    num_host_kv_blocks: int | None = None
    # On preemption: auto = swap to the host tier where its measured copies cost less than
    # a recompute; recompute = always recompute; swap = swap whenever the tier has room.
    preemption_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1) or self.block_size < 8:
            raise EngineError(f"block_size must be a power of two >= 8, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise EngineError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise EngineError("kv_cache_memory_gb must be positive")
        if self.max_num_seqs <= 0:
            raise EngineError("max_num_seqs must be positive")
        if self.max_num_batched_tokens < self.block_size:
            raise EngineError("max_num_batched_tokens must be at least block_size")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise EngineError("max_model_len must be positive")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.kv_cache_dtype != "auto":
            parse_dtype(self.kv_cache_dtype, allow_fp8=True)
        if self.cpu_gemm not in ("auto", *BACKEND_NAMES):
            raise EngineError(
                f"cpu_gemm must be auto or one of {', '.join(BACKEND_NAMES)}, got {self.cpu_gemm!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise EngineError(
                f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}"
            )
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise EngineError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        self._check_host_tier()

    def _check_host_tier(self) -> None:
        gb = self.host_kv_cache_gb
        if isinstance(gb, bool) or not isinstance(gb, int | float) or not 0 <= gb < math.inf:
            raise EngineError(f"host_kv_cache_gb must be a number >= 0, got {gb!r}")
        blocks = self.num_host_kv_blocks
        if blocks is not None and (
            isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0
        ):
            raise EngineError(f"num_host_kv_blocks must be a positive integer, got {blocks!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise EngineError(
                f"preemption_mode must be auto, recompute or swap, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and not self.wants_host_tier:
            raise EngineError(
                "preemption_mode swap needs a host KV tier (host_kv_cache_gb or num_host_kv_blocks)"
            )
        if self.wants_host_tier and self.tensor_parallel_size > 1:
            # Its synchronous copies run on rank 0 only; the other ranks' shards would not
            # move with it.
            raise EngineError("the host KV tier does not support tensor_parallel_size > 1 yet")

    @property
    def wants_host_tier(self) -> bool:
        return self.host_kv_cache_gb > 0 or self.num_host_kv_blocks is not None

    def host_blocks_for(self, bytes_per_block: int) -> int:
        """Slots of the host KV tier (0: none) for device blocks of ``bytes_per_block``."""
        if self.num_host_kv_blocks is not None:
            return self.num_host_kv_blocks
        if self.host_kv_cache_gb <= 0:
            return 0
        return max(1, math.floor(self.host_kv_cache_gb * 2**30 / bytes_per_block))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return parse_dtype(self.dtype)
        if device.type == "cuda":
            return torch.bfloat16
        from engine.cpu_dtype import cpu_auto_dtype

        return cpu_auto_dtype()

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return parse_dtype(self.kv_cache_dtype, allow_fp8=True)

    def blocks_for_memory(self, model: ModelConfig, kv_dtype: torch.dtype) -> int:
        bytes_per_block = (
            2
            * model.num_layers
            * self.block_size
            * model.num_kv_heads
            * model.head_dim
            * torch.finfo(kv_dtype).bits
            // 8
        )
        return max(1, math.floor(self.kv_cache_memory_gb * 2**30 / bytes_per_block))
