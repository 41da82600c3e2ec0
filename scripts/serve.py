"""Serves a model over an OpenAI-compatible HTTP API: `jpaged serve` from a checkout.

    python scripts/serve.py [--config configs/smollm2_135m.py] [--host 127.0.0.1] [--port 8000] \
        [--config.max_num_seqs=16 ...] [--precompile]

The command lives in jpaged/entrypoints/serve.py (its docstring lists every flag).
"""

from jpaged.entrypoints import serve

if __name__ == "__main__":
    serve.main()
