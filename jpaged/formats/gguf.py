"""GGUF, llama.cpp's model file: its metadata and memory-mapped tensors, the
config fields every architecture stores alike, tensor-name lookup, and undoing
its quantisation and Q/K row permutation.  Its own module so the tokenizer and
the weight loader share it; each family in `jpaged.models` names its tensors."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import struct
from typing import Any, Callable

import numpy as np

from jpaged.core.model_config import ModelConfig, rope_inv_freq
from jpaged.core.rounding import cdiv


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value metadata of a `gguf.GGUFReader` as plain python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its ggml type and its raw bytes (memory-mapped)."""

    name: str
    tensor_type: int
    data: np.ndarray  # uint8, shaped [*numpy_dims[:-1], bytes per row] as gguf.quants expects


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Parses a GGUF file: (metadata as python values, tensors by name).

    `gguf.GGUFReader` builds a numpy view per metadata item, which takes ~6 s for
    the 100k vocabulary/merge strings of a small model; this struct-based parse of
    the same format (GGUF v2/v3) takes a fraction of a second.  Tensor data stays
    memory-mapped.  A truncated file, or one that is not GGUF at all, raises
    `ValueError("<path>: truncated or not a GGUF file (...)")`.
    """
    path = pathlib.Path(path)
    size = path.stat().st_size
    # np.memmap refuses empty files; the magic check below reports those.
    buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    mv = memoryview(buf)
    pos = 0

    def bad(detail: str) -> ValueError:
        return ValueError(f"{path}: truncated or not a GGUF file ({detail})")

    def take(n: int) -> int:
        """Claims n bytes at the cursor; a length past the end means truncation (or garbage)."""
        nonlocal pos
        if pos + n > size:
            raise bad(f"needs byte {pos + n:,} of a {size:,}-byte file")
        pos += n
        return pos - n

    def unpack(fmt: str) -> Any:
        return struct.unpack_from(fmt, mv, take(struct.calcsize(fmt)))[0]

    def string() -> str:
        n = unpack("<Q")
        start = take(n)
        return bytes(mv[start:start + n]).decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            item_type, count = unpack("<I"), unpack("<Q")
            return [value(item_type) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
            raise bad(f"unknown metadata value type {vtype} before byte {pos:,}")
        return unpack(_GGUF_SCALARS[vtype])

    if bytes(mv[:4]) != b"GGUF":
        raise bad("no GGUF magic at the start")
    pos = 4
    version = unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    n_tensors, n_kv = unpack("<Q"), unpack("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [unpack("<Q") for _ in range(unpack("<I"))]
        infos.append((name, dims, unpack("<I"), unpack("<Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        raise bad(f"general.alignment is {align!r}")
    data_start = cdiv(pos, align) * align
    return meta, {name: GGUFTensor(name, ttype, _gguf_tensor_data(buf, data_start + offset, dims, ttype, bad))
                  for name, dims, ttype, offset in infos}


def _gguf_tensor_data(buf: np.ndarray, start: int, dims: list[int], ttype: int,
                      bad: Callable[[str], ValueError]) -> np.ndarray:
    """A tensor's bytes as the uint8 [*rows, bytes per row] view gguf.quants expects;
    `bad(detail)` builds the error for data that does not fit in the file."""
    from gguf.quants import quant_shape_to_byte_shape
    try:
        byte_shape = quant_shape_to_byte_shape(tuple(reversed(dims)), ttype)  # ggml lists dims reversed
    except (KeyError, IndexError, ValueError) as e:  # an unknown type, or dims it cannot hold
        raise bad(f"tensor of type {ttype} and dims {dims}: {e}") from None
    end = start + math.prod(byte_shape)  # exact python ints: garbage dims must not wrap around
    if end > buf.size:
        raise bad(f"tensor data ends at byte {end:,} of a {buf.size:,}-byte file")
    return buf[start:end].reshape(byte_shape)


def tensor_target(name: str, layer_names: dict[str, tuple[str, bool]],
                  global_names: dict[str, tuple[str, bool]]) -> tuple[str | None, int | None, bool]:
    """llama.cpp tensor name -> (our name, layer index or None, transpose?), by a
    family's maps of global names and of per-layer names (after "blk.N.")."""
    if name in global_names:
        ours, transpose = global_names[name]
        return ours, None, transpose
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        ours, transpose = layer_names[parts[2]]
        return ours, int(parts[1]), transpose
    return None, None, False


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverts llama.cpp's Q/K row permutation (torch [out, ...] layout).

    convert_hf_to_gguf reorders each head's rows from HF's rotate-half layout to
    interleaved pairs: `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`.
    Swapping the same two axes of the transposed shape undoes it.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_base_config(meta: dict[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None = None
                     ) -> dict[str, Any]:
    """The ModelConfig fields every llama.cpp architecture stores alike (`{arch}.*`
    keys); a family adds its own and sets `architecture`."""
    arch = meta["general.architecture"]
    g = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    fields = dict(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv") or heads), head_dim=head_dim,
        rms_norm_eps=_f32(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(g("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(g("context_length", 4096)),
    )
    if rope_freqs is not None:
        fields["rope_scaling"] = _llama3_scaling_from_rope_freqs(ModelConfig(**fields), rope_freqs)
    return fields


def _f32(x: float) -> float:
    """GGUF stores these as float32: 1e-5 reads back as 9.99999974e-06. Keep the
    shortest decimal that rounds to the same float32 (what config.json said)."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> tuple[tuple[str, Any], ...] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return (("factor", float(meta[f"{arch}.rope.scaling.factor"])), ("rope_type", "linear"))
    raise NotImplementedError(f"GGUF rope scaling type {kind!r} is not supported")


def _llama3_scaling_from_rope_freqs(cfg: ModelConfig, rope_freqs: np.ndarray
                                    ) -> tuple[tuple[str, Any], ...] | None:
    """Llama 3.1+ GGUFs store RoPE scaling as per-frequency divisors (`rope_freqs.weight`).

    Our config describes it by Llama 3's parameters instead, so recover them: the
    factor is the largest divisor and the rest are Meta's published defaults; we
    only accept the result if it reproduces the stored divisors.
    """
    factor = float(np.max(rope_freqs))
    if np.allclose(rope_freqs, 1.0):
        return cfg.rope_scaling
    for low, high, orig in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 32768)):
        scaling = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": orig, "rope_type": "llama3"}
        trial = dataclasses.replace(cfg, rope_scaling=tuple(sorted(scaling.items())))
        base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        if np.allclose(base / rope_inv_freq(trial), rope_freqs, rtol=1e-3):
            return trial.rope_scaling
    raise NotImplementedError("GGUF rope_freqs.weight does not match Llama 3 RoPE scaling")


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (= torch) order, i.e. [out, in] for matrices."""
    import gguf
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
