"""jpaged: a JAX/Pallas LLM inference engine with a paged KV cache."""
