"""A server's figures in Prometheus' text format (GET /metrics), from prometheus-client.

Each `ServerMetrics` has a registry of its own (not the process-wide default one), so that two
servers in one process count apart. The loop tells it of each request that ends or is refused
(AdmissionLoop.observers); requests waiting and running, and each mode's KV blocks, are read
from the loop when scraped.

  hamburger_requests_active{state="queued"|"running"}        gauge
  hamburger_requests_total{mode, state="finished"|"cancelled"|"failed"|"refused"}
  hamburger_prompt_tokens_total{mode}, hamburger_generation_tokens_total{mode}
  hamburger_time_to_first_token_seconds{mode}, hamburger_time_per_output_token_seconds{mode}
  hamburger_kv_blocks{mode, state="used"|"free"}             gauge
  hamburger_macro_steps_total{mode}, hamburger_tokens_per_macro_step{mode}  (histogram)
  hamburger_on_done_errors_total{mode}
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

from hamburger_jax.decode.admission import AdmissionLoop, Ticket
from hamburger_jax.decode.requests import Generation

# Seconds from a request's arrival to its first tokens: a prefill on a CPU takes tens to
# hundreds of milliseconds, a wait for a slot up to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds per token after the first: a macro step of a batch takes milliseconds on an
# accelerator, tens to hundreds of them on a CPU, and emits up to K tokens per row.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
OTHER_MODE = "other"  # a refused request's mode label when it named no mode served here

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _LoopState:
  """The gauges read from the loop at each scrape (a custom collector: no thread keeps them)."""

  def __init__(self, loop: AdmissionLoop):
    self.loop = loop

  def collect(self):
    waiting, in_flight = self.loop.waiting, self.loop.in_flight
    requests = GaugeMetricFamily("hamburger_requests_active", "Requests waiting for a slot "
                                 "(queued) and decoding (running)", labels=["state"])
    requests.add_metric(["queued"], waiting)
    requests.add_metric(["running"], max(in_flight - waiting, 0))
    yield requests
    blocks = GaugeMetricFamily("hamburger_kv_blocks", "KV pool blocks held by requests (used) "
                               "and free, per mode", labels=["mode", "state"])
    for mode, (used, free) in self.loop.kv_blocks().items():
      blocks.add_metric([mode, "used"], used)
      blocks.add_metric([mode, "free"], free)
    yield blocks


class ServerMetrics:
  """The counters and histograms of one server over `loop` (registered as its observer)."""

  def __init__(self, loop: AdmissionLoop, max_group: int):
    self.modes = loop.modes
    self.registry = CollectorRegistry()
    r = self.registry
    self.requests = Counter("hamburger_requests", "Requests that ended: finished, cancelled "
                            "(the client went away), failed, or refused at arrival (over the "
                            "limits, queue full, shutting down)", ["mode", "state"], registry=r)
    self.prompt_tokens = Counter("hamburger_prompt_tokens", "Prompt tokens of the requests "
                                 "that ended (refused ones left out)", ["mode"], registry=r)
    self.generation_tokens = Counter("hamburger_generation_tokens", "Tokens sent to clients "
                                     "(a cancelled request's until it was)", ["mode"],
                                     registry=r)
    self.ttft = Histogram("hamburger_time_to_first_token_seconds", "From a request's arrival "
                          "at the loop to its first tokens", ["mode"], registry=r,
                          buckets=TTFT_BUCKETS)
    self.tpot = Histogram("hamburger_time_per_output_token_seconds", "A finished request's "
                          "seconds from its first tokens to its end, per token after the "
                          "first", ["mode"], registry=r, buckets=TPOT_BUCKETS)
    self.macro_steps = Counter("hamburger_macro_steps", "Macro steps (one base forward of a "
                               "row each) that emitted requests' tokens", ["mode"], registry=r)
    self.tokens_per_step = Histogram(
        "hamburger_tokens_per_macro_step", "Tokens each macro step of a finished request "
        "emitted (sum / count: tokens per base forward)", ["mode"], registry=r,
        buckets=tuple(float(k) for k in range(1, max(max_group, 1) + 1)))
    self.on_done_errors = Counter("hamburger_on_done_errors", "Requests whose on_done "
                                  "callback raised, so that their client may not have heard "
                                  "of their end (each is logged with its request id)",
                                  ["mode"], registry=r)
    for mode in self.modes:  # every series there from the start, at 0
      for state in ("finished", "cancelled", "failed", "refused"):
        self.requests.labels(mode, state)
      for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot,
                     self.macro_steps, self.tokens_per_step, self.on_done_errors):
        metric.labels(mode)
    r.register(_LoopState(loop))
    loop.observers.append(self)

  def refused(self, mode: str) -> None:
    self.requests.labels(mode if mode in self.modes else OTHER_MODE, "refused").inc()

  def ended(self, ticket: Ticket, gen: Generation) -> None:
    mode = ticket.mode
    finished = not gen.error
    state = "finished" if finished else "cancelled" if ticket.cancelled else "failed"
    self.requests.labels(mode, state).inc()
    self.prompt_tokens.labels(mode).inc(len(ticket.request.ids))
    tokens, steps = (gen.new_tokens, gen.macro_steps) if finished else (ticket.sent,
                                                                        ticket.steps)
    self.generation_tokens.labels(mode).inc(tokens)
    self.macro_steps.labels(mode).inc(steps)
    if ticket.first is not None:
      self.ttft.labels(mode).observe(ticket.first - ticket.submitted)
    if finished:
      per_step = self.tokens_per_step.labels(mode)
      for n in gen.groups:
        per_step.observe(n)
      if gen.new_tokens > 1 and ticket.first is not None:
        self.tpot.labels(mode).observe((ticket.ended - ticket.first) / (gen.new_tokens - 1))

  def on_done_failed(self, ticket: Ticket, _error: Exception) -> None:
    self.on_done_errors.labels(ticket.mode).inc()

  def render(self) -> bytes:
    return generate_latest(self.registry)
