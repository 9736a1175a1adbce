#!/usr/bin/env python3
"""Regenerates the benchmark tables and plots from every results file (bench/results/*.json).

  bench/report.py [--results DIR] [--doc PATH] [--plots DIR] [--no-plots]

Writes docs/benchmarks-generated.md (the whole file): per results file a header line (commit,
date, command, load), the tables the script printed, and a table of every repetition (per
configuration row and metric: the median, the ratio to the baseline row, every value), and
one SVG plot per results file under docs/plots/ (per configuration the median as a bar and
each repetition as a point; a CDF per row where a row has many repetitions or a measurement
is a distribution), and a second one, NAME-series.svg, where the repetitions carry time series
(lists of [x, y, ...] samples, e.g. a window trace). `make bench` ends with it. Plots need matplotlib (Debian's
python3-matplotlib, which scripts/setup-host.sh installs); without it the tables are still
written and the script says that no plot was drawn.
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "lib"))
import results as bench_results  # noqa: E402

COMMAND = "python3 bench/report.py"
# A row with more repetitions than this lists a range instead of every value, and is drawn as
# a CDF instead of points.
MAX_LISTED = 30
# At most this many metrics are drawn per results file (all are in the tables).
MAX_PANELS = 20
MAX_TITLE = 300


# ------------------------------------------------------------------------------------------
# Reading

def load_all(results_dir):
    """[(name, document)] for every results file in the directory, in benches.tsv's order
    first; files that are not results documents are skipped with a message."""
    docs = []
    for f in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        if not f.endswith(".json"):
            continue
        path = os.path.join(results_dir, f)
        try:
            docs.append((f[:-5], bench_results.load(path)))
        except (OSError, ValueError) as e:
            print(f"report.py: skipping {path}: {e}", file=sys.stderr)
    order = bench_order()
    docs.sort(key=lambda d: (order.get(d[0], len(order)), d[0]))
    return docs


def bench_order():
    """{name: position} from bench/benches.tsv (the order `make bench` runs them in)."""
    order = {}
    try:
        with open(os.path.join(HERE, "benches.tsv")) as f:
            for line in f:
                name = line.split("\t", 1)[0].strip()
                if name and not name.startswith("#"):
                    order.setdefault(name, len(order))
    except OSError:
        pass
    return order


# ------------------------------------------------------------------------------------------
# Values

def fmt(v):
    """A number in a table: four significant digits, no exponent for large values."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == int(v) and abs(v) < 1e15:
            return str(int(v))
        if abs(v) >= 1e4:
            return f"{v:.0f}"
        return f"{v:.4g}"
    return str(v)


def cell(v):
    """Text safe inside a Markdown table cell."""
    return str(v).replace("|", "\\|").replace("\n", " ")


def load_text(load):
    if isinstance(load, list):
        return " ".join(fmt(x) for x in load)
    return " ".join(str(load).split()[:3]) if load else "?"


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))]


def row_label(key):
    parts = [fmt(v) for v in key if v is not None and v != ""]
    return " / ".join(parts) if parts else "(all)"


def numbers(values):
    return [v for v in values if bench_results.is_number(v)]


def is_series(v):
    """A time series: a list of [x, y, ...] rows whose first two fields are numbers (later
    fields may be anything), e.g. a window trace of [seconds, bytes, ...] samples."""
    return (isinstance(v, list) and len(v) >= 2
            and all(isinstance(x, list) and len(x) >= 2 and bench_results.is_number(x[0])
                    and bench_results.is_number(x[1]) for x in v))


class View:
    """A results document's rows, metrics (numbers), distributions (lists of numbers) and
    outcomes (short strings and booleans with a few distinct values, counted), as the tables
    and plots show them."""

    def __init__(self, doc):
        self.doc = doc
        self.reps = [r for r in doc.get("reps", []) if isinstance(r, dict)]
        self.keys = list(doc.get("keys") or [])
        self.baseline = doc.get("baseline")
        self.rows = bench_results.group(self.reps, self.keys)
        names = bench_results.metric_names(self.reps, self.keys, doc.get("metrics"))
        self.metrics = [m for m in names
                        if any(bench_results.is_number(bench_results.field(r, m)) for r in self.reps)]
        skip = set(self.keys) | set(bench_results.INDEX_FIELDS) | set(self.metrics)
        self.distributions, self.outcomes, self.series = [], [], []
        for r in self.reps:
            for k, v in r.items():
                if k in skip or k in self.distributions or k in self.outcomes or k in self.series:
                    continue
                if isinstance(v, list) and v and all(bench_results.is_number(x) for x in v):
                    self.distributions.append(k)
                elif is_series(v):
                    self.series.append(k)
                elif isinstance(v, (str, bool)) and not k.endswith("_tail") and len(str(v)) <= 40:
                    self.outcomes.append(k)
        self.outcomes = [k for k in self.outcomes if 1 <= len({str(r.get(k)) for r in self.reps if k in r}) <= 12]

    def values(self, key, metric):
        return numbers(bench_results.field(r, metric) for r in self.rows[key])

    def pooled(self, key, dist):
        out = []
        for r in self.rows[key]:
            v = r.get(dist)
            if isinstance(v, list):
                out += numbers(v)
        return out

    def baseline_of(self, key):
        k = bench_results.baseline_key(key, self.keys, self.baseline)
        return k if k in self.rows else None


