"""jpaged: a JAX/Pallas LLM inference engine with a paged KV cache.

    from jpaged import LLM, SamplingParams

The names below load on first use, so that importing a host-only subpackage
(jpaged.core) does not import jax.
"""

import importlib

_EXPORTS = {
    "LLM": "jpaged.engine.llm",
    "RequestOutput": "jpaged.engine.output_processor",
    "SamplingParams": "jpaged.core.sequence",
    "StructuredOutputs": "jpaged.structured.spec",
    "DataParallelLLM": "jpaged.engine.router",
    "create_engine": "jpaged.engine.router",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
