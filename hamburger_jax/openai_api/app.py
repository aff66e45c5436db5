"""An OpenAI-compatible HTTP server over the engine's admission loop (a Starlette app).

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events with
`stream: true`, ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus, openai_api/metrics.py). Each request is submitted to the `AdmissionLoop`, which
admits it into the running batch between rounds; its macro steps come back on the loop's
thread and cross to the event loop through an asyncio queue. A client that goes away (or a
stop string) cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hamburger_jax.decode.admission import AdmissionLoop, LoopClosed, QueueFull, Ticket, recent
from hamburger_jax.decode.requests import Generation, GenerationError
from hamburger_jax.decode.scoring import Scorer
from hamburger_jax.openai_api import logprobs, metrics, protocol
from hamburger_jax.openai_api.logprobs import Piece
from hamburger_jax.openai_api.protocol import ApiError
from hamburger_jax.openai_api.text_stream import TextStream

# A body larger than this is refused (413): prompts are bounded by the server's token limit,
# so no legitimate request comes near it.
MAX_BODY_BYTES = 1 << 20
# How often a non-streamed request checks that its client is still there.
DISCONNECT_POLL_S = 0.5


async def _body(http: HttpRequest) -> object:
  """The JSON body, refused (413) past MAX_BODY_BYTES. The rest of an oversized body is read
  and dropped, so that the client, still sending, receives the answer."""
  size, chunks = 0, []
  async for chunk in http.stream():
    size += len(chunk)
    if size <= MAX_BODY_BYTES:
      chunks.append(chunk)
  if size > MAX_BODY_BYTES:
    raise ApiError(413, f"the request body has {size} bytes; the limit is {MAX_BODY_BYTES}",
                   code="body_too_large")
  try:
    return json.loads(b"".join(chunks))
  except (ValueError, UnicodeDecodeError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") \
        from None


class _Answer:
  """One request's answer as it is built: its text stream, counts and finish reason."""

  def __init__(self, call: protocol.Call, ticket: Ticket, tokenizer, stop_ids: tuple):
    decode = ((lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer
              else (lambda ids: ""))
    self.call, self.ticket, self.stop_ids = call, ticket, stop_ids
    self.text = TextStream(decode, call.stop)
    self.tokens = self.steps = 0
    self.groups: list[int] = []  # tokens per macro step, as they came
    self.finish_reason: str | None = None
    self.gen: Generation | None = None

  def usage(self) -> dict:
    prompt = len(self.call.request.ids)
    if self.gen is not None and not self.gen.error:
      done, steps, entries = self.gen.new_tokens, self.gen.macro_steps, self.gen.kv_entries
    else:  # ended by a stop string: what was produced until then
      done, steps = self.tokens, self.steps
      entries = prompt + max(steps - 1, 0)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "macro_steps": steps, "kv_entries": entries}

  def ended(self, gen: Generation) -> None:
    self.gen = gen
    last = gen.token_ids[-1] if gen.token_ids else None
    self.finish_reason = "stop" if (last in self.stop_ids or gen.new_tokens <
                                    self.call.request.max_new_tokens) else "length"


