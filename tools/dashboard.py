"""The Grafana dashboard, built in code with Grafana's own `grafana-foundation-sdk` (issue 34): the JSON that ships
(metrics/grafana-dashboard.json, imported as is) is this module's output, and tests/metrics/test_dashboard.py checks
that it is, and runs every panel's query against a real Prometheus that scraped a live daemon under load.

    python -m diffusiond.tools.dashboard --out metrics/grafana-dashboard.json

Each panel's queries select `job=~"$job"` and use `$__rate_interval`; the data source is a variable, so the file
imports into any Grafana with a Prometheus data source.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

OUT = Path(__file__).resolve().parents[1] / "metrics" / "grafana-dashboard.json"
SOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'job=~"$job"'
RATE = "[$__rate_interval]"


def quantile(q: float, metric: str, by: str = "", where: str = "") -> str:
    labels = ",".join(x for x in (JOB, where) if x)
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q:g}, sum by ({group}) (rate({metric}_bucket{{{labels}}}{RATE})))"


# (title, description, unit, [(expr, legend)]); each a time series panel, two to a row.
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    (
        "Throughput",
        "Finished requests per second by outcome, and denoising steps per second (summed over requests).",
        "reqps",
        [
            (f"sum by (outcome) (rate(diffusiond_requests_total{{{JOB}}}{RATE}))", "{{outcome}}"),
            (f"sum(rate(diffusiond_steps_total{{{JOB}}}{RATE}))", "steps/s"),
        ],
    ),
    (
        "Step cache",
        "Share of request-steps that reused their step cache (--cache: transformer blocks skipped); 0 without one.",
        "percentunit",
        [
            (
                f"sum(rate(diffusiond_step_cache_reused_total{{{JOB}}}{RATE})) / "
                f"sum(rate(diffusiond_steps_total{{{JOB}}}{RATE}))",
                "reused",
            ),
        ],
    ),
    (
        "Request latency",
        "Submission to final image, completed requests.",
        "s",
        [
            (quantile(q, "diffusiond_request_duration_seconds", where='outcome="completed"'), f"p{round(q * 100)}")
            for q in (0.5, 0.9, 0.99)
        ],
    ),
    (
        "Queue depth",
        "Requests waiting (paused ones included) and running, and paused for a higher class.",
        "short",
        [
            (f"sum(diffusiond_requests_waiting{{{JOB}}})", "waiting"),
            (f"sum(diffusiond_requests_running{{{JOB}}})", "running"),
            (f"sum(diffusiond_requests_paused{{{JOB}}})", "paused"),
        ],
    ),
    (
        "Queue wait",
        "Seconds from submission to joining the running batch.",
        "s",
        [(quantile(q, "diffusiond_queue_wait_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.95)],
    ),
    (
        "Batch size",
        "Requests sharing one batched denoising forward.",
        "short",
        [
            (
                f"sum(rate(diffusiond_batch_size_sum{{{JOB}}}{RATE})) / "
                f"sum(rate(diffusiond_batch_size_count{{{JOB}}}{RATE}))",
                "mean requests per forward",
            ),
            (quantile(0.95, "diffusiond_batch_size"), "p95"),
        ],
    ),
    (
        "Stage breakdown (seconds per second)",
        "Where serving time goes: queue, encode, denoise, sampler, preview, decode, broadcast, encode_response.",
        "s",
        [(f"sum by (stage) (rate(diffusiond_stage_seconds_sum{{{JOB}}}{RATE}))", "{{stage}}")],
    ),
    (
        "Stage latency p95",
        "Each stage's 95th percentile, per occurrence.",
        "s",
        [(quantile(0.95, "diffusiond_stage_seconds", by="stage"), "{{stage}}")],
    ),
    (
        "Time to first preview",
        "Submission to the first preview of requests that asked for previews.",
        "s",
        [(quantile(q, "diffusiond_time_to_first_preview_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.95)],
    ),
    (
        "Event loop lag",
        "How late the HTTP event loop wakes up; should stay in milliseconds while steps run.",
        "s",
        [(quantile(q, "diffusiond_event_loop_lag_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.99)],
    ),
    (
        "Queue wait by priority class (p95)",
        "Higher classes are admitted first; aging bounds a low class's wait (docs/http-api.md#priorities).",
        "s",
        [(quantile(0.95, "diffusiond_class_queue_wait_seconds", by="priority"), "class {{priority}}")],
    ),
    (
        "Latency by priority class (p95)",
        "Submission to final image or clip, completed requests, by class.",
        "s",
        [
            (
                quantile(0.95, "diffusiond_class_request_duration_seconds", by="priority", where='outcome="completed"'),
                "class {{priority}}",
            )
        ],
    ),
    (
        "Preemptions",
        "Running requests paused at a step boundary for a higher class, per second, by the paused request's class.",
        "short",
        [(f"sum by (priority) (rate(diffusiond_preemptions_total{{{JOB}}}{RATE}))", "class {{priority}}")],
    ),
    (
        "Tenants",
        "Finished requests per second by tenant and outcome, and each tenant's requests in flight.",
        "reqps",
        [
            (
                f"sum by (tenant, outcome) (rate(diffusiond_tenant_requests_total{{{JOB}}}{RATE}))",
                "{{tenant}} {{outcome}}",
            ),
            (f"sum by (tenant) (diffusiond_tenant_requests_in_flight{{{JOB}}})", "{{tenant}} in flight"),
        ],
    ),
    (
        "Result cache",
        "Share of lookups answered from finished results (requests with a seed; --result-cache-bytes).",
        "percentunit",
        [
            (
                f'sum(rate(diffusiond_result_cache_lookups_total{{{JOB},result="hit"}}{RATE})) / '
                f"sum(rate(diffusiond_result_cache_lookups_total{{{JOB}}}{RATE}))",
                "hit ratio",
            ),
        ],
    ),
    (
        "Result cache bytes",
        "Bytes of finished results kept for identical requests.",
        "bytes",
        [(f"sum(diffusiond_result_cache_bytes{{{JOB}}})", "kept")],
    ),
]


LEGEND = (
    common.VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM).show_legend(True)
)
TOOLTIP = common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.NONE)


def target(ref: str, expr: str, legend: str | None = None) -> prometheus.Dataquery:
    query = prometheus.Dataquery().ref_id(ref).expr(expr).datasource(SOURCE)
    return query.legend_format(legend) if legend is not None else query


def build() -> dict:
    board = (
        dashboard.Dashboard("diffusiond")
        .uid("diffusiond")
        .tags(["diffusiond"])
        .timezone("browser")
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("job")
            .label("Job")
            .datasource(SOURCE)
            .query("label_values(diffusiond_model_info, job)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .multi(True)
            .all_value(".*")
        )
    )
    for i, (title, description, unit, queries) in enumerate(PANELS):
        panel = timeseries.Panel().id(i + 1).title(title).description(description).unit(unit).datasource(SOURCE)
        panel = panel.grid_pos(GridPos(x=12 * (i % 2), y=8 * (i // 2), w=12, h=8)).legend(LEGEND).tooltip(TOOLTIP)
        for k, (expr, legend) in enumerate(queries):
            panel = panel.with_target(target(chr(ord("A") + k), expr, legend))
        board = board.with_panel(panel)
    row = len(PANELS) // 2 + len(PANELS) % 2
    model = (
        table.Panel()
        .id(len(PANELS) + 1)
        .title("Model")
        .show_header(True)
        .description("What each job serves (diffusiond_model_info's labels).")
        .datasource(SOURCE)
        .grid_pos(GridPos(x=0, y=8 * row, w=24, h=6))
        .with_target(target("A", f"diffusiond_model_info{{{JOB}}}").instant())
    )
    board = board.with_panel(model)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusiond.tools.dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(OUT), help=f"where to write it (default: {OUT}; - for stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
