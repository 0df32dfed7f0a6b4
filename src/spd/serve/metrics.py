"""`/metrics` in the Prometheus text format (version 0.0.4): requests, tokens, draft acceptance
per pipeline position, cycle time, queue depth, pipeline state and restarts.

A pure function of the scheduler's counters and totals and the backend's state; the numbers
are read without a lock (each is one int or float, written by the worker thread only).
"""

from __future__ import annotations

STATES = ("ok", "recovering", "failed")


def _metric(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    """One metric family: HELP, TYPE, then `(labels, value)` samples (labels a dict or None)."""
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        tags = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{tags} {value:g}" if isinstance(value, float) else f"{name}{tags} {value}")


def render(backend, scheduler) -> str:
    c, t = scheduler.counters, scheduler.totals
    lines: list[str] = []
    outcomes = {"finished": c.finished, "cancelled": c.cancelled, "failed": c.failed, "rejected": c.rejected}
    _metric(lines, "spd_requests_total", "counter", "Requests by outcome (rejected: queue full, 429).",
            [({"outcome": k}, v) for k, v in outcomes.items()])
    _metric(lines, "spd_generated_tokens_total", "counter", "New tokens decoded.", [(None, c.generated_tokens)])
    _metric(lines, "spd_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [(None, t.prompt_tokens)])
    _metric(lines, "spd_running_requests", "gauge", "Requests decoding now (0 or 1).",
            [(None, int(scheduler.running is not None))])
    _metric(lines, "spd_queue_depth", "gauge", "Requests waiting for the decoder.", [(None, scheduler.waiting)])
    _metric(lines, "spd_queue_size", "gauge", "Requests that may wait (--queue-size).", [(None, scheduler.queue_size)])
    _metric(lines, "spd_cycle_seconds", "summary", "Decode cycle time: decode seconds summed, cycles counted.", [])
    lines += [f"spd_cycle_seconds_sum {t.decode_seconds:g}", f"spd_cycle_seconds_count {t.cycles}"]
    position = lambda i: {"position": str(i + 1)}  # noqa: E731 -- pipeline fill when drafted: 1..n
    _metric(lines, "spd_drafts_verified_total", "counter", "Drafts verified, by pipeline position "
            "(tokens in flight when drafted; n is steady state).",
            [(position(i), v) for i, v in enumerate(t.verified_by_fill)])
    _metric(lines, "spd_drafts_accepted_total", "counter", "Drafts accepted, by pipeline position.",
            [(position(i), v) for i, v in enumerate(t.accepted_by_fill)])
    _metric(lines, "spd_draft_acceptance", "gauge", "Accepted / verified drafts, by pipeline position.",
            [(position(i), a / v if v else 0.0) for i, (a, v) in enumerate(zip(t.accepted_by_fill, t.verified_by_fill))])
    _metric(lines, "spd_pipeline_state", "gauge", "1 for the backend's state (ok, recovering, failed).",
            [({"state": s}, int(backend.state == s)) for s in STATES])
    _metric(lines, "spd_pipeline_restarts_total", "counter", "Times the stage processes were restarted.",
            [(None, backend.restarts)])
    return "\n".join(lines) + "\n"
