"""A session: one compiled module, its parameters and its state on one device.

It owns the IREE instance, the device (the driver the manifest names, or `device=` such as
"local-sync" or "vulkan://0"), the parameter archive and the module. A `Sequence` is one
sequence's state buffers and position: the session has a default one (kimi-run), and a server
opens one per slot, so several sequences share one module and one copy of the weights. State
never leaves the device between calls: each call's returned state arrays are the next call's
inputs (IREE updates them in place, so the inputs are donated).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RuntimeUsageError
from .manifest import Manifest

# drivers that can run a module built for a given driver
COMPATIBLE_DRIVERS = {"local-task": {"local-task", "local-sync"}, "local-sync": {"local-task", "local-sync"}}


def open_device(module_driver: str, requested: str | None):
    """The device for a module built for `module_driver`; `requested` is a driver or driver://path URI."""
    import iree.runtime as rt

    uri = requested or module_driver
    driver = uri.split("://", 1)[0]
    available = rt.query_available_drivers()
    if driver not in available:
        raise RuntimeUsageError(f"driver {driver!r} is not available here (available: {', '.join(sorted(available))})")
    if driver not in COMPATIBLE_DRIVERS.get(module_driver, {module_driver}):
        raise RuntimeUsageError(f"--device {uri}: the module was compiled for the {module_driver} driver")
    try:
        return rt.get_device(uri, cache=False)
    except Exception as e:
        raise RuntimeUsageError(f"driver {driver!r}: no usable device for {uri} ({str(e).splitlines()[0]})") from None


def read_staged(device, array) -> np.ndarray:
    """Copy a device array into a host-local, device-visible buffer on the device queue, then map it."""
    import iree.runtime as rt

    view = array._buffer_view
    nbytes = view.byte_length
    staging = device.allocator.allocate_buffer(
        memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
        allowed_usage=rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED,
        allocation_size=nbytes)
    semaphore = device.create_semaphore(0)
    device.queue_copy(view.get_buffer(), staging, wait_semaphores=[], signal_semaphores=[(semaphore, 1)])
    rt.HalFence.create_at(semaphore, 1).wait()
    return staging.map().asarray(array.shape, array.dtype).copy()


@dataclass
class Sequence:
    """One sequence's state on the device: the module's state arrays and the tokens they hold."""
    state: list
    position: int = 0


