"""megaflex.hf: megaflex models as Hugging Face ``transformers`` models.

Importing this package registers ``FlexformerConfig`` / ``FlexformerForCausalLM`` with
``AutoConfig`` and ``AutoModelForCausalLM`` (model_type "flexformer"), so
``AutoModelForCausalLM.from_pretrained(dir)`` loads a directory written by ``megaflex-export``.
Exports also carry the modelling code (``auto_map``) for ``trust_remote_code=True`` users
without megaflex; see ``megaflex.hf.remote_code``.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from megaflex.hf.configuration import MODEL_TYPE, FlexformerConfig
from megaflex.hf.modeling import FlexformerCache, FlexformerForCausalLM

AutoConfig.register(MODEL_TYPE, FlexformerConfig, exist_ok=True)
AutoModelForCausalLM.register(FlexformerConfig, FlexformerForCausalLM, exist_ok=True)

__all__ = ["FlexformerCache", "FlexformerConfig", "FlexformerForCausalLM"]