class Server:
  """The HTTP side of one AdmissionLoop (started by the caller). `app` is the ASGI app."""

  def __init__(self, loop: AdmissionLoop, defaults: protocol.Defaults):
    self.loop, self.defaults = loop, defaults
    self.engine = loop.engine
    self.created = int(time.time())
    self.scorer = Scorer(self.engine)
    self.metrics = metrics.ServerMetrics(loop, self.engine.max_group or 1)
    self.app = Starlette(routes=[
        Route("/health", self._health), Route("/metrics", self._metrics),
        Route("/v1/models", self._models),
        Route("/v1/chat/completions", functools.partial(self._complete, chat=True),
              methods=["POST"]),
        Route("/v1/completions", functools.partial(self._complete, chat=False),
              methods=["POST"])],
                         exception_handlers={ApiError: _api_error, HTTPException: _http_error})

  async def _health(self, _) -> JSONResponse:
    """200 once every mode served answers any request (the server listens only then);
    `compile` is what that took, `pending` the programs still being prepared apart (they make
    some requests faster, none different) and `prepared` what preparing them took so far."""
    ok = self.loop.error is None
    prepared = self.loop.prepared
    return JSONResponse({"status": "ok" if ok else "failed", "error": self.loop.error,
                         "waiting": self.loop.waiting, "in_flight": self.loop.in_flight,
                         "cancelled": self.loop.cancelled,
                         "modes": {m: recent(s) for m, s in self.loop.stats.items()},
                         "compile": {"seconds": round(self.loop.compile_s, 3),
                                     "cache_hits": self.loop.compile_cache.hits,
                                     "cache_misses": self.loop.compile_cache.misses},
                         "pending": self.loop.pending(),
                         "prepared": {"seconds": round(prepared.seconds, 3),
                                      "cache_hits": prepared.cache_hits,
                                      "cache_misses": prepared.cache_misses,
                                      "error": prepared.error}},
                        status_code=200 if ok else 503)

  async def _metrics(self, _) -> Response:
    return Response(self.metrics.render(), media_type=metrics.CONTENT_TYPE)

  async def _models(self, _) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": self.defaults.model, "object": "model", "created": self.created,
         "owned_by": "hamburger-jax"}]})

  def _submit(self, call: protocol.Call, events: asyncio.Queue) -> Ticket:
    aloop = asyncio.get_running_loop()
    put = lambda item: aloop.call_soon_threadsafe(events.put_nowait, item)
    try:
      return self.loop.submit(call.request, call.mode, on_tokens=lambda ids: put(("tokens", ids)),
                              on_done=lambda gen: put(("done", gen)))
    except ValueError as e:  # GenerationError, or the chat template refusing the messages
      raise ApiError(400, str(e)) from None
    except QueueFull as e:
      raise ApiError(503, str(e), kind="server_error", code="queue_full") from None
    except LoopClosed as e:
      raise ApiError(503, str(e), kind="server_error", code="shutting_down") from None

  async def _complete(self, http: HttpRequest, chat: bool):
    body = await _body(http)
    call = protocol.parse(body, chat=chat, defaults=self.defaults, modes=self.loop.modes,
                          tokenizer=self.engine.tokenizer)
    events: asyncio.Queue = asyncio.Queue()
    answer = self._answer(call, events)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    client = None if call.stream else http
    scored = call.logprobs is not None or call.echo
    pieces = (self._scored(answer, events, client) if scored else
              (Piece(d, None) async for d in self._deltas(answer, events, client)))
    if call.stream:
      return StreamingResponse(self._sse(answer, pieces, rid), media_type="text/event-stream")
    text, lp = logprobs.joined([p async for p in pieces], chat, call.logprobs is not None)
    choice = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": self.defaults.model,
        "choices": [{"index": 0, **choice, "finish_reason": answer.finish_reason,
                     "logprobs": lp}], "usage": answer.usage()})

  def _answer(self, call: protocol.Call, events: asyncio.Queue) -> _Answer:
    """The call's answer, its request submitted; with max_tokens 0 (an echo scored alone)
    nothing is generated: its prompt is checked and it is done."""
    tok, stop_ids = self.engine.tokenizer, self.engine.stop_ids
    if call.request.max_new_tokens:
      return _Answer(call, self._submit(call, events), tok, stop_ids)
    try:
      call.request.ids = self.engine.encode_prompt(call.request.prompt)
    except GenerationError as e:
      raise ApiError(400, str(e), "prompt") from None
    limit = self.loop.limits.max_prompt_tokens
    if len(call.request.ids) > limit:
      raise ApiError(400, f"the prompt has {len(call.request.ids)} tokens, over this server's "
                     f"limit of {limit}: shorten it", "prompt")
    answer = _Answer(call, None, tok, stop_ids)
    answer.finish_reason = "length"
    return answer

  async def _scored(self, answer: _Answer, events: asyncio.Queue,
                    http: HttpRequest | None) -> AsyncIterator[Piece]:
    """The answer with its log-probabilities or echo (openai_api/logprobs.py), once its
    generation has ended. `http`: as for _deltas."""
    if answer.ticket is not None:
      async for _ in self._deltas(answer, events, http):
        pass
      if answer.finish_reason is None:
        return  # the client went away
    call = answer.call
    try:
      pieces = await asyncio.to_thread(
          logprobs.answer_pieces, self.scorer, self.engine.tokenizer, mode=call.mode,
          chat=call.chat, top=call.logprobs, echo=call.echo, prompt=call.request.ids,
          ids=answer.text.ids, groups=answer.groups, stops=call.stop)
    except ValueError as e:
      raise ApiError(500, f"scoring the answer failed: {e}", kind="server_error") from None
    for piece in pieces:
      yield piece

  async def _deltas(self, answer: _Answer, events: asyncio.Queue,
                    http: HttpRequest | None) -> AsyncIterator[str]:
    """The answer's text as it comes. `http`: poll it for a client that went away (streamed
    answers learn it from the response being cancelled instead)."""
    try:
      while answer.finish_reason is None:
        try:
          kind, item = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if http is not None and await http.is_disconnected():
            return
          continue
        if kind == "tokens":
          answer.tokens, answer.steps = answer.tokens + len(item), answer.steps + 1
          answer.groups.append(len(item))
          delta = answer.text.feed(item)
          if answer.text.stopped:
            answer.finish_reason = "stop"
        else:
          if item.error:
            raise ApiError(503 if answer.ticket.cancelled or "shut" in item.error else 500,
                           item.error, kind="server_error")
          answer.ended(item)
          delta = answer.text.finish()
        if delta:
          yield delta
    finally:
      if not answer.ticket.done:
        self.loop.cancel(answer.ticket)

  def _chunk(self, answer: _Answer, rid: str, delta: dict | str | None,
             finish_reason: str | None = None, lp: dict | None = None) -> str:
    if answer.call.chat:
      choice = {"delta": {} if delta is None else delta}
      kind = "chat.completion.chunk"
    else:
      choice, kind = {"text": delta or ""}, "text_completion"
    return _event({"id": rid, "object": kind, "created": int(time.time()),
                   "model": self.defaults.model,
                   "choices": [{"index": 0, **choice, "finish_reason": finish_reason,
                                "logprobs": lp}]})

  async def _sse(self, answer: _Answer, pieces: AsyncIterator[Piece],
                 rid: str) -> AsyncIterator[str]:
    chat = answer.call.chat
    try:
      if chat:
        yield self._chunk(answer, rid, {"role": "assistant", "content": ""})
      async for p in pieces:
        yield self._chunk(answer, rid, {"content": p.text} if chat else p.text, lp=p.logprobs)
      yield self._chunk(answer, rid, None if chat else "", answer.finish_reason)
      if answer.call.include_usage:
        yield _event({"id": rid, "object": "chat.completion.chunk" if chat else
                      "text_completion", "created": int(time.time()),
                      "model": self.defaults.model, "choices": [], "usage": answer.usage()})
    except ApiError as e:
      yield _event(e.body())
    yield "data: [DONE]\n\n"


async def _api_error(_, e: ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


async def _http_error(_, e: HTTPException) -> JSONResponse:
  """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
  return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


def _event(obj: dict) -> str:
  return f"data: {json.dumps(obj)}\n\n"
