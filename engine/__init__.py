"""kvlayer's bundled reference engine: a compact Llama-family engine with a paged KV cache.

``from kvlayer.engine import LLM, SamplingParams``; see ``kvlayer.engine.llm``.
"""

from kvlayer.engine.llm import LLM, LLMEngine
from kvlayer.engine.outputs import CompletionOutput, RequestOutput
from kvlayer.engine.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]

