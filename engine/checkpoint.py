"""Opens a model by what the user named: a Hugging Face checkpoint directory, a .gguf file, a
named model (``smollm2-135m``, pulled into the model cache when missing), or ``tiny``."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import named_models
from engine.errors import CheckpointError
from engine.gguf_file import GGUFFile
from engine.loader import (
    TensorReader,
    empty_model,
    fill_weights,
    load_gguf_model,
    load_model,
    read_model_config,
    shard_layout,
)
from engine.model import LlamaModel
from engine.tiny import TINY_CONFIG, TINY_NAME, build_tiny_model, tiny_hf_tensors, tiny_tokenizer
from engine.tokenizer import HFTokenizer, Tokenizer
from engine.tp_group import TPGroup


def local_path(source: str | Path) -> Path:
    """The file or directory a source names (a named model resolves to its cached file,
    pulled first when missing); raises CheckpointError when there is none."""
    if named_models.is_named_model(source):
        return named_models.resolve(str(source))
    path = Path(source)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a .gguf file")
    raise CheckpointError(
        f"model {str(source)!r} not found: give a checkpoint directory, a .gguf file, "
        f"'{TINY_NAME}', or a named model ({', '.join(sorted(named_models.NAMED_MODELS))})"
    )


def served_name(source: str | Path) -> str:
    """What clients call the model by default: its name, or the directory's or file's base
    name (never an absolute path)."""
    if str(source) == TINY_NAME or named_models.is_named_model(source):
        return str(source)
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.resolve().name


class Checkpoint:
    """An opened model source: its config at once, its weights and tokenizer on demand. A
    GGUF file is parsed once however many of them are asked for."""

    def __init__(self, source: str | Path) -> None:
        self.source = str(source)
        self.path: Path | None = None
        self._gguf: GGUFFile | None = None
        if self.source == TINY_NAME:
            self.config = TINY_CONFIG
            return
        self.path = local_path(source)
        if self.path.is_file():
            self._gguf = GGUFFile(self.path)
            self.config = self._gguf.model_config()
        else:
            self.config = read_model_config(self.path)

    def load_model(
        self,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        tp: TPGroup | None = None,
        *,
        progress: bool,
    ) -> LlamaModel:
        """The model, or under tensor parallelism ``tp``'s rank's shard of it."""
        if self.path is None:
            if tp is None or tp.size == 1:
                return build_tiny_model(dtype, device, max_positions)
            return self._tiny_shard(dtype, device, max_positions, tp)
        if self._gguf is not None:
            return load_gguf_model(
                self._gguf, dtype, device, max_positions, progress=progress, tp=tp
            )
        return load_model(self.path, dtype, device, max_positions, tp, progress=progress)

    def _tiny_shard(self, dtype, device, max_positions, tp: TPGroup) -> LlamaModel:
        layout = shard_layout(TINY_CONFIG, tp)
        model = empty_model(layout, tp, dtype, device, max_positions)
        tensors = tiny_hf_tensors()
        readers = ((name, TensorReader.whole(t), "tiny") for name, t in tensors.items())
        fill_weights(model, readers, len(tensors), TINY_NAME, layout, progress=False)
        return model.eval()

    def gemm_blocks(self, model: LlamaModel) -> list:
        """(dense weight, GGUF blocks) for the GEMM weights of a whole fp32 model loaded from
        a GGUF file (engine.quantized_weights); empty for any other model."""
        if self._gguf is None or model.embed_weight.dtype != torch.float32:
            return []
        if model.embed_weight.device.type != "cpu" or model.tp.size != 1:
            return []
        from engine.quantized_weights import gguf_gemm_blocks

        with torch.inference_mode():
            return gguf_gemm_blocks(self._gguf, model)

    def tokenizer(self) -> Tokenizer:
        if self.path is None:
            return tiny_tokenizer()
        if self._gguf is not None:
            return HFTokenizer.from_gguf(self._gguf)
        return HFTokenizer.from_directory(self.path, eos_token_ids=self.config.eos_token_ids)
