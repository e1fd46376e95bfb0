"""A session: one compiled module, its parameters and its state on one device.

It owns the IREE instance, the device (the driver the manifest names, or `device=` such as
"local-sync" or "vulkan://0"), the parameter archive and the module. A `Sequence` is one
sequence's place in the state and its position: the session has a default one (kimi-run), and a
server opens one per request, so several sequences share one module and one copy of the weights.

A batch-1 module gives each sequence state buffers of its own, and a call runs one sequence. A
batched module (`kimi-compile --max-batch N`) has one set of state buffers with a row per
sequence slot: a sequence holds a row until `release`, and one call runs every row, each at its
own position, the rows with nothing to do at length 0 (the module leaves them as they were). A
row's first call at position 0 starts it afresh, so a released row needs no reset.

State never leaves the device between calls: each call's returned state arrays are the next
call's inputs (IREE updates them in place, so the inputs are donated).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RuntimeUsageError
from .manifest import Manifest, cache_slots, windowed
from .scheduling import caller_yields

LOAD_ATTEMPTS = 3          # a GPU driver's failed module load is tried again on a fresh device (Session)
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


@dataclass(eq=False)
class Sequence:
    """One sequence: its state arrays on the device (batch-1 modules) or its row of the shared state
    (batched modules), and the tokens they hold."""
    state: list | None = None
    row: int = 0
    position: int = 0
    written: int = 0          # batch-1: cache slots [0, written) its calls wrote, a prefill block's padding too


class Session:
    def __init__(self, path: str | Path, device: str | None = None):
        import iree.runtime as rt

        self.manifest = Manifest.load(path)
        self.directory: Path = self.manifest.directory
        module = self.manifest.module
        self.max_context: int = module.max_context
        self.prefill_block: int = module.prefill_block
        self.short_block: int | None = module.short_prefill_block      # a call of at most this many tokens a row
        self.max_batch: int = module.max_batch
        self.vocab_size: int = self.manifest.vocab_size
        self.eos_ids: list[int] = self.manifest.eos_token_ids
        self.state_layout = module.state
        self.device_uri = device or module.driver
        self.device = open_device(module.driver, device)
        # a CPU call waits for IREE's worker threads; how it waits matters (runtime/scheduling.py)
        self._cpu_workers = self.device_uri.split("://", 1)[0] == "local-task"
        self._check_device()
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            if attempt > 1:
                gc.collect()                   # devices and buffers of dropped sessions, released first
                time.sleep(0.5 * (attempt - 1))
                self.device = open_device(module.driver, device)
            try:
                self.context = self._load_module(rt)
                break
            except Exception as e:
                reason = str(e).splitlines()[0]
                # lavapipe has failed the initializer's parameter upload twice in full test runs (DATA_LOSS
                # at hal.fence.await, late in the suite; the second time the one retry failed as well; 40
                # loads of one module in a loop never failed): a GPU driver's asynchronous failure gets more
                # tries on a fresh device, a CPU one none.
                if attempt == LOAD_ATTEMPTS or module.driver.startswith("local-"):
                    raise RuntimeUsageError(f"{self.directory / module.file}: cannot load ({reason})") from None
                print(f"warning: {self.directory / module.file}: loading on {self.device_uri} failed ({reason}); "
                      "retrying on a fresh device", file=sys.stderr)
        functions = self.context.modules.module
        self._head = functions.head
        # a call runs the entry of the smallest context window holding its tokens (the same numbers as
        # the whole-cache entry, less work); `windows = []` makes every call read the whole cache
        self.windows: list[int] = list(module.context_windows)
        self._prefill = {w: getattr(functions, windowed("prefill", w)) for w in (None, *self.windows)}
        self._decode = {w: getattr(functions, windowed("decode", w)) for w in (None, *self.windows)}
        self._prefill_short = ({w: getattr(functions, windowed("prefill_short", w)) for w in (None, *self.windows)}
                               if self.short_block else {})
        self._staged_reads = False
        self._spare_state: tuple[list, int] | None = None   # batch-1: a released sequence's buffers and
                                                            # how many cache slots it wrote (`_zero_state`)
        self._shared_state: list | None = self._zero_state() if self.max_batch > 1 else None
        self._rows: list[Sequence | None] = [None] * self.max_batch      # batched: which sequence holds a row
        self._default: Sequence | None = None

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
    def _zero_state(self) -> list:
        """Zeroed state arrays: a released sequence's, cleared in place, else new ones. A new allocation
        pays the first touch of every page (about 50 ms for the 94 MB of a bench-size DeepSeek-V3.2 at
        max context 4192, against 2 ms to clear it), so a server's request after request or kimi-run's
        reset reuse one spare set. Of a cache only the slots the last sequence wrote are cleared: the
        rest are still zero, and a new request's cost follows the last one's length, not the max context
        (the whole 94 MB took 2.2 ms before the prefill of a 64-token prompt that took 36)."""
        import iree.runtime as rt
        spare, self._spare_state = self._spare_state, None
        if spare is not None:
            state, written = spare
            try:
                for array, slot in zip(state, self.state_layout):
                    buffer = array._buffer_view.get_buffer()     # (iree.runtime 3.13 has no public accessor)
                    length = self._written_bytes(slot, written)
                    length = buffer.byte_length() if length is None else length
                    if length:
                        buffer.fill_zero(0, length)
                return state
            except (RuntimeError, ValueError):  # memory the host cannot map (a GPU's): allocate instead
                pass
        return [rt.asdevicearray(self.device, np.zeros(s.shape, dtype=s.dtype)) for s in self.state_layout]

    def _written_bytes(self, slot, written: int) -> int | None:
        """The leading bytes of a batch-1 cache [1, slots, ...] that its first `written` slots hold; None
        for state that is not a cache (KDA's recurrent state and conv tails: cleared whole)."""
        slots = cache_slots(self.max_context, self.prefill_block)
        if len(slot.shape) < 2 or slot.shape[:2] != (1, slots):
            return None
        row = int(np.prod(slot.shape[2:], dtype=np.int64)) * np.dtype(slot.dtype).itemsize
        return min(written, slots) * row

    def free_rows(self) -> int:
        """How many more sequences the session can hold at once (batch-1 modules: no limit)."""
        return sys.maxsize if self.max_batch == 1 else self._rows.count(None)

    def new_sequence(self) -> Sequence:
        """An empty sequence at position 0: zero state buffers of its own, or a free row of a batched
        module's state (RuntimeUsageError when every row is held)."""
        if self.max_batch == 1:
            return Sequence(self._zero_state())
        if None not in self._rows:
            raise RuntimeUsageError(f"all {self.max_batch} sequence slots of the module are in use")
        sequence = Sequence(row=self._rows.index(None))
        self._rows[sequence.row] = sequence
        return sequence

    def release(self, sequence: Sequence | None) -> None:
        """Give a sequence's row back (batched modules), or its state buffers (batch-1: kept as the spare
        set the next new sequence clears and takes). A released sequence cannot run again."""
        if sequence is None:
            return
        if self.max_batch > 1 and self._rows[sequence.row] is sequence:
            self._rows[sequence.row] = None
        elif self.max_batch == 1 and sequence.state is not None:
            self._spare_state = self._spare_state or (sequence.state, sequence.written)
            sequence.state = None

    @property
    def sequence(self) -> Sequence:
        """The default sequence (kimi-run's), opened at first use: on a batched module it holds a row."""
        if self._default is None:
            self._default = self.new_sequence()
        return self._default

    def reset(self) -> None:
        """The default sequence emptied."""
        self.release(self._default)
        self._default = None

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
        self.check_vocabulary(ids)
        self._check_context((sequence or self.sequence).position + len(ids))

    def _check_context(self, end: int) -> None:
        if end > self.max_context:
            raise RuntimeUsageError(f"{end} tokens exceed the module's max context {self.max_context} "
                                    "(recompile with a larger --max-context)")

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
        """One prefill call over at most `prefill_block` tokens of one sequence. Returns the last token's
        logits [vocab], every position's [len, vocab] with `all_logits`, or None when neither is wanted
        (reading them back costs a copy)."""
        return self.prefill_rows([(sequence, chunk)], all_logits=all_logits, want_logits=want_logits)[0]

    def prefill_rows(self, work: list[tuple[Sequence, list[int]]], all_logits: bool = False,
                     want_logits: bool = True) -> list[np.ndarray | None]:
        """A prefill block for each (sequence, tokens) of `work` (a server interleaves these with other
        sequences' decode steps): one call on a batched module, one call each on a batch-1 module.
        Returns what `prefill_block_of` returns, per entry."""
        P = self.prefill_block
        for sequence, chunk in work:
            if not 0 < len(chunk) <= P:
                raise RuntimeUsageError(f"a prefill block holds 1..{P} tokens, got {len(chunk)}")
        out = []
        for group in self._calls(work):
            window = self._window(group, [len(chunk) for _, chunk in group])
            # the short block where every row's tokens fit it (`head` takes the full block's hidden rows)
            short = bool(self.short_block) and not all_logits and max(len(chunk) for _, chunk in group) <= self.short_block
            function = (self._prefill_short if short else self._prefill)[window]
            tokens = np.zeros((self.max_batch, self.short_block if short else P), dtype=np.int32)
            positions, lengths = self._rows_in(group)
            for sequence, chunk in group:
                tokens[sequence.row, : len(chunk)] = chunk
                lengths[sequence.row] = len(chunk)
            result = self._call(function, group, tokens, positions, lengths, first_state=2)
            logits = self._read(result[0]) if want_logits and not all_logits else None
            hidden = self._read(self._run_head(result[1])) if all_logits else None  # every position's
            for sequence, chunk in group:
                sequence.position += len(chunk)
                out.append(hidden[sequence.row, : len(chunk)] if all_logits else
                           logits[sequence.row] if logits is not None else None)
        return out

    def decode(self, token: int, sequence: Sequence | None = None) -> np.ndarray:
        """One token -> next-token logits [vocab]."""
        sequence = sequence or self.sequence
        self.check_tokens([int(token)], sequence)
        return self.decode_rows([(sequence, int(token))])[0]

    def decode_rows(self, work: list[tuple[Sequence, int]]) -> list[np.ndarray]:
        """One token for each (sequence, token) of `work` -> their next-token logits [vocab]: one call on a
        batched module, one call each on a batch-1 module."""
        out = []
        for group in self._calls(work):
            function = self._decode[self._window(group, [1] * len(group))]
            tokens = np.zeros(self.max_batch, dtype=np.int32)
            positions, lengths = self._rows_in(group)
            for sequence, token in group:
                tokens[sequence.row], lengths[sequence.row] = token, 1
            logits = self._read(self._call(function, group, tokens, positions, lengths, first_state=1)[0])
            for sequence, _ in group:
                sequence.position += 1
                out.append(logits[sequence.row])
        return out

    def _calls(self, work: list) -> list[list]:
        """`work` as module calls: all of it at once on a batched module (a row once), each alone on batch-1."""
        if self.max_batch == 1:
            return [[w] for w in work]
        rows = [sequence.row for sequence, _ in work]
        if len(set(rows)) != len(rows) or any(self._rows[r] is not s for r, (s, _) in zip(rows, work)):
            raise RuntimeUsageError("a call's sequences must each hold their own row of this session")
        return [work] if work else []

    def _window(self, group: list, counts: list[int]) -> int | None:
        """The smallest context window holding every new token of the call (`counts` a sequence; past
        the max context is an error): rows outside the call compute nothing kept, so only these
        decide; None: the whole cache."""
        end = max(sequence.position + n for (sequence, _), n in zip(group, counts))
        self._check_context(end)
        return next((w for w in self.windows if end <= w), None)

    def _rows_in(self, group: list) -> tuple[np.ndarray, np.ndarray]:
        """Every row's position (a held row's own, a free row's 0) and length 0: rows outside `group`
        are left as they were."""
        positions = np.zeros(self.max_batch, dtype=np.int32)
        for row, sequence in enumerate(self._rows):
            if sequence is not None:
                positions[row] = sequence.position
        for sequence, _ in group:
            positions[sequence.row] = sequence.position
        return positions, np.zeros(self.max_batch, dtype=np.int32)

    def _run_head(self, hidden):
        """The output head on every position's hidden state."""
        with caller_yields(self._cpu_workers):
            return self._head(hidden)

    def _call(self, function, group: list, tokens, positions, lengths, first_state: int) -> list:
        """Run an entry point on the group's state; its returned state (donated in place) replaces it."""
        if self.max_batch == 1:
            sequence = group[0][0]
            if sequence.state is None:
                raise RuntimeUsageError("this sequence was released: open a new one")
            # every slot of the block, padding too; counted before the call, which may write some and fail
            width = tokens.shape[1] if tokens.ndim == 2 else 1
            sequence.written = max(sequence.written, sequence.position + width)
            with caller_yields(self._cpu_workers):
                result = function(tokens, positions, lengths, *sequence.state)
            sequence.state = list(result[first_state:])
        else:
            with caller_yields(self._cpu_workers):
                result = function(tokens, positions, lengths, *self._shared_state)
            self._shared_state = list(result[first_state:])
        return result
