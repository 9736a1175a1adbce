#!/usr/bin/env python3
"""The results file every benchmark writes: bench/results/<bench>[-<variant>].json.

One JSON document per run of a bench script (bench/README.md lists the fields):

  bench, variant   which benchmark (and which of its runs, e.g. hylics-control)
  commit, dirty    `git rev-parse --short HEAD`; `dirty: true` when tracked files had changes
  command          the command line (sys.argv), shell-quoted
  date, elapsed_s  when the run started (UTC, ISO 8601) and how long it took
  load_before, load_after   the first three numbers of /proc/loadavg at the start and the end
  host             nproc, kernel release, CPU model
  params           the script's parsed options
  keys, baseline   which fields of a repetition name its row (configuration, workload, ...),
                   and the row the ratios compare with
  reps             every repetition: one flat dict per repetition and configuration (`rep` is
                   its index), with every raw measurement (wall and host CPU seconds where the
                   script measures them); a list of numbers is a distribution
  summary          `rows`: per row the medians of every numeric field and their ratios to the
                   baseline row, plus what the script itself computes
  tables           the Markdown tables the script printed, parsed (title, columns, rows)

Python scripts:

    rec = results.Recorder("foundation", args, keys=["config"], baseline="qemu-virtio")
    rec.rep(config="qsd", rep=0, boot_s=3.3, host_cpu_s=4.1)
    rec.write(summary={...})          # at the end; returns the path

The Recorder copies what the script prints to stdout (it still goes to the terminal) and
keeps the Markdown tables found in it. Bash scripts pipe their record through the command line:

    python3 bench/lib/results.py --bench NAME [--out PATH] [--keys config] [--baseline X] \\
        [--date ISO] [--load-before "L1 L2 L3"] [--param K=V ...] --from-stdin -- "$0" "$@" < rec

where each line of `rec` that is a JSON object is one repetition and every other line is text
in which Markdown tables are found (the script's printed table).
"""
import argparse
import datetime
import io
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
RESULTS_DIR = os.path.join(REPO, "bench", "results")
# Fields of a repetition that count it, not measure it.
INDEX_FIELDS = ("rep", "run")


def default_path(bench, variant=None):
    """bench/results/<bench>[-<variant>].json in this checkout."""
    name = f"{bench}-{variant}" if variant else bench
    return os.path.join(RESULTS_DIR, f"{name}.json")


def add_out_option(ap, bench, flag="--out", variant_note=""):
    """Adds the results file option to an argparse parser (default None: default_path)."""
    ap.add_argument(flag, default=None, metavar="PATH",
                    help=f"results JSON (default bench/results/{bench}{variant_note}.json)")


def git_commit(repo=REPO):
    """(short commit, dirty): dirty when tracked files differ from HEAD (untracked are not
    counted: a run writes results files). (None, False) outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None, False
        st = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=60)
        return head.stdout.strip(), bool(st.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False


def loadavg():
    """The 1, 5 and 15 minute load averages, from /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def host_info():
    try:
        nproc = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        nproc = os.cpu_count()
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": nproc, "kernel": platform.release(), "cpu": cpu}


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def jsonable(v):
    """v with only JSON types: NaN becomes null and infinities "inf"/"-inf" (strict JSON has
    neither), tuples and sets lists, other objects their str()."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(v, dict):
        return {str(k) if not isinstance(k, str) else k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        return [jsonable(x) for x in v]
    if isinstance(v, argparse.Namespace):
        return jsonable(vars(v))
    return str(v)


def params_of(args):
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    return jsonable(dict(args))


def header(bench, params=None, argv=None, variant=None, date=None, load_before=None):
    """The fields every results document starts with."""
    commit, dirty = git_commit()
    doc = {"bench": bench}
    if variant:
        doc["variant"] = variant
    doc["commit"] = commit
    if dirty:
        doc["dirty"] = True
    doc["command"] = shlex.join(sys.argv if argv is None else argv)
    doc["date"] = date or now_iso()
    doc["load_before"] = load_before if load_before is not None else loadavg()
    doc["load_after"] = None
    doc["host"] = host_info()
    doc["params"] = params_of(params)
    return doc


# ------------------------------------------------------------------------------------------
# Markdown tables in printed text

_CELL_SPLIT = re.compile(r"(?<!\S)\|(?!\S)")
_SEPARATOR = re.compile(r"^\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*$")


def split_row(line):
    """The cells of a Markdown table row. A | inside a cell (E[X|m]) stays: only a bar with
    white space or the line's edge on both sides separates cells."""
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return [c.strip() for c in _CELL_SPLIT.split(s)]