# ------------------------------------------------------------------------------------------
# Markdown

def header_line(name, doc):
    commit = doc.get("commit") or "?"
    if doc.get("dirty"):
        commit += " (with uncommitted changes)"
    host = doc.get("host") or {}
    load = f"load {load_text(doc.get('load_before'))} before"
    if doc.get("load_after"):
        load += f", {load_text(doc['load_after'])} after"
    parts = [f"commit {commit}", f"date {doc.get('date', '?')}", f"command `{doc.get('command', '?')}`", load]
    if host:
        parts.append(f"host {host.get('nproc', '?')} CPUs, kernel {host.get('kernel', '?')}")
    if doc.get("elapsed_s") is not None:
        parts.append(f"{fmt(round(doc['elapsed_s'] / 60, 1))} min")
    elif doc.get("minutes") is not None:
        parts.append(f"{fmt(doc['minutes'])} min")
    parts.append(f"{len(doc.get('reps', []))} repetitions recorded")
    return "**Run:** " + "; ".join(parts) + "."


def markdown_table(columns, rows):
    out = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        r = list(r) + [""] * (len(columns) - len(r))
        out.append("| " + " | ".join(cell(c) for c in r) + " |")
    return out


def listed(xs):
    if len(xs) <= MAX_LISTED:
        return ", ".join(fmt(x) for x in xs)
    return (f"{len(xs)} values: min {fmt(min(xs))}, p10 {fmt(percentile(xs, 10))}, p90 "
            f"{fmt(percentile(xs, 90))}, max {fmt(max(xs))} (each in the JSON)")


def reps_table(view):
    """Rows: (row, metric); columns: the key fields, metric, n, median, ratio, every rep."""
    has_ratio = bool(view.baseline)
    cols = [k for k in view.keys] or ["row"]
    columns = cols + ["metric", "n", "median"] + (["ratio to baseline"] if has_ratio else []) + ["every repetition"]
    rows = []
    for key in view.rows:
        keycells = [fmt(v) for v in key] if view.keys else ["(all)"]
        base = view.baseline_of(key)
        for m in view.metrics:
            xs = view.values(key, m)
            if not xs:
                continue
            med = statistics.median(xs)
            ratio = ""
            if base is not None:
                bx = view.values(base, m)
                bmed = statistics.median(bx) if bx else None
                ratio = f"{med / bmed:.2f}x" if bmed else ""
            rows.append(keycells + [m, len(xs), fmt(med)] + ([ratio] if has_ratio else []) + [listed(xs)])
        for d in view.distributions:
            xs = view.pooled(key, d)
            if xs:
                every = (f"{len(xs)} values: p50 {fmt(percentile(xs, 50))}, p90 {fmt(percentile(xs, 90))}, "
                         f"p99 {fmt(percentile(xs, 99))}, max {fmt(max(xs))}")
                rows.append(keycells + [f"{d} (distribution)", len(xs), fmt(statistics.median(xs))]
                            + ([""] if has_ratio else []) + [every])
        for o in view.outcomes:
            vals = [fmt(r[o]) for r in view.rows[key] if o in r]
            if vals:
                counts = {}
                for v in vals:
                    counts[v] = counts.get(v, 0) + 1
                rows.append(keycells + [o, len(vals), ", ".join(f"{v} ×{n}" for v, n in counts.items())]
                            + ([""] if has_ratio else []) + [listed_text(vals)])
    return markdown_table(columns, rows), len(rows)


def listed_text(vals):
    return ", ".join(vals) if len(vals) <= MAX_LISTED else "(each in the JSON)"