class Session:
    def __init__(self, path: str | Path, device: str | None = None):
        import iree.runtime as rt

        self.manifest = Manifest.load(path)
        self.directory: Path = self.manifest.directory
        module = self.manifest.module
        self.max_context: int = module.max_context
        self.prefill_block: int = module.prefill_block
        self.vocab_size: int = self.manifest.vocab_size
        self.eos_ids: list[int] = self.manifest.eos_token_ids
        self.state_layout = module.state
        self.device_uri = device or module.driver
        self.device = open_device(module.driver, device)
        self._check_device()
        for attempt in (1, 2):
            if attempt == 2:
                self.device = open_device(module.driver, device)
            try:
                self.context = self._load_module(rt)
                break
            except Exception as e:
                reason = str(e).splitlines()[0]
                # lavapipe has failed the initializer's parameter upload once in CI (DATA_LOSS at
                # hal.fence.await; 40 loads of the same module in a loop never failed): a GPU driver's
                # asynchronous failure gets one more try on a fresh device, a CPU one none.
                if attempt == 2 or module.driver.startswith("local-"):
                    raise RuntimeUsageError(f"{self.directory / module.file}: cannot load ({reason})") from None
                print(f"warning: {self.directory / module.file}: loading on {self.device_uri} failed ({reason}); "
                      "retrying once on a fresh device", file=sys.stderr)
        functions = self.context.modules.module
        self._prefill, self._decode, self._head = functions.prefill, functions.decode, functions.head
        self._staged_reads = False
        self.reset()

    def _load_module(self, rt):
        """Parameters and module on self.device; the context (which keeps its config) runs the
        initializers that upload the weights."""
        config = rt.Config(device=self.device)
        params = rt.ParameterIndex()
        params.load(str(self.directory / self.manifest.parameters.file))
        param_module = rt.create_io_parameters_module(
            config.vm_instance, params.create_provider(scope=self.manifest.parameters.scope))
        vm_module = rt.VmModule.mmap(config.vm_instance, str(self.directory / self.manifest.module.file))
        return rt.SystemContext(vm_modules=[param_module, vm_module], config=config)

    def _check_device(self) -> None:
        """A SPIR-V module assumes subgroup sizes; on a device with another one its reductions give
        wrong numbers without any error (IREE_NOTES §8), so refuse to run it."""
        module = self.manifest.module
        sizes = module.subgroup_sizes
        if module.driver != "vulkan" or sizes is None:
            return
        from .devices import query_host_device
        device = query_host_device()
        if device is None:
            raise RuntimeUsageError(f"module built for Vulkan profile {module.vulkan_profile} (subgroup size "
                                    f"{'/'.join(map(str, sizes))}): cannot read this device's subgroup size "
                                    "(install vulkan-tools)")
        if device.subgroup_size not in sizes:
            raise RuntimeUsageError(f"module built for Vulkan profile {module.vulkan_profile} assumes subgroup "
                                    f"size {'/'.join(map(str, sizes))}, but {device.name} has "
                                    f"{device.subgroup_size}: it would compute wrong numbers; recompile with "
                                    "--target vulkan --arch host")

    # ------------------------------------------------------------------ state
    def new_sequence(self) -> Sequence:
        """An empty sequence: every state buffer zero, position 0."""
        import iree.runtime as rt
        return Sequence([rt.asdevicearray(self.device, np.zeros(s.shape, dtype=s.dtype)) for s in self.state_layout])

    def reset(self) -> None:
        """The default sequence emptied."""
        self.sequence = self.new_sequence()

    @property
    def position(self) -> int:
        return self.sequence.position

    def _read(self, array) -> np.ndarray:
        """A device array as numpy, a copy the caller owns. Some drivers (Vulkan on lavapipe) cannot import
        host memory, which `to_host()` needs; there the bytes go through a host-visible staging buffer.
        On local-task `to_host()` maps the result buffer itself, which a later call may reuse."""
        if not self._staged_reads:
            try:
                return array.to_host().copy()
            except ValueError:              # "could not import host allocation"
                self._staged_reads = True
        return read_staged(self.device, array)

    def check_vocabulary(self, ids: list[int]) -> None:
        """Refuse ids outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RuntimeUsageError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def check_tokens(self, ids: list[int], sequence: Sequence | None = None) -> None:
        """Refuse ids outside the vocabulary or past the max context, before anything runs."""
        position = (sequence or self.sequence).position
        self.check_vocabulary(ids)
        if position + len(ids) > self.max_context:
            raise RuntimeUsageError(f"{position + len(ids)} tokens exceed the module's max context "
                                    f"{self.max_context} (recompile with a larger --max-context)")

    # ---------------------------------------------------------------- compute
    def prefill(self, ids: list[int], all_logits: bool = False, sequence: Sequence | None = None) -> np.ndarray:
        """Feed tokens in prefill blocks. Returns the last token's logits [vocab], or [len, vocab]."""
        sequence = sequence or self.sequence
        ids = [int(t) for t in ids]
        if not ids:
            raise RuntimeUsageError("empty prompt")
        self.check_tokens(ids, sequence)
        P = self.prefill_block
        outputs = []
        for lo in range(0, len(ids), P):
            logits = self.prefill_block_of(ids[lo: lo + P], sequence, all_logits=all_logits,
                                           want_logits=lo + P >= len(ids))
            if logits is not None:
                outputs.append(logits)
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def prefill_block_of(self, chunk: list[int], sequence: Sequence, all_logits: bool = False,
                         want_logits: bool = True) -> np.ndarray | None:
        """One prefill call over at most `prefill_block` tokens (a server interleaves these with other
        sequences' decode steps). Returns the last token's logits [vocab], every position's [len, vocab]
        with `all_logits`, or None when neither is wanted (reading them back costs a copy)."""
        P = self.prefill_block
        if not 0 < len(chunk) <= P:
            raise RuntimeUsageError(f"a prefill block holds 1..{P} tokens, got {len(chunk)}")
        block = np.zeros((1, P), dtype=np.int32)
        block[0, : len(chunk)] = chunk
        result = self._prefill(block, np.array(len(chunk), dtype=np.int32), *sequence.state)
        sequence.state = list(result[2:])
        sequence.position += len(chunk)
        if all_logits:                      # every position: the output head over the block's hidden states
            return self._read(self._head(result[1]))[0, : len(chunk)]
        return self._read(result[0])[0] if want_logits else None

    def decode(self, token: int, sequence: Sequence | None = None) -> np.ndarray:
        """One token -> next-token logits [vocab]."""
        sequence = sequence or self.sequence
        self.check_tokens([int(token)], sequence)
        result = self._decode(np.array([token], dtype=np.int32), *sequence.state)
        sequence.state = list(result[1:])
        sequence.position += 1
        return self._read(result[0])[0]
