"""File formats read without jax: GGUF (and safetensors, in jpaged.loading.weights), below every
package that reads a checkpoint (loading, models, tokenizer)."""
