"""specdec: lossless speculative decoding for Hugging Face Qwen3 / Llama checkpoints."""

from specdec.errors import ConfigError, InvalidRequestError, ModelLoadError, SpecdecError
from specdec.llm import LLM, Completion
from specdec.sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams", "SpecdecError", "ModelLoadError", "InvalidRequestError",
           "ConfigError"]
__version__ = "0.1.0"
