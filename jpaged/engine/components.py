"""An engine's collaborators, built once from a checked config: the model and its
tokenizer, the KV layout and pool size, the block manager, host swap space, the
model runner, LoRA slots, the speculator, the output processor, the scheduler,
the grammar compiler and the input processor.  `EngineCore` drives them; this
module only wires them together (the order matters: the pool is sized after the
weights are on the devices, the scheduler's buckets are the runner's)."""

from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import ml_collections

from jpaged.core.block_manager import BlockManager
from jpaged.core.config import ConfigError, lora_slots, sections
from jpaged.core.kv_layout import KVLayout, kv_layout
from jpaged.core.lora_adapters import parse_lora_modules
from jpaged.core.scheduler import Scheduler
from jpaged.core.swap_space import HostSwapSpace, swap_capacity_blocks
from jpaged.engine.input_processor import InputProcessor
from jpaged.engine.lora_manager import LoraManager
from jpaged.engine.output_processor import OutputProcessor
from jpaged.engine.setup import (LoadedModel, load_model, program_cache_dir, resolve_attention_impl,
                                 resolve_kv_cache_dtype, resolve_layer_loop, size_pool)
from jpaged.engine.speculation import build_speculator
from jpaged.engine.step_stats import StepStats
from jpaged.layers.sharding import Mesh, tensor_parallel_size
from jpaged.runtime.kv_pool import block_shape, bytes_per_block
from jpaged.runtime.model_runner import ModelRunner
from jpaged.structured.grammar import GrammarCompiler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineComponents:
    model: LoadedModel
    scan_layers: bool
    dtype: jnp.dtype
    kv_dtype: jnp.dtype
    attention_impl: str
    attention_note: str  # why attention_impl is not the one asked for ("" when it is)
    kv_layout: KVLayout
    num_blocks: int
    step_stats: StepStats
    block_manager: BlockManager
    swap_space: HostSwapSpace
    runner: ModelRunner
    lora: LoraManager
    speculator: object
    outputs: OutputProcessor
    scheduler: Scheduler
    grammars: GrammarCompiler | None
    inputs: InputProcessor


def swap_capacity(cfg: ml_collections.ConfigDict, block_bytes: int, preemption_mode: str) -> int:
    """Host blocks for swapped-out K/V: swap_space_gb's worth in swap mode, none otherwise."""
    return swap_capacity_blocks(cfg.swap_space_gb, block_bytes) if preemption_mode == "swap" else 0


def build_components(cfg: ml_collections.ConfigDict, mesh: Mesh | None) -> EngineComponents:
    """Loads the model and builds every collaborator of an engine on `mesh`."""
    scan_layers = resolve_layer_loop(cfg.layer_loop)
    dtype = jnp.dtype(cfg.dtype)
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
    attention_impl, attention_note = resolve_attention_impl(cfg.attention_impl)
    if cfg.batch_invariant and attention_impl != "cpu":
        raise ConfigError("batch_invariant", f"needs the C++ CPU attention kernel; attention_impl "
                          f"{cfg.attention_impl!r} runs {attention_impl!r} here", "a CPU backend")
    model = load_model(cfg, mesh, scan_layers)
    layout = kv_layout(model.model_config, cfg.kv_layout)
    num_blocks = size_pool(cfg, model, kv_dtype, tensor_parallel_size(mesh), layout)
    if attention_note:
        log.warning("attention_impl=%s: %s; running the reference", cfg.attention_impl, attention_note)
    step_stats = StepStats(cfg.block_size)
    # The block manager and scheduler count into the engine's totals too.
    block_manager = BlockManager(num_blocks, cfg.block_size, index=cfg.prefix_cache_index,
                                 enable_prefix_caching=cfg.enable_prefix_caching, stats=step_stats.totals,
                                 layout=layout)
    block_bytes = bytes_per_block(model.model_config, cfg.block_size, kv_dtype, layout.layers_per_page)
    swap_space = HostSwapSpace(swap_capacity(cfg, block_bytes, cfg.preemption_mode),
                               block_shape(model.model_config, cfg.block_size, kv_dtype, layout.layers_per_page),
                               kv_dtype)
    engine = sections(cfg).resolved(num_blocks=num_blocks, attention_impl=attention_impl, scan_layers=scan_layers,
                                    matmul_impl=model.matmul_impl)
    runner = ModelRunner(model.graphdef, model.params, model.model_config, engine, layout=layout, mesh=mesh,
                         swap_space=swap_space, program_cache_dir=program_cache_dir(cfg),
                         weight_blocks=model.weight_blocks)
    lora = LoraManager(runner, model.loaded.config, num_slots=lora_slots(cfg),
                       max_rank=cfg.max_lora_rank, tensor_parallel=tensor_parallel_size(mesh))
    for name, path in parse_lora_modules(cfg.lora_modules).items():
        lora.load(name, path)
    speculator = build_speculator(cfg, model.model_config, model.tokenizer, num_blocks)
    outputs = OutputProcessor(model.tokenizer, max_model_len=cfg.max_model_len)
    scheduler = Scheduler(block_manager, engine.scheduler, swap_space=swap_space, token_buckets=runner.token_buckets,
                          stats=step_stats.totals, stops=outputs)
    grammars = (GrammarCompiler(model.tokenizer, model.model_config.vocab_size)
                if model.tokenizer is not None else None)
    inputs = InputProcessor(model.tokenizer, vocab_size=model.model_config.vocab_size,
                            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                            block_size=cfg.block_size, num_blocks=num_blocks, grammars=grammars,
                            has_experts=model.model_config.num_experts > 0)
    return EngineComponents(model, scan_layers, dtype, kv_dtype, attention_impl, attention_note, layout, num_blocks, step_stats,
                            block_manager, swap_space, runner, lora, speculator, outputs, scheduler, grammars,
                            inputs)
