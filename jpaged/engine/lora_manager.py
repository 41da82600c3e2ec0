"""Which LoRA adapter holds which device slot: loading, replacing and unloading them.

The device side (the slots' arrays, and the step that applies them) is
`jpaged.layers.lora`; the runner owns those arrays and this class hands it one
adapter's host arrays at a time.  A request names its adapter
(SamplingParams.lora); `binding(name)` gives the Sequence its slot and the
adapter's prefix-cache identity, `(name, serial)`: every load or weight update
takes a new serial, so K/V computed under an adapter's old weights (or under
another adapter of the same name) is never reused.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jpaged.core.model_config import ModelConfig
from jpaged.core.lora_adapters import check_adapter_name
from jpaged.loading.peft import LoraAdapter, load_peft_adapter, lora_from_arrays
from jpaged.layers.sharding import replicate_kv_heads


class UnknownLoraError(KeyError):
    """A request named an adapter that is not loaded (the server answers 404)."""

    def __str__(self) -> str:
        return self.args[0]


@dataclasses.dataclass
class LoadedLora:
    name: str
    path: str
    slot: int
    serial: int
    rank: int


class LoraManager:
    """`num_slots` adapter slots of rank <= `max_rank` on `runner` (0 slots: adapters off).
    `base_cfg` is the checkpoint's own config (adapters are checked against it);
    with fewer KV heads than `tensor_parallel` devices the engine repeats KV
    heads, and so do the adapters' k/v updates."""

    def __init__(self, runner, base_cfg: ModelConfig, *, num_slots: int, max_rank: int, tensor_parallel: int = 1):
        self.runner, self.base_cfg = runner, base_cfg
        self.num_slots, self.max_rank, self.tensor_parallel = num_slots, max_rank, tensor_parallel
        self.adapters: dict[str, LoadedLora] = {}
        self._serial = 0

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def binding(self, name: str | None) -> tuple[int, tuple | None]:
        """(slot, prefix-cache key) of a request's adapter: (-1, None) for the base model;
        UnknownLoraError for a name that is not loaded."""
        if name is None:
            return -1, None
        lora = self.adapters.get(name)
        if lora is None:
            have = ", ".join(sorted(self.adapters)) or "none"
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded (loaded: {have})")
        return lora.slot, (lora.name, lora.serial)

    def load(self, name: str, path: str | os.PathLike) -> LoadedLora:
        """Reads a PEFT directory into a free slot; ValueError (naming the file and the
        problem) for a bad name (jpaged.core.lora_adapters.ADAPTER_NAME_RULE), a bad adapter,
        a name already loaded, or no free slot.  `path` may be the directory's
        PeftFiles, read beforehand off the engine thread (the server does): then only
        the fitting to the model and the slot's write happen here."""
        check_adapter_name(name)
        self._check_free(name)
        return self._install(load_peft_adapter(name, path, self.base_cfg, max_rank=self.max_rank))

    def update(self, name: str, modules: dict[str, tuple[np.ndarray, np.ndarray]]) -> LoadedLora:
        """New weights for a loaded adapter (target -> A [L, in, r], B [L, r, out], scale
        folded into B), in its slot; a new serial (its cached K/V is not reused)."""
        old = self.adapters.get(name)
        if old is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
        adapter = lora_from_arrays(name, modules, self.base_cfg, max_rank=self.max_rank)
        return self._install(dataclasses.replace(adapter, path=old.path), slot=old.slot)

    def unload(self, name: str) -> LoadedLora:
        """Frees the adapter's slot (its arrays stay until another adapter overwrites them:
        no request can name it any more)."""
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
        return lora

    def _check_free(self, name: str) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters are off: start the engine with max_loras > 0 (or lora_modules)")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        if len(self.adapters) >= self.num_slots:
            raise ValueError(f"all {self.num_slots} LoRA slots (max_loras) are in use: unload an adapter first")

    def _install(self, adapter: LoraAdapter, slot: int | None = None) -> LoadedLora:
        if slot is None:
            used = {lora.slot for lora in self.adapters.values()}
            slot = min(set(range(self.num_slots)) - used)
        self.runner.write_lora_slot(slot, self._for_engine(adapter.modules))
        self._serial += 1
        lora = LoadedLora(adapter.name, adapter.path, slot, self._serial, adapter.rank)
        self.adapters[adapter.name] = lora
        return lora

    def _for_engine(self, modules: dict[str, tuple[np.ndarray, np.ndarray]]
                    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The k/v updates' outputs repeated per KV head as the engine repeats the heads."""
        b_kv = {f"layers.{n}": modules[n][1] for n in ("wk", "wv") if n in modules}
        if not b_kv:
            return modules
        _, repeated = replicate_kv_heads(self.base_cfg, b_kv, self.tensor_parallel)
        return {n: (a, repeated.get(f"layers.{n}", b)) for n, (a, b) in modules.items()}
