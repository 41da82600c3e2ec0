"""Run summaries: the numbers users judge an engine by."""

from __future__ import annotations

from typing import Any

import numpy as np


def summarize(outputs: list, llm: Any, wall_seconds: float) -> dict[str, float]:
    """Throughput, per-sequence latency and KV usage of one generate() call.

    ms/tok of a sequence is its latency over its generated tokens (TTFT
    included), averaged over sequences: what a user of that request felt.
    """
    ok = [o for o in outputs if o.finish_reason != "error"]
    num_tokens = sum(len(o.token_ids) for o in ok)
    ttft = np.array([o.ttft_ms for o in ok if o.ttft_ms is not None])
    ttft = ttft if ttft.size else np.zeros(1)
    stats = llm.stats  # the last generate() call's window; the snapshot's totals run since start
    snapshot = llm.snapshot()
    step_seconds = stats.device_seconds + stats.host_seconds
    return {
        "requests": len(outputs),
        "errors": len(outputs) - len(ok),
        "output_tokens": num_tokens,
        "wall_s": wall_seconds,
        "output_tok_per_s": num_tokens / wall_seconds if wall_seconds else 0.0,
        "ms_per_tok": float(np.mean([o.latency_ms / len(o.token_ids) for o in ok if o.token_ids])) if ok else 0.0,
        "ttft_mean_ms": float(ttft.mean()),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "peak_kv_blocks": stats.peak_blocks_used,
        "kv_pool_blocks": snapshot.num_blocks - llm.config.data_parallel_size,  # a null block per pool
        "kv_waste_pct": 100 * stats.kv_waste,
        "steps": stats.steps,
        "host_pct": 100 * stats.host_seconds / step_seconds if step_seconds else 0.0,
        "compilations": llm.num_compilations,
        "compile_s": llm.compile_seconds,
        "compile_wait_s": stats.compile_seconds,  # of it, what this run's steps waited for
        **llm.program_build,
        "padding_ratio": stats.padding_ratio,
        "prefix_cache": bool(llm.config.enable_prefix_caching),
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "cache_hit_pct": 100 * stats.cache_hit_rate,
        "shared_blocks_peak": stats.shared_blocks_peak,
        "evictions": stats.evictions,
        "cow_copies": stats.cow_copies,
        "preemption_mode": llm.config.preemption_mode,
        "preemptions": stats.preemptions,
        "recompute_preemptions": stats.recompute_preemptions,
        "swap_preemptions": stats.swap_preemptions,
        "swap_fallbacks": stats.swap_fallbacks,
        "swapped_out_mib": stats.swapped_out_bytes / 2**20,
        "swapped_in_mib": stats.swapped_in_bytes / 2**20,
        "swap_s": stats.swap_seconds,
        "speculative_method": llm.config.speculative_method,
        "spec_decode_num_drafts": stats.spec_decode_num_drafts,
        "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "draft_acceptance_pct": 100 * stats.draft_acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "tokens_per_step": num_tokens / stats.steps if stats.steps else 0.0,
        "memory_per_device": {d: {"weights_bytes": w, "kv_pool_bytes": p}
                              for d, (w, p) in llm.memory_per_device().items()},
        "replicas": llm.replica_summary(),
        **expert_load_summary(llm, stats),
    }


def expert_load_summary(llm: Any, stats: Any) -> dict[str, list]:
    """A MoE model's tokens per expert in each MoE layer, [L_moe][E], when the
    config's expert_load_summary asks (off by default: an ablation's extra lines)."""
    if not llm.config.expert_load_summary or stats.expert_load is None:
        return {}
    return {"expert_load": stats.expert_load.tolist()}


