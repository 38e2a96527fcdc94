"""A bf16 decode step's decoder layers on CPU, one C call each (``decode_layer_cpu.c``).

``model.DecoderLayer`` runs a layer as ~10 calls (RMSNorm, four GEMMs, RoPE + store,
attention, SiLU), each a few microseconds of Python and ctypes; at batch 1 that added ~5 ms
to ~9 ms of weight reads. The C layer chains the same kernels in the same order, so its
result is the op-by-op path's bit for bit (tests compare), and this module checks once per
step what each of those wrappers checked per call.

It runs a step only where every piece of the chain would have taken its C kernel:
bf16 weights and cache, one tensor-parallel rank, the GEMM plan routing the step's row
count to the AMX tiles (which hold every layer weight), a decode-only batch, and the C
paged attention. ``applies`` says whether a step is one; otherwise the model runs its
layers op by op. Called from the engine's step thread only (the buffers are per step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata
from engine.cpu_gemm import GemmPlan
from engine.kernels import cpu_native
from engine.kernels.fused_cpu import check_slots
from engine.kv_cache import PagedKVCache


class _Layer(ctypes.Structure):
    """decode_layer_cpu.c's DecodeLayer."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "input_norm", "post_attention_norm", "qkv", "o", "gate_up", "down",
            "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "k_cache", "v_cache",
        )
    ]  # fmt: skip


