"""A quantised GGUF's blocks read by the CPU decode kernels (config gguf_blocks).

The kernel contract: with blocks registered for a weight's buffer, skinny_matmul_cpu
gives bit for bit what it gives for the dequantised weight read transposed, and
exactly the old result once they are unregistered.  The engine: a tiny Llama GGUF
written the way llama.cpp writes one (Q/K rows permuted; Q4_0, Q4_1 and Q8_0
matrices, a tied head) holds blocks that dequantise to exactly its float32 params;
its decode steps read them, with the tokens of the float32 path; replaced weights
(update_params, sleep) release them, and waking from level 1 registers them again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_ENGINE, random_prompts
from jpaged.core.sequence import SamplingParams
from jpaged.loading.gguf_blocks import Q4_0, Q4_1, Q8_0, BlockMatrix, block_matrix, read_block_matrices
from jpaged.models import gguf_family
from pallas_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")

H, F, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256
HEAD_DIM = H // HEADS
# ggml type of each of a layer's matrices: all three block types, and Q/K (permuted rows) in two.
LAYER_TYPES = {"attn_q": Q4_1, "attn_k": Q4_0, "attn_v": Q8_0, "attn_output": Q4_1,
               "ffn_gate": Q4_0, "ffn_up": Q4_1, "ffn_down": Q8_0}
SHAPES = {"attn_q": (H, H), "attn_k": (KV_HEADS * HEAD_DIM, H), "attn_v": (KV_HEADS * HEAD_DIM, H),
          "attn_output": (H, H), "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}


def _random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> BlockMatrix:
    scales = rng.uniform(0.005, 0.05, (n, k // 32)).astype(np.float16).astype(np.float32)
    if kind == "q8":
        return BlockMatrix("q8", rng.integers(-128, 128, (n, k), dtype=np.int8), scales, None)
    offsets = rng.uniform(-0.3, 0.0, (n, k // 32)).astype(np.float16).astype(np.float32)
    return BlockMatrix("q4", rng.integers(0, 256, (n, k // 2), dtype=np.uint8), scales, offsets)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("n,k", [(64, 64), (200, 96), (13, 32)])
def test_registered_blocks_give_the_transposed_kernels_result(kind, n, k):
    rng = np.random.default_rng(n + k)
    blocks = _random_blocks(kind, n, k, rng)
    dense = blocks.dequantize()
    kn = jax.jit(lambda x, w: cpu.skinny_matmul_cpu(x, w))
    nt = jax.jit(lambda x, w: cpu.skinny_matmul_cpu(x, w, transpose_b=True))
    for weight, call, transposed in ((jnp.asarray(np.ascontiguousarray(dense.T)), kn, False),
                                     (jnp.asarray(dense), nt, True)):
        for m in (1, 4, 9, 16):
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            want = np.asarray(nt(x, jnp.asarray(dense)))  # the transposed kernel on the float32 weights
            before = np.asarray(call(x, weight))
            calls = cpu.block_matmul_calls()
            address = cpu.register_block_weights(weight, kind, blocks.codes, blocks.scales, blocks.offsets,
                                                 transposed=transposed)
            try:
                got = np.asarray(call(x, weight))
            finally:
                assert cpu.unregister_block_weights(address)
            assert cpu.block_matmul_calls() == calls + 1
            np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(got, np.asarray(x, np.float64) @ dense.T.astype(np.float64),
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(call(x, weight)), before)  # unregistered: as before
            assert cpu.block_matmul_calls() == calls + 1


def test_a_square_weight_is_read_only_in_its_registered_layout():
    """[K, K] blocks registered for a [K, N] buffer: a call reading that buffer
    transposed multiplies by the buffer's transpose, not by the blocks' matrix."""
    rng = np.random.default_rng(5)
    blocks = _random_blocks("q4", 64, 64, rng)
    weight = jnp.asarray(np.ascontiguousarray(blocks.dequantize().T))
    x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    nt = jax.jit(lambda x, w: cpu.skinny_matmul_cpu(x, w, transpose_b=True))
    want = np.asarray(nt(x, weight))
    calls = cpu.block_matmul_calls()
    address = cpu.register_block_weights(weight, "q4", blocks.codes, blocks.scales, blocks.offsets)
    try:
        np.testing.assert_array_equal(np.asarray(nt(x, weight)), want)
    finally:
        cpu.unregister_block_weights(address)
    assert cpu.block_matmul_calls() == calls


def test_block_matrix_reads_what_gguf_dequantizes():
    from gguf.quants import GGMLQuantizationType, dequantize, quantize
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    for qtype in (Q4_0, Q4_1, Q8_0):
        data = quantize(w, GGMLQuantizationType(qtype))
        np.testing.assert_array_equal(block_matrix(qtype, data).dequantize(),
                                      dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32))


def test_registration_checks_its_arrays():
    blocks = _random_blocks("q4", 16, 64, np.random.default_rng(1))
    weight = jnp.zeros((64, 16), jnp.float32)
    with pytest.raises(ValueError, match="kind must be one of"):
        cpu.register_block_weights(weight, "q5", blocks.codes, blocks.scales, blocks.offsets)
    with pytest.raises(ValueError, match="offsets must be"):
        cpu.register_block_weights(weight, "q4", blocks.codes, blocks.scales, None)
    with pytest.raises(ValueError, match="the weight must be one float32"):
        cpu.register_block_weights(jnp.zeros((64, 17), jnp.float32), "q4", blocks.codes, blocks.scales,
                                   blocks.offsets)
    with pytest.raises(ValueError, match="the weight must be one float32"):  # [N, K] needs transposed=True
        cpu.register_block_weights(jnp.zeros((16, 64), jnp.float32), "q4", blocks.codes, blocks.scales,
                                   blocks.offsets)
    assert not cpu.unregister_block_weights(12345)


# ------------------------------------------------------------------ the engine
def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A tiny Llama GGUF with block-quantised matrices and a tied head (no output.weight)."""
    import gguf
    from gguf.quants import quantize
    path = tmp_path_factory.mktemp("gguf-blocks") / "tiny-llama-q.gguf"
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    tokens = ["<pad>", "<bos>", "<eos>"] + [f"<t{i}>" for i in range(3, VOCAB)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add_quantized(name: str, array: np.ndarray, qtype: int) -> None:
        w.add_tensor(name, quantize(array, gguf.GGMLQuantizationType(qtype)),
                     raw_dtype=gguf.GGMLQuantizationType(qtype))

    # Matrices N(0, 0.2) as the suite's tiny models (decisive greedy tokens), norms near 1.
    add_quantized("token_embd.weight", (0.2 * rng.standard_normal((VOCAB, H))).astype(np.float32), Q8_0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for layer in range(LAYERS):
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{name}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for name, qtype in LAYER_TYPES.items():
            array = (0.2 * rng.standard_normal(SHAPES[name])).astype(np.float32)
            if name in ("attn_q", "attn_k"):
                array = _permute_qk(array, HEADS if name == "attn_q" else KV_HEADS)
            add_quantized(f"blk.{layer}.{name}.weight", array, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


ENGINE = {**TINY_ENGINE, "load_format": "gguf", "layer_loop": "unroll", "matmul_impl": "cpu"}
PROMPTS = random_prompts([5, 19, 11], seed=3)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def dense(gguf_path):
    from jpaged.engine.llm import LLM
    llm = LLM(model=gguf_path, **ENGINE, gguf_blocks=False)
    assert llm.runner.registered_blocks is None
    return llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def blocks_llm(gguf_path):
    from jpaged.engine.llm import LLM
    return LLM(model=gguf_path, **ENGINE)


def test_blocks_dequantise_to_the_params(gguf_path, blocks_llm):
    """Every registered matrix's blocks are exactly its float32 params, rows in order."""
    llm = blocks_llm
    blocks = read_block_matrices(gguf_path, llm.model_config, gguf_family)
    assert len(blocks) == 7 * LAYERS + 1 and ("embed", None) in blocks  # the tied head
    assert len(llm.runner.registered_blocks) == len(blocks)
    for (name, layer), matrix in blocks.items():
        if layer is None:
            np.testing.assert_array_equal(matrix.dequantize(), np.asarray(llm.params[name][...]))
        else:
            param = np.asarray(llm.params["layers"][layer][name.split(".", 1)[1]][...])
            np.testing.assert_array_equal(matrix.dequantize(), param.T)


def test_decode_reads_the_blocks_with_the_float32_tokens(blocks_llm, dense):
    calls = cpu.block_matmul_calls()
    outs = blocks_llm.generate(PROMPTS, GREEDY)
    assert cpu.block_matmul_calls() > calls
    assert [o.token_ids for o in outs] == [o.token_ids for o in dense]
    for got, want in zip(outs, dense):  # the same sums in another order
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs],
                                   atol=1e-4)


def test_replaced_weights_release_the_blocks(blocks_llm, dense):
    llm = blocks_llm
    same = jax.tree.map(lambda a: a + 0, llm.params)  # equal values, other buffers
    llm.update_params(same)
    assert llm.runner.registered_blocks is None
    calls = cpu.block_matmul_calls()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in dense]
    assert cpu.block_matmul_calls() == calls  # the float32 params, not the old weights' blocks


def test_waking_from_level_1_registers_the_blocks_again(gguf_path, dense):
    from jpaged.engine.llm import LLM
    llm = LLM(model=gguf_path, **ENGINE)
    count = len(llm.runner.registered_blocks)
    llm.sleep(level=1)
    assert llm.runner.registered_blocks is None
    llm.wake_up()
    assert len(llm.runner.registered_blocks) == count
    calls = cpu.block_matmul_calls()
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in dense]
    assert cpu.block_matmul_calls() > calls


def test_a_scanned_loop_registers_only_the_head(gguf_path):
    from jpaged.engine.llm import LLM
    llm = LLM(model=gguf_path, **{**ENGINE, "layer_loop": "scan"})
    assert len(llm.runner.registered_blocks) == 1
