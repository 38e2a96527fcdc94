"""Roofline cost model: how long a prefill batch, a decode step and a KV transfer take.

time = overhead + max(FLOPs / (peak · mfu), bytes / (bandwidth · mbu))  [+ per-item terms]

FLOPs and bytes come from the model's shape (:class:`ModelShape`, read from a Hugging Face
config.json); peaks from a :class:`~cluster.simulator.hardware.Hardware` preset; the
efficiency factors and overheads (:class:`Efficiency`) from defaults typical of a tuned
GPU server, or from measurements via :func:`calibrate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from cluster.planner_model import PoolCapacity
from cluster.simulator.hardware import Hardware


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder: matmul parameters, attention, KV size."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool = True  # Llama's SwiGLU has 3 FFN matrices; OPT's ReLU MLP has 2
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")

    @property
    def layer_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        ffn = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return h * (q + 2 * kv) + q * h + ffn

    @property
    def matmul_params(self) -> int:
        """Parameters each token multiplies through (layers + LM head; not the embedding)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        return (self.matmul_params + self.vocab_size * self.hidden_size) * self.dtype_bytes

    def kv_bytes_per_token(self, kv_dtype_bytes: float | None = None) -> float:
        b = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * b

    @classmethod
    def from_hf_dict(cls, hf: dict, name: str = "model") -> ModelShape:
        """From a config.json dict: Llama-family keys, or OPT's (``ffn_dim``, ReLU MLP)."""
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            inter = int(hf.get("intermediate_size") or hf["ffn_dim"])
            dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
            return cls(
                name=name,
                num_layers=int(hf["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                intermediate_size=inter,
                vocab_size=int(hf["vocab_size"]),
                gated_mlp=hf.get("hidden_act", "silu") in ("silu", "swiglu"),
                dtype_bytes=4 if dtype in ("float32", "fp32") else 2,
            )
        except KeyError as missing:
            raise ValueError(f"config.json lacks {missing}") from None

    @classmethod
    def load(cls, spec: str) -> ModelShape:
        """``tiny``, ``opt-13b``, a config.json path, or a checkpoint directory."""
        if spec == "tiny":
            from engine.tiny import hf_config_dict

            return cls.from_hf_dict({**hf_config_dict(), "torch_dtype": "float32"}, "tiny")
        if spec.lower() in KNOWN_SHAPES:
            return cls.from_hf_dict(KNOWN_SHAPES[spec.lower()], spec.lower())
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(json.loads(path.read_text()), path.parent.name or spec)


# DistServe's chatbot model (OPT uses multi-head attention and a 2-matrix ReLU MLP).
OPT_13B = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "ffn_dim": 20480,
    "vocab_size": 50272,
    "hidden_act": "relu",
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
KNOWN_SHAPES = {"opt-13b": OPT_13B, "llama3-70b": LLAMA3_70B, "llama3-8b": LLAMA3_8B}


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak actually reached, and fixed costs the roofline does not see."""

    mfu: float = 0.55  # of peak FLOP/s, in prefill GEMMs
    attention: float = 1.0  # attention's FLOP/s relative to the GEMMs' (CPU: well below 1)
    mbu: float = 0.75  # of memory bandwidth, in decode
    tp_scaling: float = 0.9  # per-device efficiency of tensor parallelism (tp > 1)
    link_efficiency: float = 0.7
    forward_overhead_s: float = 2e-3  # per forward pass: launch, scheduling, sampling setup
    per_seq_s: float = 2e-5  # per sequence in a decode step (sampling, bookkeeping)
    per_token_s: float = 0.0  # per prefill token beyond the roofline

    def __post_init__(self) -> None:
        if self.attention <= 0:
            raise ValueError("attention must be positive")
        for name in ("mfu", "mbu", "tp_scaling", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if min(self.forward_overhead_s, self.per_seq_s, self.per_token_s) < 0:
            raise ValueError("overheads must be >= 0")


GPU_EFFICIENCY = Efficiency()
CPU_EFFICIENCY = Efficiency(mfu=0.3, mbu=0.5, forward_overhead_s=2e-3, per_seq_s=1e-4)


@dataclass(frozen=True)
class CostModel:
    """Times for one replica of ``tp`` devices. ``kv_wire_bytes`` is bytes per KV element
    on the wire (1 for fp8 blocks, scales are negligible)."""

    hardware: Hardware
    model: ModelShape
    tp: int = 1
    efficiency: Efficiency = GPU_EFFICIENCY
    kv_cache_bytes: float | None = None  # per KV element in the cache (None: model dtype)
    kv_wire_bytes: float = 1.0
    mem_fraction: float = 0.9  # of device memory usable for weights + KV

    @property
    def _scale(self) -> float:
        return self.tp * (self.efficiency.tp_scaling if self.tp > 1 else 1.0)

    @property
    def flops(self) -> float:
        return self.hardware.peak_flops * self.efficiency.mfu * self._scale

    @property
    def bandwidth(self) -> float:
        return self.hardware.mem_bw * self.efficiency.mbu * self._scale

    def _attention_flops_per_ctx(self) -> float:
        # q·Kᵀ and P·V: 2 FLOPs per multiply-add, 2 matmuls, per head and layer.
        return 4.0 * self.model.num_layers * self.model.num_heads * self.model.head_dim

    def prefill_flops(
        self, total_tokens: int, sum_sq_len: float, prompts: int = 1
    ) -> tuple[float, float]:
        """(GEMM FLOPs, attention FLOPs) of one prefill forward; only each prompt's last
        token goes through the LM head."""
        m = self.model
        head = m.vocab_size * m.hidden_size
        gemm = 2.0 * ((m.matmul_params - head) * total_tokens + head * prompts)
        return gemm, 0.5 * self._attention_flops_per_ctx() * sum_sq_len  # causal: half

    def allreduce_time(self, tokens: int) -> float:
        """A forward's all-reduces under tensor parallelism: two per layer (after attention's
        o projection and the MLP's down projection) of [tokens, hidden] activations, as a
        ring within a node: 2(t - 1) steps, each moving 1/t of the bytes over the
        intra-node link and paying one hop's latency. 0 at tp 1."""
        t = self.tp
        if t == 1:
            return 0.0
        hw, m = self.hardware, self.model
        link = hw.intra_node_link_bw or hw.link_bw
        nbytes = tokens * m.hidden_size * m.dtype_bytes
        one = (
            2
            * (t - 1)
            * (hw.allreduce_hop_s + nbytes / t / (link * self.efficiency.link_efficiency))
        )
        return 2 * m.num_layers * one

    def prefill_time(self, total_tokens: int, sum_sq_len: float, prompts: int = 1) -> float:
        """One prefill forward over ``prompts`` prompts: ``total_tokens`` tokens, Σ len²."""
        m = self.model
        gemm, attn = self.prefill_flops(total_tokens, sum_sq_len, prompts)
        flops = gemm + attn / self.efficiency.attention
        nbytes = m.weight_bytes + total_tokens * m.kv_bytes_per_token(self.kv_cache_bytes)
        e = self.efficiency
        return (
            e.forward_overhead_s
            + e.per_token_s * total_tokens
            + max(flops / self.flops, nbytes / self.bandwidth)
            + self.allreduce_time(total_tokens)
        )

    @cached_property
    def _decode_coefficients(self) -> tuple[float, ...]:
        # The simulator calls decode_step_time once per join and leave: precompute.
        m, e = self.model, self.efficiency
        return (
            e.forward_overhead_s,
            e.per_seq_s,
            2.0 * m.matmul_params / self.flops,  # s per sequence (GEMMs)
            self._attention_flops_per_ctx() / e.attention / self.flops,  # s per context token
            m.weight_bytes / self.bandwidth,
            m.kv_bytes_per_token(self.kv_cache_bytes) / self.bandwidth,
        )

    def decode_step_time(self, batch: int, context_tokens: float) -> float:
        """One decode step for ``batch`` sequences holding ``context_tokens`` of KV in all."""
        overhead, per_seq, gemm, attn, weights, kv = self._decode_coefficients
        compute = gemm * batch + attn * context_tokens
        memory = weights + kv * context_tokens
        step = overhead + per_seq * batch + (compute if compute > memory else memory)
        return step + self.allreduce_time(batch) if self.tp > 1 else step

    def transfer_time(self, prompt_len: int) -> float:
        """Moving one prompt's KV from a prefill to a decode replica (fp8 on the wire)."""
        hw = self.hardware
        nbytes = prompt_len * self.model.kv_bytes_per_token(self.kv_wire_bytes)
        bw = hw.link_bw * self.tp * self.efficiency.link_efficiency
        return hw.link_latency_s + nbytes / bw

    def kv_capacity_tokens(self) -> int:
        free = self.hardware.mem_bytes * self.tp * self.mem_fraction - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB) does not fit on "
                f"{self.tp} x {self.hardware.name}: use a larger tp"
            )
        return int(free / self.model.kv_bytes_per_token(self.kv_cache_bytes))

    def pool_capacity(
        self, mean_input: float, mean_output: float, max_batched_tokens: int, max_num_seqs: int
    ) -> PoolCapacity:
        """What the planner is told at start-up: the start-up measurement, simulated."""
        n = max(1, int(max_batched_tokens // max(mean_input, 1)))
        tokens = n * mean_input
        prefill = tokens / self.prefill_time(int(tokens), n * mean_input**2, n)
        ctx = mean_input + mean_output / 2
        seqs = max(
            1, min(max_num_seqs, int(self.kv_capacity_tokens() // (mean_input + mean_output)))
        )
        t1 = self.decode_step_time(1, ctx)
        tn = self.decode_step_time(seqs, seqs * ctx)
        # A chord of the convex roofline: never under-estimates a step between 1 and seqs.
        per_seq = (tn - t1) / (seqs - 1) if seqs > 1 else 0.0
        return PoolCapacity(prefill, max(t1 - per_seq, 1e-6), per_seq, seqs)


# ---- calibration --------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurements:
    """What `pdcluster bench engine` measures. ``prefill``: (prompts, prompt_len, seconds)
    of one batched prefill; ``decode``: (batch, mean context per sequence, step seconds)."""

    prefill: tuple[tuple[int, int, float], ...]
    decode: tuple[tuple[int, float, float], ...]

    @classmethod
    def from_bench_json(cls, data: dict, prompt_len: int, output_len: int) -> Measurements:
        """From ``pdcluster bench engine --json-out`` (run with these lengths)."""
        prefill, decode = [], []
        for row in data["engine"]:
            c = int(row["concurrency"])
            prefill.append((c, prompt_len, c * prompt_len / row["prefill_tok_s"]))
            decode.append((c, prompt_len + output_len / 2, c / row["decode_tok_s"]))
        return cls(tuple(prefill), tuple(decode))


def calibrate(cost: CostModel, measured: Measurements) -> CostModel:
    """Fit the efficiencies and overheads so the cost model reproduces ``measured``.

    1. Decode: step − roofline ≈ forward_overhead + per_seq · batch (least squares; mbu and
       mfu raised first if the roofline alone is slower than the measurement).
    2. Prefill (compute-bound): time − overhead ≈ GEMM FLOPs / (peak · mfu) + attention
       FLOPs / (peak · mfu · attention), least squares for 1/mfu and 1/(mfu·attention).
       If the fit says mfu > 1 the preset's peak was low (the CPU's is a guess): the peak
       is raised instead. Then step 1 again with the new mfu.
    """
    e = cost.efficiency
    if measured.decode:
        cost, e = _fit_decode(cost, e, measured)
    if measured.prefill:
        peak = cost.hardware.peak_flops
        x, a, y = [], [], []
        for n, length, t in measured.prefill:
            gemm, attn = cost.prefill_flops(n * length, n * length**2, n)
            x.append(gemm / peak)
            a.append(attn / peak)
            y.append(t - e.forward_overhead_s)
        design = np.array([x, a]).T
        (inv_mfu, inv_attn), *_ = np.linalg.lstsq(design, np.array(y), rcond=None)
        if inv_attn <= 0 or inv_mfu <= 0:  # degenerate (one length): GEMM-only fit
            inv_mfu = float(np.dot(np.array(x) + a, y) / np.dot(np.array(x) + a, np.array(x) + a))
            inv_attn = inv_mfu
        mfu, attention = 1.0 / inv_mfu, inv_mfu / inv_attn
        hw = cost.hardware
        if mfu > 1.0:
            hw, mfu = hw.with_(peak_flops=peak * mfu), 1.0
        e = replace(e, mfu=float(mfu), attention=float(attention), per_token_s=0.0)
        cost = replace(cost, hardware=hw, efficiency=e)
        if measured.decode:
            cost, e = _fit_decode(cost, e, measured)
    return replace(cost, efficiency=e)


def _fit_decode(
    cost: CostModel, e: Efficiency, measured: Measurements
) -> tuple[CostModel, Efficiency]:
    def roofline(eff: Efficiency) -> np.ndarray:
        bare = replace(cost, efficiency=replace(eff, forward_overhead_s=0.0, per_seq_s=0.0))
        return np.array([bare.decode_step_time(b, b * ctx) for b, ctx, _ in measured.decode])

    times = np.array([t for *_, t in measured.decode])
    roof = roofline(e)
    if (roof > times).any():  # the roofline alone is slower than reality: raise mbu
        boost = float(np.max(roof / times)) * 1.05
        e = replace(e, mbu=min(1.0, e.mbu * boost))
        roof = roofline(e)
    batch = np.array([b for b, *_ in measured.decode], dtype=float)
    resid = np.maximum(times - roof, 0.0)
    if len(set(batch.tolist())) > 1:
        slope, intercept = np.polyfit(batch, resid, 1)
    else:
        slope, intercept = 0.0, float(resid[0])
    if intercept < 0:  # keep both terms non-negative
        intercept, slope = 0.0, float(np.sum(resid * batch) / np.sum(batch**2))
    e = replace(e, forward_overhead_s=float(intercept), per_seq_s=float(max(slope, 0.0)))
    return replace(cost, efficiency=e), e
