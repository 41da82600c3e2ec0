"""Runs a batch of prompts through jpaged: `jpaged batch` from a checkout.

    python scripts/serve_batch.py [--config configs/smollm2_135m.py] [--config.block_size=32 ...] \
        [--prompts prompts.jsonl] [--output out.jsonl [--resume]]

The command lives in jpaged/entrypoints/batch.py (its docstring lists every flag).
"""

from jpaged.entrypoints import batch

if __name__ == "__main__":
    batch.main()
