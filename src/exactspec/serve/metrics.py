"""Prometheus metrics of the server, named like vLLM's and llama.cpp's (`exactspec:` prefix).

Counters of speculation (`exactspec:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total`; the same three `..._by_source_total{source}`; and per position
of a round's block `..._num_accepted_tokens_per_pos_total{position}` as vLLM's, with
`..._num_draft_tokens_per_pos_total{position}` beside it for a rate per position) and of tokens,
request latency and time-to-first-token histograms, and gauges of running and waiting requests.
Each server has its own registry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from exactspec.controller import MAX_GAMMA

PREFIX = "exactspec:"
# Positions 0..MAX_GAMMA-1 have a label each; a grammar round's forced drafts may reach further,
# and those positions are summed under one label (bounded label values).
DEEPER = f"{MAX_GAMMA}+"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20)


# (the key in `speculative_metrics`, the series' name, its help)
SOURCE_COUNTERS = (("num_spec_steps", "num_rounds", "Rounds"),
                   ("num_draft_tokens", "num_draft_tokens", "Draft tokens proposed"),
                   ("num_accepted_draft_tokens", "num_accepted_tokens", "Draft tokens accepted"))
POSITION_COUNTERS = (
    ("num_draft_tokens_per_pos", "num_draft_tokens",
     "Rounds that drafted a token at this position of the block (0: the first draft)"),
    ("num_accepted_tokens_per_pos", "num_accepted_tokens",
     "Draft tokens accepted at this position of the block (only after every one before it)"))


class ServerMetrics:
    """The server's metrics; `observe_request` adds one finished request's counts."""

    def __init__(self):
        self.registry = CollectorRegistry()
        counter = lambda name, doc, labels=(): Counter(PREFIX + name, doc, labels, registry=self.registry)
        self.num_drafts = counter("spec_decode_num_drafts",
                                  "Rounds, with drafts or not (by source: ..._num_rounds_by_source)")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.by_source = {key: counter(f"spec_decode_{name}_by_source", doc + ", by who drafted the round "
                                       "(\"plain\": a request's rounds without drafts)", ("source",))
                          for key, name, doc in SOURCE_COUNTERS}
        self.per_pos = {key: counter(f"spec_decode_{name}_per_pos", doc, ("position",))
                        for key, name, doc in POSITION_COUNTERS}
        for series in self.per_pos.values():  # every position is exported from the start
            for position in [*map(str, range(MAX_GAMMA)), DEEPER]:
                series.labels(position=position)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated for finished requests")
        self.requests = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.cancelled = counter("request_cancelled", "Requests whose row left early (client gone, stop string)")
        self.constrained = counter("request_constrained", "Finished requests with a response_format, by kind",
                                   ("kind",))
        self.rejected = counter("request_rejected", "Requests refused with an HTTP error", ("status",))
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch",
                             registry=self.registry)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to join the batch",
                             registry=self.registry)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)

    def observe_request(self, prompt_tokens: int, spec: dict, completion_tokens: int,
                        finish_reason: str, latency: float) -> None:
        self.num_drafts.inc(spec["num_spec_steps"])
        self.num_draft_tokens.inc(spec["num_draft_tokens"])
        self.num_accepted_tokens.inc(spec["num_accepted_draft_tokens"])
        self._observe_speculation(spec)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.requests.labels(finished_reason=finish_reason).inc()
        self.latency.observe(latency)

    def _observe_speculation(self, spec: dict) -> None:
        """A request's counts by source and per position (`protocol.speculative_metrics`)."""
        for source, counts in spec["by_source"].items():
            for key, series in self.by_source.items():
                series.labels(source=source).inc(counts[key])
        for key, series in self.per_pos.items():
            for position, n in enumerate(spec[key]):
                series.labels(position=str(position) if position < MAX_GAMMA else DEEPER).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
