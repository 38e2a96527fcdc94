"""Loads a checkpoint into a LlamaModel, fusing QKV and gate_up: a Hugging Face directory, or a
GGUF file (through engine.gguf_file, which yields its tensors under Hugging Face names).

Reads config.json, then model.safetensors or the shards named by
model.safetensors.index.json. Every tensor is shape-checked against the model before it is
copied in; missing, corrupt or mis-shaped files raise CheckpointError saying which file and
which tensor. Under tensor parallelism a rank reads only its slice of each tensor
(safetensors slices: the rest of the file is never read into memory).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from engine.errors import CheckpointError, UnsupportedModelError
from engine.gguf_file import GGUFFile
from engine.model import LlamaModel
from engine.tensor_parallel import ShardLayout
from engine.tp_group import TPGroup

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF tensor suffix → (our parameter name, which part of a fused tensor, or None)
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("qkv_weight", "q"),
    "self_attn.k_proj.weight": ("qkv_weight", "k"),
    "self_attn.v_proj.weight": ("qkv_weight", "v"),
    "self_attn.q_proj.bias": ("qkv_bias", "q"),
    "self_attn.k_proj.bias": ("qkv_bias", "k"),
    "self_attn.v_proj.bias": ("qkv_bias", "v"),
    "self_attn.o_proj.weight": ("o_weight", None),
    "self_attn.o_proj.bias": ("o_bias", None),
    "mlp.gate_proj.weight": ("gate_up_weight", "gate"),
    "mlp.up_proj.weight": ("gate_up_weight", "up"),
    "mlp.gate_proj.bias": ("gate_up_bias", "gate"),
    "mlp.up_proj.bias": ("gate_up_bias", "up"),
    "mlp.down_proj.weight": ("down_weight", None),
    "mlp.down_proj.bias": ("down_bias", None),
    "input_layernorm.weight": ("input_norm_weight", None),
    "post_attention_layernorm.weight": ("post_attention_norm_weight", None),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def read_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint directory needs config.json")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return ModelConfig.from_hf_dict(hf)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint, single-file or sharded, all checked to exist."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is malformed: {err}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"weight shard {file} named by the index is missing")
    return files


Index = tuple[slice, ...]  # a part of a tensor: () for all of it, else one slice per dim


@dataclass(frozen=True)
class TensorReader:
    """One checkpoint tensor: its full shape, and a reader of any part of it."""

    shape: tuple[int, ...]
    read: Callable[[Index], torch.Tensor]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> TensorReader:
        """A tensor that can only be produced whole (dequantised GGUF, built in memory)."""
        return cls(tuple(tensor.shape), lambda index: tensor[index] if index else tensor)


def load_weights(
    model: LlamaModel,
    model_dir: str | Path,
    layout: ShardLayout | None = None,
    *,
    progress: bool = True,
) -> None:
    """Copy every tensor of a checkpoint directory (this rank's part of it) into ``model``;
    verify all were set."""
    files = safetensors_files(model_dir)
    names_by_file = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names_by_file.append((file, list(handle.keys())))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file} is not a readable safetensors file: {err}") from None

    def tensors():
        for file, names in names_by_file:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    for name in names:
                        part = handle.get_slice(name)
                        reader = TensorReader(
                            tuple(part.get_shape()), lambda i, p=part: p[i] if i else p[:]
                        )
                        yield name, reader, file.name
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{file} is corrupt: {err}") from None

    total = sum(len(names) for _, names in names_by_file)
    fill_weights(model, tensors(), total, str(model_dir), layout, progress=progress)


def fill_weights(
    model: LlamaModel,
    tensors: Iterable[tuple[str, TensorReader, str]],
    total: int,
    source: str,
    layout: ShardLayout | None = None,
    *,
    progress: bool = True,
) -> None:
    """Copy (HF name, reader, file name) triples into ``model`` (this rank's slice of each
    under ``layout``), fusing QKV and gate_up as it goes; raise CheckpointError unless every
    parameter was filled."""
    layout = layout or ShardLayout(model.config)
    full_shapes = _full_shapes(layout.config)
    local = layout.local_config
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    bar = tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress)
    for name, reader, file in tensors:
        target = _target(name, layout)
        if target is not None:
            param_name, part, index = target
            if param_name not in params:
                raise UnsupportedModelError(
                    f"checkpoint has {name!r} but the config does not enable it (bias settings?)"
                )
            expected = tuple(full_shapes[param_name][_fused_rows(part, layout.config)].shape)
            if reader.shape != expected:
                raise CheckpointError(
                    f"{name} in {file} has shape {reader.shape}, expected {expected}"
                )
            destination = params[param_name].data[_fused_rows(part, local)]
            with torch.no_grad():
                destination.copy_(reader.read(index).to(destination.dtype))
            filled[param_name] += destination.shape[0]
        bar.update(1)
    bar.close()
    missing = [name for name, count in filled.items() if count < params[name].shape[0]]
    if missing:
        raise CheckpointError(
            f"checkpoint {source} lacks weights for: {', '.join(sorted(missing)[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )


def _full_shapes(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter of the whole (tp = 1) model, as meta tensors: the shapes to check."""
    with torch.device("meta"):
        return dict(LlamaModel(config, 1).named_parameters())


def _target(hf_name: str, layout: ShardLayout) -> tuple[str, str | None, Index] | None:
    """Our parameter, the part of it an HF tensor fills (a fused part, or None for all) and
    the part of the HF tensor this rank reads; None for tensors we skip."""
    config = layout.config
    if _IGNORED.search(hf_name):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed_weight", None, ()
    if hf_name == "model.norm.weight":
        return "norm_weight", None, ()
    if hf_name == "lm_head.weight":
        if config.tie_word_embeddings or not layout.has_lm_head:
            return None
        return "lm_head_weight", None, ()
    match = _LAYER.match(hf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise CheckpointError(f"unexpected tensor {hf_name!r} in checkpoint")
    layer = int(match.group(1))
    if layer >= config.num_layers:
        raise CheckpointError(
            f"tensor {hf_name!r} is for layer {layer}, but the model has {config.num_layers}"
        )
    param, part = _LAYER_TENSORS[match.group(2)]
    return f"layers.{layer}.{param}", part, _shard_index(param, part, layout)


def _shard_index(param: str, part: str | None, layout: ShardLayout) -> Index:
    """The rows (column-parallel) or columns (row-parallel) of an HF tensor a rank holds."""
    if layout.size == 1:
        return ()
    d = layout.config.head_dim
    heads = {"q": layout.q_heads, "k": layout.kv_heads, "v": layout.kv_heads}
    if part in heads:
        return (slice(heads[part].start * d, heads[part].stop * d),)
    mlp = slice(layout.mlp_columns.start, layout.mlp_columns.stop)
    if part in ("gate", "up"):
        return (mlp,)
    if param == "o_weight":
        return (slice(None), slice(layout.q_heads.start * d, layout.q_heads.stop * d))
    if param == "down_weight":
        return (slice(None), mlp)
    return ()  # norms; o and down biases are whole, added once after the all-reduce


def _fused_rows(part: str | None, c: ModelConfig) -> slice:
    if part is None:
        return slice(None)
    if part == "q":
        return slice(0, c.q_size)
    if part == "k":
        return slice(c.q_size, c.q_size + c.kv_size)
    if part == "v":
        return slice(c.q_size + c.kv_size, c.qkv_size)
    if part == "gate":
        return slice(0, c.intermediate_size)
    return slice(c.intermediate_size, 2 * c.intermediate_size)  # up


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TPGroup | None = None,
    *,
    progress: bool = True,
) -> LlamaModel:
    """Build the model (this rank's shard of it) for ``model_dir``'s config directly in
    ``dtype`` on ``device``, and load it."""
    layout = shard_layout(read_model_config(model_dir), tp)
    model = empty_model(layout, tp, dtype, device, max_positions)
    load_weights(model, model_dir, layout, progress=progress)
    return model.eval()


def load_gguf_model(
    gguf: GGUFFile,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    *,
    progress: bool = True,
    tp: TPGroup | None = None,
) -> LlamaModel:
    """The model of a GGUF file (this rank's shard), its tensors dequantised (fp32) one at a
    time, then sliced and cast to ``dtype``."""
    config = gguf.model_config()
    layout = shard_layout(config, tp)
    model = empty_model(layout, tp, dtype, device, max_positions)
    tensors = (
        (name, TensorReader.whole(get()), gguf.path.name) for name, get in gguf.hf_tensors(config)
    )
    fill_weights(model, tensors, len(gguf.tensor_names), str(gguf.path), layout, progress=progress)
    return model.eval()


def shard_layout(config: ModelConfig, tp: TPGroup | None) -> ShardLayout:
    """Which part of ``config``'s model ``tp``'s rank holds (all of it without ``tp``)."""
    tp = tp or TPGroup.single()
    return ShardLayout(config, tp.size, tp.rank)


def empty_model(
    layout: ShardLayout,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaModel:
    """This rank's model, its parameters allocated (not filled) in ``dtype`` on ``device``."""
    with torch.device(device):
        model = LlamaModel(
            layout.local_config, max_positions, tp, has_lm_head=layout.has_lm_head
        ).to(dtype)
    # The rotary tables stay fp32: HF computes cos/sin in fp32 and casts per use.
    model.rotary.float()
    return model
