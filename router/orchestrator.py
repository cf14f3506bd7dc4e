"""Disaggregated request flow over the prefill and decode handles, with request migration.

prefill(request) -> first token + KVTransferParams; the first token is streamed to the client
at once (TTFT), then decode(request, params) streams the rest. Closing the generator (client
disconnect, stop string) cancels the decode call, which aborts the request and frees its KV.
Conditional disaggregation (`max_local_prefill_length`, decision 26): a short prompt while
this ingress replica has nothing else in flight skips the prefill replica and is computed on
the decode replica, as a recompute is.

What survives a failure (docs/architecture.md decision 13: a request is prompt + tokens
already sent + seed):
- Prefill: a failed, dead or frozen prefill replica is retried once; then the request is
  recomputed on a decode replica (decode replicas recompute requests sent without KV params).
- KV transfer: a failed pull follows `kv_transfer.failure_policy`: `recompute` on a decode
  replica, or `fail` with a clear error. The prefill hold is released at once either way.
- Decode: when a stream fails (replica or actor death, engine error, a replica silent for
  `stall_timeout_s`), the request resumes on a decode replica from prompt + tokens already sent
  (`GenerateRequest.resume_token_ids`, `max_tokens` reduced by them), so the client's stream goes
  on with no token lost or repeated. At most `max_migrations` times; then an error.
- Serve may still route to a dead replica for a moment, and every replica may be busy: such
  attempts (no chunk received) are retried with exponential back-off within `retry_window_s`
  and do not count as migrations. Backpressure is not failure: while every decode replica is
  busy, the prefill replica keeps holding the KV (until shortly before `kv_hold_ttl_s`) and
  the same transfer is offered again, so a full decode queue never costs a recompute.
- Every wait has a deadline: the request's `request_timeout_s` end to end, and
  `stall_timeout_s` per wait on a replica (plus the KV timeout before the first decode chunk).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mtpserve.router.errors import (
    BAD_REQUEST_NAMES,
    BUSY_NAMES,
    KV_TRANSFER_NAMES,
    UNAVAILABLE_NAMES,
    APIError,
    error_names,
    overloaded,
)
from mtpserve.workers.hop_trace import stamp
from mtpserve.workers.kv_transfer.mailbox import drop_holds
from mtpserve.workers.messages import (
    ERROR_KV_TRANSFER,
    ERROR_REQUEST,
    TARGET_REPLICA,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 2.0
# A release posted to the senders' stores: a reachable store answers in milliseconds.
_DIRECT_RELEASE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class OrchestratorConfig:
    """The reliability knobs of one orchestrator (cluster.config names them the same)."""

    request_timeout_s: float = 600.0
    max_migrations: int = 2
    kv_failure_policy: str = "recompute"  # "recompute" | "fail"
    kv_timeout_s: float = 30.0
    stall_timeout_s: float = 60.0
    retry_backoff_s: float = 0.2
    retry_window_s: float = 30.0
    kv_hold_ttl_s: float = 120.0  # how long a prefill replica keeps a request's KV for decode
    # Conditional disaggregation: prompts up to this many tokens are prefilled on an idle
    # decode replica (0: never).
    max_local_prefill_length: int = 0
    # The deployment's KV secret (signs direct releases); its repr is redacted.
    kv_secret: Any = field(default=None, repr=False)

    @classmethod
    def of(cls, cfg: Any) -> OrchestratorConfig:
        """From a `cluster.config.ClusterConfig`."""
        m = cfg.migration
        return cls(request_timeout_s=cfg.request_timeout_s, max_migrations=m.max_migrations,
                   kv_failure_policy=cfg.kv_transfer.failure_policy,
                   kv_timeout_s=cfg.kv_transfer.timeout_s, stall_timeout_s=m.stall_timeout_s,
                   retry_backoff_s=m.retry_backoff_s, retry_window_s=m.retry_window_s,
                   kv_hold_ttl_s=cfg.kv_transfer.hold_ttl_s,
                   max_local_prefill_length=cfg.decode.max_local_prefill_length,
                   kv_secret=getattr(cfg.kv_transfer, "secret", None))


class _Stalled(Exception):
    """A replica sent nothing for `stall_timeout_s` (frozen or overloaded peer)."""


class _StreamFailed(Exception):
    """A decode stream ended with an error chunk (`kind`: its `error_kind`), or without a
    finished one."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Progress:
    """What the client has received so far: the state a migration resumes from."""

    request: GenerateRequest
    sent: list[int] = field(default_factory=list)
    base: list[int] = field(default_factory=lambda: [0, 0, 0])  # drafted, accepted, rounds
    last: list[int] = field(default_factory=lambda: [0, 0, 0])  # of the current attempt

    def emit(self, chunk: TokenChunk) -> TokenChunk:
        """The chunk as the client must see it: counters continue across migrations."""
        self.sent += chunk.token_ids
        self.last = [chunk.num_drafted, chunk.num_accepted, chunk.num_rounds]
        d, a, r = (b + x for b, x in zip(self.base, self.last, strict=True))
        return dataclasses.replace(
            chunk, num_prompt_tokens=len(self.request.prompt_token_ids),
            num_output_tokens=len(self.sent), num_drafted=d, num_accepted=a, num_rounds=r)

    def new_attempt(self) -> None:
        self.base = [b + x for b, x in zip(self.base, self.last, strict=True)]
        self.last = [0, 0, 0]