def parse_tables(text):
    """Every Markdown table in text: [{"title", "columns", "rows"}, plus "heading"]. The title
    is the nearest non-blank line above the table (a heading's #s removed), "" if there is
    none; "heading" is the last Markdown heading since the previous table, when it is not the
    title itself."""
    lines = text.splitlines()
    out, i, last_text, heading = [], 0, "", ""
    while i < len(lines):
        line = lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.startswith("|") and _SEPARATOR.match(nxt):
            cols = split_row(line)
            rows, j = [], i + 2
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(split_row(lines[j]))
                j += 1
            table = {"title": last_text, "columns": cols, "rows": rows}
            if heading and heading != last_text:
                table["heading"] = heading
            out.append(table)
            last_text = heading = ""
            i = j
            continue
        if line:
            last_text = line.lstrip("#").strip()
            if line.startswith("#"):
                heading = last_text
        i += 1
    return out


class _Tee:
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream):
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


# ------------------------------------------------------------------------------------------
# Medians and ratios

def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def field(rep, path):
    """rep[path]; a dotted path reaches into nested dicts ("timed.index_lookups")."""
    v = rep
    for part in path.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def row_key(rep, keys):
    return tuple(rep.get(k) for k in keys)


def metric_names(reps, keys, metrics=None):
    """The numeric fields of the repetitions, in first-seen order (or `metrics` as given)."""
    if metrics:
        return list(metrics)
    skip = set(keys) | set(INDEX_FIELDS)
    names = []
    for r in reps:
        for k, v in r.items():
            if k not in skip and k not in names and is_number(v):
                names.append(k)
    return names


def group(reps, keys):
    """{row key: [reps]} in first-seen order."""
    rows = {}
    for r in reps:
        rows.setdefault(row_key(r, keys), []).append(r)
    return rows


def baseline_key(key, keys, baseline):
    """The baseline row's key for row `key`: the same key with the baseline's fields put in
    (None when the document has no baseline)."""
    if not baseline:
        return None
    return tuple(baseline.get(k, v) if k in baseline else v for k, v in zip(keys, key))


def median(xs):
    xs = [x for x in xs if is_number(x)]
    return statistics.median(xs) if xs else None


def summarize(reps, keys, baseline=None, metrics=None):
    """Per row: its key fields, the number of repetitions, the median of every metric and the
    ratio of each median to the baseline row's."""
    names = metric_names(reps, keys, metrics)
    rows = group(reps, keys)
    meds = {k: {m: median(field(r, m) for r in rs) for m in names} for k, rs in rows.items()}
    out = []
    for k, rs in rows.items():
        row = {"key": dict(zip(keys, k)), "n": len(rs), "median": meds[k]}
        b = meds.get(baseline_key(k, keys, baseline))
        if b is not None:
            row["ratio"] = {m: (meds[k][m] / b[m]) if is_number(meds[k][m]) and b.get(m) else None
                            for m in names}
        out.append(row)
    return {"metrics": names, "rows": out}


# ------------------------------------------------------------------------------------------
# The document

class Recorder:
    """Collects one run's repetitions and writes its results document.

    bench      the benchmark's name (the script's, without .py)
    args       the parsed options (argparse Namespace or dict): `params`
    out        the results file (None: default_path(bench, variant))
    variant    a suffix naming this run among the bench's runs
    keys       the fields of a repetition that name its row
    baseline   the row the ratios compare with: a value of `config` (a string) or a dict of
               key fields
    metrics    the fields to tabulate and plot (default every numeric field)
    capture    copy stdout to find the printed tables
    """

    def __init__(self, bench, args=None, out=None, variant=None, keys=("config",), baseline=None,
                 metrics=None, capture=True, argv=None):
        self.t0 = time.time()
        self.path = out or default_path(bench, variant)
        self.doc = header(bench, args, argv=argv, variant=variant)
        self.doc["keys"] = list(keys)
        if baseline is not None:
            self.doc["baseline"] = baseline if isinstance(baseline, dict) else {"config": baseline}
        if metrics:
            self.doc["metrics"] = list(metrics)
        self.reps = []
        self.tee = None
        if capture and not isinstance(sys.stdout, _Tee):
            self.tee = sys.stdout = _Tee(sys.stdout)

    def rep(self, **fields):
        """Adds one repetition (keyword fields); returns its dict."""
        self.reps.append(fields)
        return fields

    def add(self, fields):
        """Adds one repetition (a dict, copied)."""
        return self.rep(**fields)

    def printed(self):
        return self.tee.copy.getvalue() if self.tee else ""

    def document(self, summary=None, **extra):
        doc = dict(self.doc)
        doc["load_after"] = loadavg()
        doc["elapsed_s"] = round(time.time() - self.t0, 1)
        doc["reps"] = self.reps
        s = summarize(self.reps, doc["keys"], doc.get("baseline"), doc.get("metrics"))
        if isinstance(summary, dict):
            s.update(summary)
        elif summary is not None:
            s["script"] = summary
        doc["summary"] = s
        doc["tables"] = parse_tables(self.printed())
        doc.update(extra)
        return jsonable(doc)

    def write(self, summary=None, **extra):
        """Writes the document (again, if called before) and returns its path."""
        doc = self.document(summary, **extra)
        write_json(self.path, doc)
        print(f"results: {shown_path(self.path)}", file=sys.stderr)
        return self.path


