"""`fedhive metrics ID`: the per-round metrics a job's workflows recorded (also while it runs),
as a table, as JSON or as a plot.

JSON (`--json`, a stable schema):

    {"id": job id,
     "rounds": [{"workflow", "round" (0-based), "num_rounds", "at" (ISO 8601 UTC or null),
                 "aggregate": {name: value}, "sites": {site: {name: value}}}]}

oldest round first; a value JSON cannot hold (NaN, infinity) is null.

Table: one row per round: Round (`k/N`, 1-based), Workflow, one column per aggregate metric
(every name any round reported, in the order first seen) and Sites (how many sites' results
the round used).

`--plot FILE.png` draws every numeric aggregate metric against the round (1-based), one line
each (named `workflow: metric` when several workflows reported), with matplotlib's Agg backend
(no display needed); the format follows FILE's extension (png, svg, pdf; none: png). matplotlib
comes with the `plot` extra (`pip install 'fedhive[plot]'`): without it `--plot` fails with one
line saying so, before the gateway is asked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from fedhive import extras
from fedhive.cli.exits import Exit, exit_code, fail, fail_with
from fedhive.cli.jobs import _session, full_id
from fedhive.cli.options import JobId, JsonOpt, print_json
from fedhive.cli.render import iso
from fedhive.errors import ConfigError
from fedhive.jobs.metrics import RoundMetrics

Series = dict[str, tuple[list[int], list[float]]]


def metrics(
    ctx: typer.Context,
    job_id: JobId,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE.png", help="Also draw the aggregate metrics per round into FILE.",
        dir_okay=False,
    )] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the per-round metrics a job recorded (a table, JSON, or a plot with --plot)."""
    if plot is not None:
        try:
            extras.require("fedhive metrics --plot", "matplotlib")
        except ConfigError as err:
            raise fail(err) from None
    with _session(ctx) as session:
        job_id = full_id(session, job_id)
        rounds = session.metrics(job_id)
    if as_json:
        print_json(metrics_json(job_id, rounds))
    elif not rounds:
        typer.echo(f"Job {job_id} has recorded no round yet.")
    else:
        Console().print(metrics_table(job_id, rounds))
    if plot is None:
        return
    series = plot_series(rounds)
    if not series:
        raise fail_with(f"job {job_id} recorded no numeric aggregate metric: nothing to plot")
    try:
        write_plot(plot, job_id, series)
    except ValueError as err:  # a format matplotlib does not know: a bad --plot
        raise fail_with(f"cannot write the plot {plot}: {err}", Exit.USAGE) from None
    except OSError as err:  # a missing folder, no permission: 2; a full disk: 1
        raise fail_with(f"cannot write the plot {plot}: {err}", exit_code(err)) from None
    typer.echo(f"Plot written to {plot}", err=as_json)  # stdout stays JSON with --json


def metrics_json(job_id: str, rounds: list[RoundMetrics]) -> dict[str, Any]:
    return {
        "id": job_id,
        "rounds": [
            {"workflow": entry.workflow, "round": entry.round, "num_rounds": entry.num_rounds,
             "at": iso(entry.at_ms), "aggregate": entry.aggregate, "sites": entry.sites}
            for entry in rounds
        ],
    }


def metric_names(rounds: list[RoundMetrics]) -> list[str]:
    """Every aggregate metric name, sorted (a Struct on the wire keeps no key order)."""
    return sorted({name for entry in rounds for name in entry.aggregate})


def metrics_table(job_id: str, rounds: list[RoundMetrics]) -> Table:
    names = metric_names(rounds)
    table = Table("Round", "Workflow", *names, "Sites", title=f"job {job_id}")
    for column in table.columns[2:]:
        column.justify = "right"
    for entry in rounds:
        aggregate = entry.aggregate
        table.add_row(f"{entry.round + 1}/{entry.num_rounds}", entry.workflow,
                      *(_cell(aggregate.get(name)) for name in names), str(len(entry.sites)))
    return table


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def plot_series(rounds: list[RoundMetrics]) -> Series:
    """{line label: (rounds 1-based, values)} for every numeric aggregate metric; a round
    whose value is null (NaN when recorded) is a gap in its line."""
    several = len({entry.workflow for entry in rounds}) > 1
    series: Series = {}
    for entry in rounds:
        for name, value in entry.aggregate.items():
            number = _number(value)
            if number is None and value is not None:
                continue  # text or a structure: not plottable
            label = f"{entry.workflow}: {name}" if several else name
            xs, ys = series.setdefault(label, ([], []))
            xs.append(entry.round + 1)
            ys.append(math.nan if number is None else number)
    return {label: xy for label, xy in series.items() if any(map(math.isfinite, xy[1]))}


def write_plot(path: Path, job_id: str, series: Series) -> None:
    """Draw `series` into `path` (its extension picks the format); OSError when it cannot be
    written, ValueError for a format matplotlib does not know, ConfigError without matplotlib."""
    extras.require("drawing a plot", "matplotlib")
    # Imported here: matplotlib takes a while to load and only --plot needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)  # Agg, whatever the user's matplotlib backend is
    axes = figure.add_subplot()
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o", label=label)
    axes.set_xlabel("round")
    axes.set_ylabel("value")
    axes.set_title(f"job {job_id}")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format=path.suffix.lstrip(".").lower() or "png")