def resumed(request: GenerateRequest, sent: list[int], attempt: int) -> GenerateRequest:
    """`request` continued after the tokens the client already has. A decode replica computes
    prompt + sent and generates the rest; limits count what is left. A fresh request id per
    attempt, so a replica that still knows the failed attempt cannot refuse it as a duplicate."""
    p = request.params
    return dataclasses.replace(
        request, request_id=f"{request.request_id}#m{attempt}",
        resume_token_ids=list(request.resume_token_ids) + list(sent),
        params=dataclasses.replace(p, max_tokens=p.max_tokens - len(sent),
                                   # counted from the resume point
                                   min_tokens=max(0, p.min_tokens - len(sent))))


def _is_kv_failure(e: BaseException, names: set[str]) -> bool:
    """A failed KV pull: raised when decode admits the request (`KVTransferFailed`) or sent
    as the stream's error chunk when it fails later (decode pulls asynchronously), typed
    `error_kind="kv_transfer"` there."""
    return bool(names & KV_TRANSFER_NAMES) or getattr(e, "kind", None) == ERROR_KV_TRANSFER


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]


async def _await(response: Any) -> Any:
    return await response


class DisaggOrchestrator:
    def __init__(self, prefill, decode, config: OrchestratorConfig | float | None = None
                 ) -> None:
        self.prefill = prefill  # DeploymentHandle of PrefillServer
        self.decode = decode  # DeploymentHandle of DecodeServer
        if not isinstance(config, OrchestratorConfig):  # a bare request timeout (old callers)
            config = OrchestratorConfig(**({} if config is None else
                                           {"request_timeout_s": float(config)}))
        self.config = config
        self._background: set[asyncio.Task] = set()
        self.num_migrations = 0  # totals, for stats
        self.num_prefill_retries = 0
        self.num_kv_recomputes = 0
        self.num_busy_retries = 0  # a busy decode deployment refused; the KV hold was kept
        self.replica_key: str | None = None  # its snapshot in the metrics hub (Serve ingress)
        self.num_direct_releases = 0  # releases posted straight to the senders' stores
        self.num_local_prefills = 0  # prefilled on a decode replica (conditional disagg.)
        self.active: set[str] = set()  # request ids in flight through this orchestrator

    # Public ----------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        deadline = time.monotonic() + self.config.request_timeout_s
        progress = _Progress(request)
        on_decode = self._prefill_on_decode(request)
        rid = request.request_id
        self.active.add(rid)
        try:
            if on_decode:
                # The decode replica computes requests sent without KV params from the prompt.
                self.num_local_prefills += 1
                prefilled = None
            else:
                prefilled = await self._prefill(request, deadline)
            first, params = prefilled if prefilled is not None else (None, None)
            # A busy decode deployment may keep the prefill's KV waiting until shortly before
            # the hold expires (the pull itself then still has its timeout).
            hold_until = time.monotonic() + self.config.kv_hold_ttl_s - self.config.kv_timeout_s
            held = params is not None
            try:
                if first is not None:
                    if first.finished:
                        self.active.discard(rid)
                    yield progress.emit(first)
                    if first.finished:
                        return
                async for chunk in self._decode(progress, params, deadline, hold_until):
                    held = False  # the decode side has the KV (it acknowledged the pull)
                    if chunk.finished:
                        # Out of flight with its last token, not when its consumer closes
                        # this generator (which may come later).
                        self.active.discard(rid)
                    yield stamp(chunk, "ingress_in")
            finally:
                if held:
                    # The client left between prefill and decode, or decode never pulled:
                    # free the prefill replica's blocks now rather than at hold_ttl_s.
                    self._release(params)
        finally:
            self.active.discard(rid)

    def _prefill_on_decode(self, request: GenerateRequest) -> bool:
        """Conditional disaggregation (Dynamo's, by prompt length and load): prefill on the
        decode replica a prompt of at most `max_local_prefill_length` tokens when this ingress
        replica has nothing else in flight, so decode is idle (unless other ingress replicas
        keep it busy: each sees only its own requests) and the prompt skips two hops and the
        KV transfer. `disaggregate` on the request overrides: true always goes through a
        prefill replica, false asks for the decode replica (within the same length limit)."""
        limit = self.config.max_local_prefill_length
        n = len(request.prompt_token_ids) + len(request.resume_token_ids)
        if request.disaggregate is False:
            if limit == 0:
                raise APIError("disaggregate: false is off on this server: every prompt is "
                               "prefilled on a prefill replica (decode."
                               "max_local_prefill_length is 0)", 400, param="disaggregate")
            if n > limit:
                raise APIError(f"disaggregate: false takes prompts of at most {limit} tokens "
                               f"here (decode.max_local_prefill_length); this one has {n}",
                               400, param="disaggregate")
            return True
        return request.disaggregate is None and not self.active and n <= limit

    def counters(self) -> dict[str, int]:
        """This ingress replica's totals (each ingress replica pushes its own to the metrics
        hub; /metrics and the stats endpoint sum them over replicas)."""
        return {"num_migrations": self.num_migrations,
                "num_prefill_retries": self.num_prefill_retries,
                "num_kv_recomputes": self.num_kv_recomputes,
                "num_busy_retries": self.num_busy_retries,
                "num_local_prefills": self.num_local_prefills}

    async def stats(self) -> dict:
        # One sample per call; with several replicas Serve routes each call to one of them.
        timeout = self.config.stall_timeout_s
        p, d = await asyncio.wait_for(asyncio.gather(
            _await(self.prefill.stats.remote()), _await(self.decode.stats.remote())), timeout)
        return {"prefill": p, "decode": d, "orchestrator": self.counters()}

    async def kv_probe(self, num_bytes: int) -> dict:
        """Raw send/recv of num_bytes between a prefill rank-0 sender and a decode rank 0,
        on the channel KV pulls use."""
        timeout = self.config.stall_timeout_s + self.config.kv_timeout_s
        p = await asyncio.wait_for(_await(self.prefill.stats.remote()), timeout)
        return await asyncio.wait_for(
            _await(self.decode.kv_probe.remote(p["kv_addresses"][0], num_bytes)), timeout)

    # Prefill ---------------------------------------------------------------------------------
    async def _prefill(self, request: GenerateRequest, deadline: float
                       ) -> tuple[TokenChunk, KVTransferParams | None] | None:
        """The first token and the held KV's params from a prefill replica, retried once;
        None: recompute on decode. Each attempt has its own request id (`#p{n}` after the
        first), so a retry that lands on the replica still cleaning up the first attempt is
        neither refused as a duplicate nor able to free that attempt's hold."""
        for attempt in range(2):
            attempt_request = request if attempt == 0 else dataclasses.replace(
                request, request_id=f"{request.request_id}#p{attempt}")
            response = self.prefill.prefill.remote(attempt_request)
            try:
                return await self._within(_await(response), deadline,
                                          self.config.stall_timeout_s)
            except BaseException as e:
                response.cancel()  # frees the prefill's blocks if it is still running
                if isinstance(e, (asyncio.CancelledError, APIError)):
                    raise
                if not isinstance(e, Exception):
                    raise
                names = error_names(e)
                if names & BAD_REQUEST_NAMES or (names & BUSY_NAMES and attempt == 0):
                    raise  # 400 / 429 for the client, as the engine or Serve said
                logger.warning("prefill of %s failed (attempt %d): %s", request.request_id,
                               attempt + 1, _short(e))
                self.num_prefill_retries += attempt == 0
                if attempt == 0:
                    await self._sleep(self.config.retry_backoff_s, deadline)
        logger.warning("prefill of %s failed twice; recomputing it on a decode replica",
                       request.request_id)
        return None

    # Decode ----------------------------------------------------------------------------------
    async def _decode(self, progress: _Progress, params: KVTransferParams | None,
                      deadline: float, hold_until: float) -> AsyncIterator[TokenChunk]:
        cfg = self.config
        request = progress.request
        migrations = attempt = 0
        backoff = cfg.retry_backoff_s
        retry_until = time.monotonic() + cfg.retry_window_s
        use_params = params is not None
        while True:
            if use_params:
                req, kv = request, params
            else:  # recompute from prompt + everything the client has
                req, kv = resumed(request, progress.sent, attempt), None
            gen = self.decode.options(stream=True).generate.remote(req, kv)
            got_chunk = finished = False
            failure: Exception | None = None
            try:
                while True:
                    wait = cfg.stall_timeout_s + (0 if got_chunk or kv is None
                                                  else cfg.kv_timeout_s)
                    try:
                        chunk = await self._within(gen.__anext__(), deadline, wait)
                    except StopAsyncIteration:
                        failure = _StreamFailed("the decode stream ended before the request "
                                                "finished")
                        break
                    except (asyncio.CancelledError, APIError):
                        raise
                    except Exception as e:
                        failure = e
                        break
                    if chunk.heartbeat:
                        continue  # alive and still working on it: not a stall, nothing to send
                    if chunk.finish_reason in ("error", "abort"):
                        failure = _StreamFailed(chunk.error or f"decode {chunk.finish_reason}",
                                                chunk.error_kind)
                        break
                    got_chunk = True
                    finished = chunk.finished
                    yield progress.emit(chunk)
                    if finished:
                        return
            finally:
                if not finished:
                    _cancel(gen)  # aborts the request there and frees its KV blocks
            # The attempt failed: decide whether and how to go on.
            assert failure is not None
            names = error_names(failure)
            detail = _short(failure)
            if (use_params and not got_chunk and names & BUSY_NAMES
                    and cfg.kv_failure_policy == "recompute"
                    and time.monotonic() + backoff < retry_until
                    and (time.monotonic() + backoff < hold_until
                         or await self._renew(params))):
                # Backpressure is not failure: every decode replica is busy, the prefill still
                # holds the KV (its lease renewed when it would run out). Wait and offer the
                # same transfer again; nothing is recomputed. (Under failure_policy "fail" a
                # hold that expires while the request waits for KV blocks there would be a
                # 503, so that policy recomputes at once instead.)
                if time.monotonic() + backoff >= hold_until:
                    hold_until = time.monotonic() + cfg.kv_hold_ttl_s - cfg.kv_timeout_s
                self.num_busy_retries += 1
                await self._sleep(backoff, deadline)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            if use_params and not got_chunk:
                await self._release_now(params)  # decode failed before pulling
            if getattr(failure, "kind", None) == ERROR_REQUEST:
                # The request failed on its own inputs: another replica would fail it too.
                raise APIError(f"the request cannot be generated: {detail}", 400)
            if names & BAD_REQUEST_NAMES and not use_params and not progress.sent:
                raise failure  # the request itself is invalid (a 400)
            retry_quietly = not got_chunk and bool(names & (BUSY_NAMES | UNAVAILABLE_NAMES))
            if use_params and not got_chunk and _is_kv_failure(failure, names):
                if cfg.kv_failure_policy == "fail":
                    raise APIError(f"KV transfer from the prefill replica failed ({detail}); "
                                   "kv_transfer.failure_policy is 'fail'", 503,
                                   code="kv_transfer_failed")
                self.num_kv_recomputes += 1
                retry_quietly = True  # recompute is the policy, not a migration
            use_params = False
            attempt += 1
            progress.new_attempt()
            if retry_quietly:
                # Serve may still route to a replica that just died; or every replica is busy.
                if time.monotonic() > retry_until:
                    if names & BUSY_NAMES:
                        raise overloaded("every decode replica is busy; retry after a short "
                                         "wait")
                    raise APIError(f"no decode replica could take the request ({detail})", 503,
                                   code="service_unavailable")
                await self._sleep(backoff, deadline)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
                continue
            if migrations >= cfg.max_migrations:
                raise APIError(f"generation failed after {migrations} migrations ({detail})",
                               503, code="migration_limit_reached")
            migrations += 1
            self.num_migrations += 1
            backoff = cfg.retry_backoff_s
            retry_until = time.monotonic() + cfg.retry_window_s
            logger.warning("decode of %s failed after %d tokens (%s); migrating (%d/%d)",
                           request.request_id, len(progress.sent), detail, migrations,
                           cfg.max_migrations)

    # Helpers ---------------------------------------------------------------------------------
    async def _within(self, awaitable: Any, deadline: float, stall_s: float) -> Any:
        """Await with the request's deadline (a 504 for the client) and a stall limit
        (`_Stalled`, which the callers treat as a failed replica)."""
        left = deadline - time.monotonic()
        timeout = min(left, stall_s)
        try:
            return await asyncio.wait_for(awaitable, max(timeout, 0.001))
        except asyncio.TimeoutError:
            if timeout >= left:
                raise self._timeout() from None
            raise _Stalled(f"no answer from the replica within {stall_s:.0f}s") from None

    def _timeout(self) -> APIError:
        return APIError(f"the request did not finish within request_timeout_s="
                        f"{self.config.request_timeout_s:g}s", 504, code="request_timeout")

    async def _sleep(self, seconds: float, deadline: float) -> None:
        if time.monotonic() + seconds >= deadline:
            raise self._timeout()
        await asyncio.sleep(seconds)

    async def _release_now(self, params: KVTransferParams) -> None:
        """Tell the prefill replica holding the KV to free it now (best effort: hold_ttl_s
        frees it anyway). First straight to its ranks' KV sender stores (a `drop` in their
        mailboxes: never queued behind prefill requests); if a store cannot be reached, through
        the replica: the call carries that replica's id, which the request router
        (mtpserve.router.routing) sends it to; if that replica is gone, another answers False."""
        rid = params.request_id
        if params.sender_addresses and await asyncio.to_thread(
                drop_holds, list(params.sender_addresses), rid, _DIRECT_RELEASE_TIMEOUT_S,
                self.config.kv_secret):
            self.num_direct_releases += 1
            return
        backoff, until = self.config.retry_backoff_s, time.monotonic() + self.config.stall_timeout_s
        while True:
            try:
                response = self.prefill.release.remote(
                    rid, **{TARGET_REPLICA: params.prefill_replica})
                await asyncio.wait_for(_await(response), self.config.stall_timeout_s)
                return
            except Exception as e:
                # A release refused by a full Serve queue is tried again (it frees blocks the
                # busy replica needs); anything else is left to hold_ttl_s.
                if not error_names(e) & BUSY_NAMES or time.monotonic() + backoff > until:
                    logger.debug("release of %s failed: %s", rid, _short(e))
                    return
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)

    async def _renew(self, params: KVTransferParams) -> bool:
        """Extend the prefill hold's lease by kv_hold_ttl_s (pinned to the holding replica,
        like a release); False if it is no longer held there or the call failed."""
        try:
            response = self.prefill.renew.remote(
                params.request_id, **{TARGET_REPLICA: params.prefill_replica})
            return bool(await asyncio.wait_for(_await(response), self.config.stall_timeout_s))
        except Exception as e:
            logger.debug("renewing the hold of %s failed: %s", params.request_id, _short(e))
            return False

    def _release(self, params: KVTransferParams) -> None:
        """`_release_now` in the background (from a closing generator, which cannot wait)."""
        try:
            task = asyncio.get_running_loop().create_task(self._release_now(params))
        except RuntimeError:  # no loop (interpreter shutdown)
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _cancel(gen: Any) -> None:
    try:
        gen.cancel()
    except Exception:  # the replica may be gone already
        pass