def section(name, doc, plot):
    view = View(doc)
    title = name
    out = [f"## {title}", "", f"`bench/results/{name}.json`", "", header_line(name, doc), ""]
    if doc.get("params"):
        opts = ", ".join(f"{k} {fmt(v) if not isinstance(v, (list, dict)) else v}"
                         for k, v in doc["params"].items() if v not in (None, False, "", []))
        out += [f"Options: {cell(opts)}.", ""]
    if doc.get("sessions"):
        out.append("Sessions added to this file:")
        for s in doc["sessions"]:
            out.append(f"- {s.get('date', '?')}, commit {s.get('commit', '?')}, load "
                       f"{load_text(s.get('load_before'))}: `{s.get('command', '?')}`")
        out.append("")
    for p in plot or []:
        out += [f"![{name}](plots/{os.path.basename(p)})", ""]
    tables = doc.get("tables") or []
    if tables:
        out += ["### As the script printed it", ""]
        for t in tables:
            heading = t.get("heading")
            if heading:
                out += [f"*{cell(heading[:MAX_TITLE])}*", ""]
            if t.get("title"):
                out += [cell(t["title"][:MAX_TITLE]), ""]
            out += markdown_table(t.get("columns", []), t.get("rows", [])) + [""]
    table, n = reps_table(view)
    if n:
        base = ""
        if view.baseline:
            base = (" The ratio is the median over the baseline row's median ("
                    + ", ".join(f"{k} {v}" for k, v in view.baseline.items()) + ", same other fields).")
        out += ["### Every repetition", "",
                f"Medians per row and measurement, and every repetition's value.{base}", ""] + table + [""]
    else:
        out += ["(No repetitions recorded.)", ""]
    return out