class _Step(ctypes.Structure):
    """decode_layer_cpu.c's DecodeStep."""

    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in (
                "tokens", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "block_size", "table_width",
            )
        ],
        ("eps", ctypes.c_float),
        ("softmax_scale", ctypes.c_float),
        *[
            (name, ctypes.c_void_p)
            for name in (
                "cos", "sin", "slots", "block_tables", "context_lens", "hidden", "residual",
                "normed", "qkv", "q", "k", "attention", "gate_up", "activated",
            )
        ],
        ("threads", ctypes.c_int),
    ]  # fmt: skip


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeDecodeLayers:
    """Runs every decoder layer of a decode-only bf16 step through ``decode_layer_bf16``.

    Built once per model by ``build`` (None where it can never apply). It keeps the AMX
    packings it points at alive, whatever the plan later does with its own."""

    def __init__(self, model: torch.nn.Module, plan: GemmPlan) -> None:
        self._model = model
        self._plan = plan
        self._lib = cpu_native.library()
        self._layers = (_Layer * len(model.layers))()
        self._packed = []
        for index, layer in enumerate(model.layers):
            packed = [
                plan.amx.pack(w)
                for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
            ]
            self._packed.append(packed)
            fields = self._layers[index]
            fields.input_norm = layer.input_norm_weight.data_ptr()
            fields.post_attention_norm = layer.post_attention_norm_weight.data_ptr()
            fields.qkv, fields.o, fields.gate_up, fields.down = (p.address for p in packed)
            fields.qkv_bias = _address(layer.qkv_bias)
            fields.o_bias = _address(layer.o_bias)
            fields.gate_up_bias = _address(layer.gate_up_bias)
            fields.down_bias = _address(layer.down_bias)
        self._layer_addresses = [ctypes.addressof(layer) for layer in self._layers]
        self._cache_key: tuple | None = None  # the cache whose pages the layers point at
        self._step = _Step()
        self._step_address = ctypes.addressof(self._step)
        self._routes: dict[int, bool] = {}  # rows → whether the plan sends them to AMX

    @classmethod
    def build(cls, model: torch.nn.Module, plan: GemmPlan | None) -> NativeDecodeLayers | None:
        """None where no step could take it: no C kernels or AMX packing here, a dtype other
        than bf16, tensor parallelism, a weight the AMX GEMM declines."""
        if (
            plan is None
            or cpu_native.library() is None
            or model.tp.size != 1
            or model.norm_weight.dtype != torch.bfloat16
            or "amx" not in plan.choices.values()
        ):
            return None
        for layer in model.layers:
            weights = (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
            norms = (layer.input_norm_weight, layer.post_attention_norm_weight)
            biases = (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias)
            if any(plan.amx.pack(w) is None for w in weights):
                return None
            if any(not t.is_contiguous() for t in (*norms, *(b for b in biases if b is not None))):
                return None
            if any(b is not None and b.dtype != torch.bfloat16 for b in biases):
                return None
        return cls(model, plan)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache) -> bool:
        rows = hidden.shape[0]
        amx = self._routes.get(rows)
        if amx is None:
            amx = self._routes[rows] = self._plan.choice_for(rows) == "amx"
        return (
            amx
            and meta.prefill is None
            and meta.decode is not None
            and meta.decode.cpu is not None
            and meta.decode.cpu.gather is None
            and cache.k_scale is None
            and cache.k.dtype == torch.bfloat16
            and hidden.dtype == torch.bfloat16
            and hidden.is_contiguous()
        )

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, H] bf16, contiguous: overwritten
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        meta: AttentionMetadata,
        cache: PagedKVCache,
        layer_done: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer, as the op-by-op loop returns them."""
        c = self._model.config
        tokens = hidden.shape[0]
        plan = meta.decode.cpu
        num_blocks, block_size, num_kv_heads, head_dim = cache.k.shape[1:]
        cos, sin = (t.contiguous() for t in rope)
        slots = meta.slot_mapping.contiguous()
        # What the op-by-op wrappers check on every call, checked once for all layers.
        if (num_kv_heads, head_dim) != (c.num_kv_heads, c.head_dim):
            raise ValueError(f"the cache's heads {tuple(cache.k.shape)} do not fit {c}")
        if slots.dtype != torch.int64 or slots.shape != (tokens,):
            raise ValueError(f"slot_mapping must be [{tokens}] int64, got {tuple(slots.shape)}")
        check_slots(slots, num_blocks * block_size)
        if plan.batch != tokens or cos.shape != (tokens, 1, head_dim):
            raise ValueError(f"{tokens} rows, but a decode plan for {plan.batch}")
        plan.check_fits(num_blocks)
        cache_key = (cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape)
        if cache_key != self._cache_key:  # by address, not object: no reference kept
            for index, fields in enumerate(self._layers):
                fields.k_cache = cache.k[index].data_ptr()
                fields.v_cache = cache.v[index].data_ptr()
            self._cache_key = cache_key

        q_size, kv_size = c.num_heads * head_dim, num_kv_heads * head_dim
        inter = c.intermediate_size
        sizes = (c.hidden_size, q_size + 2 * kv_size, q_size, kv_size, q_size, 2 * inter, inter)
        scratch = torch.empty(tokens * sum(sizes), dtype=torch.bfloat16)
        residual = torch.empty_like(hidden)
        s = self._step
        s.tokens, s.hidden_size, s.intermediate_size = tokens, c.hidden_size, inter
        s.num_heads, s.num_kv_heads, s.head_dim = c.num_heads, num_kv_heads, head_dim
        s.block_size, s.table_width = block_size, plan.block_tables.shape[1]
        s.eps, s.softmax_scale = c.rms_norm_eps, head_dim**-0.5
        s.cos, s.sin, s.slots = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        s.block_tables, s.context_lens = plan.block_tables.data_ptr(), plan.context_lens.data_ptr()
        s.hidden, s.residual = hidden.data_ptr(), residual.data_ptr()
        address = scratch.data_ptr()
        buffers = []
        for size in sizes:
            buffers.append(address)
            address += tokens * size * 2
        s.normed, s.qkv, s.q, s.k, s.attention, s.gate_up, s.activated = buffers
        s.threads = torch.get_num_threads()

        run, step = self._lib.decode_layer_bf16, self._step_address
        for index, layer in enumerate(self._layer_addresses):
            status = run(layer, step, index == 0)
            if status:
                raise (MemoryError if status == -2 else RuntimeError)(
                    f"decode_layer_bf16 failed in layer {index} ({status})"
                )
            if layer_done is not None:
                layer_done(index)
        return hidden, residual
