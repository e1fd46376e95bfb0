"""Continuous batching over one compiled module: sequence slots, a bounded queue, one worker thread.

A request takes a free slot between steps, a new request's prefill blocks interleave with the
running slots' decode steps (one block per step, so a long prompt never stalls the others for more
than one block), and a finished, cancelled or failed request frees its slot at once. On a batched
module (`kimi-compile --max-batch N`, up to N slots) a step is two calls, one prefill block for every
slot reading its prompt and one decode for every generating slot, each slot a row at its own
position; on a batch-1 module it is one call per busy slot. Each slot holds its own `Sequence`
(KDA state, latent and indexer caches, position; its own buffers or its own row), so one request
can never change another's numbers.

A request's tokens are exactly `kimi-run`'s for the same prompt and sampling settings: the first
new token is sampled from the prefill's logits, each later one from a decode step, with a
generator seeded per request. Text is streamed as it becomes final: a byte-level token can end
mid-character, and text that may be the start of a stop string is held back until it is not.

The engine knows nothing of HTTP: events go to a callback (the server forwards them to its event
loop), so it is driven and tested on its own.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .errors import RuntimeUsageError
from .sampling import sample
from .session import Sequence, Session
from .tokenizer import Tokenizer


class QueueFull(RuntimeUsageError):
    """Every slot is busy and the waiting queue is at its bound."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Event:
    """`text` is the newly final text; `finish_reason` ("stop", "length", "cancelled", "error") ends a
    request; `error` says why it failed."""
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    cancelled: bool = False
    # scheduler state
    sequence: Sequence | None = None
    fed: int = 0                            # prompt tokens already prefilled
    tokens: list[int] = field(default_factory=list)
    emitted: int = 0                        # characters of the completion text already sent
    text: str = ""                          # the completion's complete characters, decoded so far
    decoded: int = 0                        # tokens whose text is in `text`
    context: int = 0                        # where the last decode started (tokens before `decoded`)
    rng: np.random.Generator | None = None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could still become a stop string (so cannot be sent)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class Engine:
    def __init__(self, session: Session, slots: int = 4, queue_limit: int = 64,
                 tokenizer: Tokenizer | None = None):
        if slots < 1 or queue_limit < 0:
            raise RuntimeUsageError(f"--slots {slots} / --queue {queue_limit}: need at least 1 slot and a queue >= 0")
        if slots > session.free_rows():
            raise RuntimeUsageError(f"--slots {slots}: the module runs {session.max_batch} sequences at once "
                                    "(kimi-compile --max-batch)")
        self.session = session
        self.tokenizer = tokenizer
        self.slots: list[Request | None] = [None] * slots
        self.queue_limit = queue_limit
        self.waiting: collections.deque[Request] = collections.deque()
        self.stop_ids = set(session.eos_ids)
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kimi-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side
    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: Callable[[Event], None]) -> Request:
        """Queue a request; raises RuntimeUsageError (bad request) or QueueFull."""
        if not prompt_ids:
            raise RuntimeUsageError("the prompt has no tokens")
        self.session.check_vocabulary(prompt_ids)
        if len(prompt_ids) + params.max_tokens > self.session.max_context:
            raise RuntimeUsageError(f"the prompt's {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceed "
                                    f"the model's context of {self.session.max_context} tokens")
        if params.stop and self.tokenizer is None:
            raise RuntimeUsageError("stop strings need the checkpoint's tokenizer")
        request = Request(list(prompt_ids), params, on_event,
                          rng=np.random.default_rng(params.seed if params.seed is not None else None))
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if None not in self.slots and len(self.waiting) >= self.queue_limit:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are queued")
            self.waiting.append(request)
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away); its slot is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def stats(self) -> dict:
        with self._wake:
            return {"slots": len(self.slots), "busy": sum(r is not None for r in self.slots),
                    "queued": len(self.waiting)}

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued or running and join the worker."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and all(r is None for r in self.slots):
                    self._wake.wait()
                if self._stopping:
                    break
                self._admit()
                busy = [r for r in self.slots if r is not None]
            self._step(busy)
        for request in [*self.waiting, *(r for r in self.slots if r is not None)]:
            self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Move waiting requests into free slots (called holding the lock)."""
        while self.waiting and None in self.slots:
            request = self.waiting.popleft()
            if request.cancelled:
                self._deliver(request, Event(finish_reason="cancelled"))
                continue
            self.slots[self.slots.index(None)] = request

    def _step(self, busy: list[Request]) -> None:
        """One block of prefill for each slot still reading its prompt, one decode for each generating slot:
        two module calls on a batched module, a call per slot on a batch-1 module."""
        prefill, decode = [], []
        for request in busy:
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            if request.sequence is None:
                request.sequence = self.session.new_sequence()
            if request.fed < len(request.prompt_ids):
                block = request.prompt_ids[request.fed: request.fed + self.session.prefill_block]
                prefill.append((request, block))
            else:
                decode.append((request, request.tokens[-1]))
        for group in self._groups(prefill):
            last = [r.fed + len(block) == len(r.prompt_ids) for r, block in group]
            results = self._call(group, lambda work: self.session.prefill_rows(work, want_logits=any(last)))
            for (request, block), is_last, logits in zip(group, last, results or []):
                request.fed += len(block)
                if is_last:
                    self._take(request, logits)
        for group in self._groups(decode):
            results = self._call(group, self.session.decode_rows)
            for (request, _), logits in zip(group, results or []):
                self._take(request, logits)

    def _groups(self, work: list) -> list[list]:
        """Module calls: everything at once on a batched module, one request a call on batch-1 (so a
        failed call fails its own request only)."""
        if not work:
            return []
        return [work] if self.session.max_batch > 1 else [[w] for w in work]

    def _call(self, group: list, call) -> list | None:
        """The session call over the group's sequences; a failed call ends its requests, never the server."""
        try:
            return call([(request.sequence, item) for request, item in group])
        except Exception as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
            for request, _ in group:
                self._finish(request, "error", error=error)
            return None

    def _take(self, request: Request, logits: np.ndarray) -> None:
        """Sample the next token, send the text that became final, finish on a stop or the length."""
        p = request.params
        token = sample(logits, request.rng, p.temperature, p.top_k, p.top_p)
        request.tokens.append(token)
        if token in self.stop_ids:
            self._finish(request, "stop")
            return
        text = self._text(request)
        if p.stop:
            hits = [i for i in (text.find(s, max(request.emitted - len(s), 0)) for s in p.stop) if i >= 0]
            if hits:
                self._finish(request, "stop", text=text[: min(hits)])
                return
        final = len(text) - held_back(text, p.stop)
        if final > request.emitted:
            self._deliver(request, Event(text=text[request.emitted: final]))
            request.emitted = final
        if len(request.tokens) >= p.max_tokens:
            self._finish(request, "length")         # the whole text, an unfinished last character included

    def _text(self, request: Request) -> str:
        """The completion so far, without a trailing incomplete UTF-8 character. Decoded incrementally, as
        vLLM does: only the tokens since the last complete text, after the previous step's tokens as
        context (a tokenizer may render a token differently at the start of a decode), so a long
        completion costs O(n), not O(n^2)."""
        if self.tokenizer is None:
            return ""
        decode, tokens = self.tokenizer.decode, request.tokens
        before = decode(tokens[request.context: request.decoded])
        after = decode(tokens[request.context:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            request.text += after[len(before):]
            request.context, request.decoded = request.decoded, len(tokens)
        return request.text

    def _finish(self, request: Request, reason: str, text: str | None = None, error: str | None = None) -> None:
        """Send the rest of the text and the end, and free the slot."""
        if text is None and reason in ("stop", "length") and self.tokenizer is not None:
            ids = request.tokens[:-1] if request.tokens and request.tokens[-1] in self.stop_ids else request.tokens
            text = self.tokenizer.decode(ids)
        rest = text[request.emitted:] if text else ""
        self._deliver(request, Event(text=rest, finish_reason=reason, error=error,
                                     prompt_tokens=len(request.prompt_ids), completion_tokens=len(request.tokens)))
        with self._wake:
            if request in self.slots:
                self.slots[self.slots.index(request)] = None
        self.session.release(request.sequence)
        request.sequence = None

    @staticmethod
    def _deliver(request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:                           # a caller's callback failing must not stop the worker
            request.cancelled = True