def document(docs, plots):
    out = ["# Benchmark results (generated)", "",
           f"Generated by `{COMMAND}` (the last step of `make bench`) from every `bench/results/*.json`; "
           "do not edit by hand: re-run `make bench` (or `make bench BENCH=name` for one benchmark) "
           f"or `{COMMAND}`. What the numbers mean, and the runs before these files existed, are in "
           "[benchmarks.md](benchmarks.md); how to run, the JSON fields and how to add a benchmark in "
           "[bench/README.md](../bench/README.md).", ""]
    if not docs:
        out += ["No results yet: `make bench` writes them.", ""]
    else:
        out += ["| results | commit | date | command |", "|---|---|---|---|"]
        for name, doc in docs:
            anchor = "".join(c for c in name.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
            out.append(f"| [{name}](#{anchor}) | {cell(doc.get('commit') or '?')} | "
                       f"{cell(doc.get('date', '?'))} | `{cell(doc.get('command', '?'))}` |")
        out.append("")
    for name, doc in docs:
        out += section(name, doc, plots.get(name))
    return "\n".join(out).rstrip("\n") + "\n"


# ------------------------------------------------------------------------------------------
# Plots

def import_pyplot(reexec=False):
    """matplotlib.pyplot (Agg), or None. When this interpreter lacks matplotlib but Debian's
    /usr/bin/python3 (the one python3-matplotlib installs for) has it, and `reexec` allows it
    (the command line does), the script runs again under that one."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        pass
    system = "/usr/bin/python3"
    if (reexec and os.environ.get("BENCH_REPORT_REEXEC") != "1" and os.path.exists(system)
            and os.path.realpath(sys.executable) != os.path.realpath(system)):
        import subprocess
        ok = subprocess.run([system, "-c", "import matplotlib"], capture_output=True).returncode == 0
        if ok:
            print(f"report.py: {sys.executable} has no matplotlib; running under {system}, which has it",
                  file=sys.stderr)
            sys.stdout.flush()
            os.environ["BENCH_REPORT_REEXEC"] = "1"
            os.execv(system, [system, os.path.abspath(__file__)] + sys.argv[1:])
    return None


def plot(plt, name, doc, path):
    """One figure per results file: a panel per metric (bars of the medians per row, a point
    per repetition; a CDF per row when a row has more than MAX_LISTED repetitions) and a CDF
    panel per distribution. Returns False when there is nothing to draw."""
    view = View(doc)
    panels = [("metric", m) for m in view.metrics if any(view.values(k, m) for k in view.rows)]
    panels += [("dist", d) for d in view.distributions]
    panels = panels[:MAX_PANELS]
    if not panels or not view.rows:
        return False
    labels = {k: row_label(k) for k in view.rows}
    keys = list(view.rows)
    fig, axes = grid(plt, len(panels), max(1.6, 0.28 * len(keys) + 0.9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (kind, m) in zip(axes.flat, panels):
        many = kind == "dist" or max(len(view.values(k, m)) for k in keys) > MAX_LISTED
        if many:
            for i, k in enumerate(keys):
                xs = sorted(view.pooled(k, m) if kind == "dist" else view.values(k, m))
                if xs:
                    ys = [(j + 1) / len(xs) for j in range(len(xs))]
                    ax.step(xs, ys, where="post", label=labels[k], color=colors[i % len(colors)])
            ax.set_ylabel("fraction")
            ax.set_xlabel(m)
            ax.legend(fontsize=6, loc="lower right")
            ax.set_title(f"{m}: CDF", fontsize=8)
        else:
            ys = list(range(len(keys)))
            meds = [statistics.median(view.values(k, m)) if view.values(k, m) else 0 for k in keys]
            ax.barh(ys, meds, color="#9ecae1", height=0.6, label="median")
            for y, k in zip(ys, keys):
                xs = view.values(k, m)
                ax.plot(xs, [y] * len(xs), "o", color="#08519c", markersize=3)
            ax.set_yticks(ys)
            ax.set_yticklabels([labels[k] for k in keys], fontsize=6)
            ax.invert_yaxis()
            ax.set_title(f"{m} (bar: median, points: repetitions)", fontsize=8)
        ax.tick_params(axis="x", labelsize=6)
    return finish(plt, fig, axes, len(panels), name, doc, path)


def grid(plt, n, panel_h):
    """A figure of n panels, up to three per row: (figure, axes as a 2-D array)."""
    ncols = 1 if n == 1 else 2 if n <= 4 else 3
    nrows = (n + ncols - 1) // ncols
    return plt.subplots(nrows, ncols, figsize=(5.2 * ncols, panel_h * nrows), squeeze=False)


def finish(plt, fig, axes, used, name, doc, path):
    """Blanks the unused panels, titles the figure with the results' commit and date, and
    writes it as SVG to path. Returns True."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(f"{name} ({doc.get('commit') or '?'}, {doc.get('date', '?')})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return True


def series_plot(plt, name, doc, path):
    """One figure per results file that has time series (View.series): per series field and
    per value of every key but the last, a panel with one line per value of the last key (for
    example a panel per congestion control, FoxyVegas off and on as its lines), drawn from
    each row's first repetition: x the first field of each sample, y the second. Returns
    False when there is nothing to draw."""
    view = View(doc)
    if not view.series or not view.rows:
        return False
    groups = {}
    for key in view.rows:
        groups.setdefault(key[:-1], []).append(key)
    panels = [(f, g) for f in view.series[:2] for g in groups][:MAX_PANELS]
    fig, axes = grid(plt, len(panels), 2.4)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (f, g) in zip(axes.flat, panels):
        for i, key in enumerate(groups[g]):
            first = next((r[f] for r in view.rows[key] if is_series(r.get(f))), None)
            if first:
                ax.plot([x[0] for x in first], [x[1] for x in first], linewidth=0.8,
                        label=fmt(key[-1]), color=colors[i % len(colors)])
        ax.set_title(f"{f}: {row_label(g)} (first repetition)", fontsize=8)
        ax.legend(fontsize=6, loc="upper right")
        ax.tick_params(labelsize=6)
    return finish(plt, fig, axes, len(panels), name, doc, path)


# ------------------------------------------------------------------------------------------

def main(argv=None, reexec=False):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"), help="results directory")
    ap.add_argument("--doc", default=os.path.join(REPO, "docs", "benchmarks-generated.md"))
    ap.add_argument("--plots", default=os.path.join(REPO, "docs", "plots"), help="SVG directory")
    ap.add_argument("--no-plots", action="store_true", help="write the tables only")
    a = ap.parse_args(argv)
    docs = load_all(a.results)
    plots = {}
    if not a.no_plots:
        plt = import_pyplot(reexec)
        if plt is None:
            print("report.py: matplotlib is not installed (Debian: apt-get install python3-matplotlib; "
                  "scripts/setup-host.sh installs it): tables only, no plot drawn", file=sys.stderr)
        else:
            plt.rcParams["svg.hashsalt"] = "vmsight-bench"  # the same SVG for the same data
            plt.rcParams["svg.fonttype"] = "none"  # text as text: smaller, searchable
            os.makedirs(a.plots, exist_ok=True)
            for name, doc in docs:
                for path, draw in ((os.path.join(a.plots, f"{name}.svg"), plot),
                                   (os.path.join(a.plots, f"{name}-series.svg"), series_plot)):
                    if draw(plt, name, doc, path):
                        plots.setdefault(name, []).append(path)
            # The directory holds the plots of the current results only.
            drawn = {p for ps in plots.values() for p in ps}
            for f in os.listdir(a.plots):
                p = os.path.join(a.plots, f)
                if f.endswith(".svg") and p not in drawn:
                    os.unlink(p)
    text = document(docs, plots)
    os.makedirs(os.path.dirname(os.path.abspath(a.doc)), exist_ok=True)
    with open(a.doc, "w") as f:
        f.write(text)
    print(f"report.py: {len(docs)} results files -> {bench_results.shown_path(a.doc)}, "
          f"{sum(len(p) for p in plots.values())} plots in {bench_results.shown_path(a.plots)}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(reexec=True))
