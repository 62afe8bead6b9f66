"""megaflex.model: the GPT language model, its config and the layer-factory interface."""

from megaflex.model.config import ModelConfig
from megaflex.model.gpt import GPT, IGNORE_INDEX, GPTState, ModelOutput
from megaflex.model.layers import LayerFactory, LocalLayers

__all__ = ["GPT", "GPTState", "IGNORE_INDEX", "LayerFactory", "LocalLayers", "ModelConfig", "ModelOutput"]