def format_summary(summary: dict[str, float]) -> str:
    rows = [
        ("requests (errors)", f"{summary['requests']} ({summary['errors']})"),
        ("output tokens", f"{summary['output_tokens']}"),
        ("wall time (generate)", f"{summary['wall_s']:.2f} s"),
        ("total output tok/s", f"{summary['output_tok_per_s']:.1f}"),
        ("avg ms/tok per sequence", f"{summary['ms_per_tok']:.1f}"),
        ("TTFT mean / p50 / p99", f"{summary['ttft_mean_ms']:.0f} / {summary['ttft_p50_ms']:.0f} / "
                                  f"{summary['ttft_p99_ms']:.0f} ms"),
        ("peak KV blocks in use", f"{summary['peak_kv_blocks']} of {summary['kv_pool_blocks']}"),
        ("KV waste", f"{summary['kv_waste_pct']:.1f} %"),
        ("steps (host share)", f"{summary['steps']} ({summary['host_pct']:.1f} % host)"),
        ("compilations (compile time)", f"{summary['compilations']} ({summary['compile_s']:.1f} s)"),
    ]
    if "programs_loaded" in summary:
        rows.append(("program build", f"trace+lower {summary['trace_lower_s']:.1f} s, compile "
                                      f"{summary['xla_compile_s']:.1f} s, loaded {summary['load_s']:.1f} s "
                                      f"({summary['programs_loaded']} of {summary['compilations']} from disk); "
                                      f"steps waited {summary['compile_wait_s']:.1f} s"))
    rows += [
        ("token slots / real tokens", f"{summary['padding_ratio']:.3f}"),
    ]
    if "cache_hit_pct" in summary:
        rows.append(("prefix cache hit rate",
                     f"{summary['cache_hit_pct']:.1f} % ({summary['cached_prompt_tokens']} of "
                     f"{summary['prompt_tokens']} prompt tokens)" if summary["prefix_cache"] else "off"))
        rows.append(("shared blocks (peak) / evictions / CoW",
                     f"{summary['shared_blocks_peak']} / {summary['evictions']} / {summary['cow_copies']}"))
    if "preemptions" in summary:
        rows.append((f"preemptions ({summary['preemption_mode']})",
                     f"{summary['preemptions']} (recompute {summary['recompute_preemptions']}, swap "
                     f"{summary['swap_preemptions']}, swap->recompute fallbacks {summary['swap_fallbacks']})"))
        if summary["swap_preemptions"] or summary["swapped_out_mib"]:
            rows.append(("swapped out / in", f"{summary['swapped_out_mib']:.1f} / "
                                             f"{summary['swapped_in_mib']:.1f} MiB "
                                             f"({summary['swap_s']:.2f} s copying)"))
    if summary.get("speculative_method", "none") != "none":
        rows.append((f"speculative decoding ({summary['speculative_method']})",
                     f"{summary['spec_decode_num_accepted_tokens']} of {summary['spec_decode_num_draft_tokens']} "
                     f"draft tokens accepted ({summary['draft_acceptance_pct']:.1f} %), mean accepted length "
                     f"{summary['mean_accepted_length']:.2f}, {summary['tokens_per_step']:.2f} output tokens "
                     f"per step"))
    for layer, load in enumerate(summary.get("expert_load", [])):
        mean = sum(load) / len(load)
        rows.append((f"expert load, MoE layer {layer}", f"max / mean {max(load) / mean if mean else 0.0:.2f}: "
                                                        + " ".join(map(str, load))))
    if "process_wall_s" in summary:  # serve_batch: start-up (load, compiles) included
        rows.insert(3, ("wall time (whole run)", f"{summary['process_wall_s']:.2f} s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if "memory_per_device" in summary:
        memory = {d: (m["weights_bytes"], m["kv_pool_bytes"]) for d, m in summary["memory_per_device"].items()}
        lines.append(format_memory(memory))
    if summary.get("replicas"):
        lines.append(format_replicas(summary["replicas"]))
    return "\n".join(lines)


def format_memory(memory: dict[str, tuple[int, int]]) -> str:
    """One line per device: the bytes of weights and of KV pool it holds."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    return "\n".join(f"memory on {d}: weights {mib(w)}, KV pool {mib(p)}" for d, (w, p) in memory.items())


def format_replicas(replicas: list[dict]) -> str:
    """The load of each data-parallel replica in the last run."""
    head = f"{'replica':<8} {'devices':<14} {'requests':>8} {'prompt tok':>10} {'hits@route':>10} " \
           f"{'output tok':>10} {'steps':>6} {'peak blocks':>11}"
    rows = [f"{r['replica']:<8} {','.join(r['devices']):<14} {r['requests']:>8} {r['prompt_tokens']:>10} "
            f"{r['cached_prompt_tokens']:>10} {r['output_tokens']:>10} {r['steps']:>6} {r['peak_kv_blocks']:>11}"
            for r in replicas]
    return "\n".join([head, *rows])