def shown_path(path):
    """path relative to the working directory when it is below it, else absolute."""
    rel = os.path.relpath(path)
    return os.path.abspath(path) if rel.startswith("..") else rel


def dumps(doc, level=0):
    """doc as JSON text: objects and lists of objects one entry per line, indented by one space
    per level, and every other list (samples, traces of pairs) on one line, so results files
    with tens of thousands of samples stay small and their structure readable."""
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(doc, dict):
        if not doc:
            return "{}"
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, level + 1)}" for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(doc, list) and any(isinstance(x, dict) for x in doc):
        items = [inner + dumps(x, level + 1) for x in doc]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(doc, separators=(",", ":"))


def write_json(path, doc):
    """Writes doc to path through a temporary file (a reader never sees half a file)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(dumps(jsonable(doc)))
        f.write("\n")
    os.replace(tmp, path)


def load(path):
    """A results document, read back. Documents written before this module (qemu_faults'
    first files: `runs`, a loadavg string) get the same shape: reps, keys, index."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "bench" not in doc:
        raise ValueError(f"{path}: not a results document (no \"bench\" field)")
    if "reps" not in doc and isinstance(doc.get("runs"), list):
        doc["reps"] = doc["runs"]
    doc.setdefault("reps", [])
    if "keys" not in doc:
        doc["keys"] = ["config"] if any("config" in r for r in doc["reps"]) else []
    if doc.get("bench") == "qemu_faults" and "metrics" not in doc:
        doc["metrics"] = QEMU_FAULTS_METRICS
    for k in ("load_before", "load_after"):
        if isinstance(doc.get(k), str):
            try:
                doc[k] = [float(x) for x in doc[k].split()[:3]]
            except ValueError:
                pass
    return doc


# What qemu_faults measures per VM (its `class` and `exit` are outcomes, not measurements).
QEMU_FAULTS_METRICS = ["wall_s", "pair_host_cpu_s", "reads", "misdirected", "toggles"]


# ------------------------------------------------------------------------------------------
# Command line, for the bash benchmarks

def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Writes a results document from a bash benchmark's record on stdin: every "
                    "line that is a JSON object is one repetition, the other lines are text in "
                    "which Markdown tables are found.",
        usage="%(prog)s --bench NAME [options] --from-stdin [-- COMMAND ...]")
    ap.add_argument("--bench", required=True)
    ap.add_argument("--variant")
    ap.add_argument("--out", help="results file (default bench/results/BENCH[-VARIANT].json)")
    ap.add_argument("--keys", default="config", help="comma-separated row fields (default config)")
    ap.add_argument("--baseline", help="the baseline row's config, or KEY=VALUE,...")
    ap.add_argument("--metrics", default="", help="comma-separated fields to tabulate")
    ap.add_argument("--date", help="when the run started (default now)")
    ap.add_argument("--load-before", help="/proc/loadavg (or its first three numbers) at the start")
    ap.add_argument("--elapsed", type=float, help="seconds the run took")
    ap.add_argument("--param", action="append", default=[], metavar="K=V",
                    help="one of the script's options (repeatable)")
    ap.add_argument("--from-stdin", action="store_true", required=True,
                    help="read the record from stdin")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="after --: the benchmark's own command line")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    params = {}
    for p in a.param:
        k, eq, v = p.partition("=")
        if not eq:
            ap.error(f"--param takes K=V, not {p!r}")
        params[k] = _scalar(v)
    load0 = None
    if a.load_before:
        try:
            load0 = [float(x) for x in a.load_before.split()[:3]]
        except ValueError:
            ap.error(f"--load-before: not a load average: {a.load_before!r}")
    baseline = None
    if a.baseline:
        if "=" in a.baseline:
            baseline = dict(kv.split("=", 1) for kv in a.baseline.split(","))
        else:
            baseline = {"config": a.baseline}
    reps, text = [], []
    for line in sys.stdin:
        s = line.strip()
        if s.startswith("{") and s.endswith("}"):
            try:
                obj = json.loads(s)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                reps.append(obj)
                continue
        text.append(line)
    keys = [k for k in a.keys.split(",") if k]
    doc = header(a.bench, params, argv=command or [a.bench], variant=a.variant, date=a.date,
                 load_before=load0)
    doc["keys"] = keys
    if baseline:
        doc["baseline"] = baseline
    metrics = [m for m in a.metrics.split(",") if m]
    if metrics:
        doc["metrics"] = metrics
    doc["load_after"] = loadavg()
    if a.elapsed is not None:
        doc["elapsed_s"] = a.elapsed
    doc["reps"] = reps
    doc["summary"] = summarize(reps, keys, baseline, metrics or None)
    doc["tables"] = parse_tables("".join(text))
    path = a.out or default_path(a.bench, a.variant)
    write_json(path, doc)
    print(f"results: {shown_path(path)}", file=sys.stderr)
    return 0


def _scalar(v):
    for t in (int, float):
        try:
            return t(v)
        except ValueError:
            pass
    return v


if __name__ == "__main__":
    sys.exit(main())
