"""Tests of bench/lib/results.py (no VMs): python3 -m unittest bench/lib/test_results.py"""
import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import results  # noqa: E402

REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def read_json(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f)

PRINTED = """### Foundation benchmarks (2026-11-27, medians of 2 runs)

| metric | qemu-virtio | vmsight | vmsight / qemu-virtio |
|---|---|---|---|
| boot to guest init (s) | 3.50 | 3.60 | 1.03x |
| getppid loop (ns/call) | 500 | 510 | 1.02x |

raw: {"x": 1}
| share (MiB) | E[X|m] measured (s) |
|---|---:|
| 8 | 0.036 |
"""


class Tables(unittest.TestCase):
    def test_parse_tables(self):
        t = results.parse_tables(PRINTED)
        self.assertEqual(len(t), 2)
        self.assertEqual(t[0]["title"], "Foundation benchmarks (2026-11-27, medians of 2 runs)")
        self.assertEqual(t[0]["columns"], ["metric", "qemu-virtio", "vmsight", "vmsight / qemu-virtio"])
        self.assertEqual(t[0]["rows"][1], ["getppid loop (ns/call)", "500", "510", "1.02x"])
        # A bar inside a cell stays; the title is the line above the table.
        self.assertEqual(t[1]["columns"], ["share (MiB)", "E[X|m] measured (s)"])
        self.assertEqual(t[1]["title"], 'raw: {"x": 1}')
        self.assertEqual(t[1]["rows"], [["8", "0.036"]])

    def test_heading_above_a_caption(self):
        t = results.parse_tables("### find, disk model hdd\ncache 64 MiB\n\n| a |\n|---|\n| 1 |\n"
                                 "# second\n| b |\n|---|\n")
        self.assertEqual((t[0]["title"], t[0]["heading"]), ("cache 64 MiB", "find, disk model hdd"))
        self.assertEqual(t[1]["title"], "second")
        self.assertNotIn("heading", t[1])
        self.assertEqual(t[1]["rows"], [])

    def test_empty_cells_and_no_table(self):
        t = results.parse_tables("| a | b | c |\n|---|---|---|\n| x |  | z |\n")
        self.assertEqual(t[0]["rows"], [["x", "", "z"]])
        self.assertEqual(results.parse_tables("| not | a table |\nbecause no separator\n"), [])


class Summary(unittest.TestCase):
    REPS = [
        {"config": "base", "rep": 0, "wall_s": 10.0, "cpu_s": 4.0},
        {"config": "new", "rep": 0, "wall_s": 12.0, "cpu_s": 5.0},
        {"config": "base", "rep": 1, "wall_s": 12.0, "cpu_s": 6.0},
        {"config": "new", "rep": 1, "wall_s": 18.0, "cpu_s": 7.0, "note": "text"},
        {"config": "new", "rep": 2, "wall_s": 13.0, "cpu_s": None},
    ]

    def test_medians_and_ratios(self):
        s = results.summarize(self.REPS, ["config"], {"config": "base"})
        self.assertEqual(s["metrics"], ["wall_s", "cpu_s"])
        base, new = s["rows"]
        self.assertEqual(base["key"], {"config": "base"})
        self.assertEqual((base["n"], new["n"]), (2, 3))
        self.assertEqual(base["median"], {"wall_s": 11.0, "cpu_s": 5.0})
        self.assertEqual(new["median"], {"wall_s": 13.0, "cpu_s": 6.0})
        self.assertAlmostEqual(new["ratio"]["wall_s"], 13.0 / 11.0)
        self.assertEqual(base["ratio"]["cpu_s"], 1.0)

    def test_baseline_per_other_key(self):
        reps = [{"workload": w, "config": c, "rep": 0, "t": t}
                for w, c, t in (("a", "off", 2.0), ("a", "on", 3.0), ("b", "off", 10.0), ("b", "on", 5.0))]
        s = results.summarize(reps, ["workload", "config"], {"config": "off"})
        ratios = {(r["key"]["workload"], r["key"]["config"]): r["ratio"]["t"] for r in s["rows"]}
        self.assertEqual(ratios, {("a", "off"): 1.0, ("a", "on"): 1.5, ("b", "off"): 1.0, ("b", "on"): 0.5})

    def test_dotted_metrics_and_no_baseline(self):
        reps = [{"config": "x", "rep": i, "timed": {"lookups": i * 2}} for i in range(3)]
        s = results.summarize(reps, ["config"], None, ["timed.lookups"])
        self.assertEqual(s["rows"][0]["median"], {"timed.lookups": 2})
        self.assertNotIn("ratio", s["rows"][0])


class Values(unittest.TestCase):
    def test_jsonable(self):
        v = results.jsonable({"a": float("nan"), "b": float("inf"), "c": (1, 2), ("k", 1): {3},
                              "d": argparse.Namespace(x=1)})
        self.assertEqual(v, {"a": None, "b": "inf", "c": [1, 2], "('k', 1)": [3], "d": {"x": 1}})
        json.dumps(v, allow_nan=False)

    def test_dumps_keeps_samples_on_one_line_and_reads_back_equal(self):
        doc = {"reps": [{"cc": "bic", "trace": [[0.0, 14600], [0.5, 28960]], "samples": [1.5, 2.0],
                         "empty": {}, "nested": {"x": [1, {"y": 2}]}}], "n": 3, "s": "a\"b"}
        text = results.dumps(doc)
        self.assertEqual(json.loads(text), doc)
        self.assertIn('"trace": [[0.0,14600],[0.5,28960]]', text)
        self.assertIn('"samples": [1.5,2.0]', text)
        # One line per rep and per key: a reader can still diff the structure.
        self.assertIn('\n  {\n   "cc": "bic",\n', text)

    def test_loadavg_and_host(self):
        load = results.loadavg()
        self.assertEqual(len(load), 3)
        self.assertTrue(all(isinstance(x, float) for x in load))
        h = results.host_info()
        self.assertGreaterEqual(h["nproc"], 1)
        self.assertTrue(h["kernel"])

    def test_header(self):
        h = results.header("x", {"reps": 2}, argv=["bench/x.py", "--name", "a b"])
        self.assertEqual(h["command"], "bench/x.py --name 'a b'")
        self.assertEqual(h["params"], {"reps": 2})
        self.assertRegex(h["date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        commit, dirty = results.git_commit()
        self.assertEqual(h["commit"], commit)
        self.assertEqual(h.get("dirty", False), dirty)
        if commit is not None:
            self.assertRegex(commit, r"^[0-9a-f]{4,}$")

    def test_default_path(self):
        self.assertEqual(results.default_path("icache"), os.path.join(REPO, "bench", "results", "icache.json"))
        self.assertTrue(results.default_path("hylics", "control").endswith("bench/results/hylics-control.json"))


class RecorderTest(unittest.TestCase):
    def test_write(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "sub", "b.json")
            real = sys.stdout
            sys.stdout = io.StringIO()
            try:
                rec = results.Recorder("b", argparse.Namespace(reps=2, out=out), out=out,
                                       keys=["config"], baseline="base", argv=["bench/b.py"])
                rec.rep(config="base", rep=0, wall_s=1.0, host_cpu_s=2.0, lat_ms=[1, 2, 3])
                rec.add({"config": "new", "rep": 0, "wall_s": 2.0, "host_cpu_s": 3.0})
                print("| config | wall |\n|---|---|\n| base | 1.0 |")
                shown = sys.stdout.stream.getvalue()
                path = rec.write(summary={"speedup": 2.0})
            finally:
                sys.stdout = real
            self.assertEqual(path, out)
            self.assertIn("| base | 1.0 |", shown)  # still printed
            doc = read_json(out)
            for k in ("bench", "commit", "command", "date", "load_before", "load_after", "host", "params",
                      "reps", "summary", "tables", "keys", "baseline", "elapsed_s"):
                self.assertIn(k, doc)
            self.assertEqual(doc["bench"], "b")
            self.assertEqual(doc["params"], {"reps": 2, "out": out})
            self.assertEqual(len(doc["reps"]), 2)
            self.assertEqual(doc["reps"][0]["lat_ms"], [1, 2, 3])
            self.assertEqual(doc["summary"]["speedup"], 2.0)
            self.assertEqual(doc["summary"]["rows"][1]["ratio"]["wall_s"], 2.0)
            self.assertEqual(doc["tables"][0]["rows"], [["base", "1.0"]])
            self.assertEqual(doc["baseline"], {"config": "base"})
            self.assertEqual(len(doc["load_after"]), 3)
            self.assertFalse([f for f in os.listdir(os.path.dirname(out)) if ".tmp" in f])

    def test_load_legacy_qemu_faults(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "q.json")
            write_json(p, {"bench": "qemu_faults", "load_before": "1.5 2.0 2.5 1/80 123",
                           "runs": [{"config": "qemu11", "run": 0, "wall_s": 9.0, "class": "ok"}]})
            doc = results.load(p)
            self.assertEqual(doc["reps"][0]["wall_s"], 9.0)
            self.assertEqual(doc["keys"], ["config"])
            self.assertEqual(doc["load_before"], [1.5, 2.0, 2.5])
            self.assertIn("wall_s", doc["metrics"])
            write_json(p, [1, 2])
            with self.assertRaises(ValueError):
                results.load(p)

    def test_existing_results_load(self):
        for name in sorted(os.listdir(results.RESULTS_DIR)) if os.path.isdir(results.RESULTS_DIR) else []:
            if name.endswith(".json"):
                doc = results.load(os.path.join(results.RESULTS_DIR, name))
                self.assertTrue(doc["reps"], name)


class CommandLine(unittest.TestCase):
    def test_from_stdin(self):
        record = "\n".join([
            '{"config": "on", "rep": 0, "peak_anon_kib": 2048}',
            '{"config": "off", "rep": 0, "peak_anon_kib": 1024}',
            "not json {",
            "| configuration | peak private memory (MiB) |",
            "|---|---|",
            "| streaming on | 2.0 |",
        ]) + "\n"
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "m.json")
            p = subprocess.run(
                [sys.executable, os.path.join(HERE, "results.py"), "--bench", "stream-memory", "--out", out,
                 "--baseline", "off", "--date", "2026-01-02T03:04:05Z", "--load-before", "0.5 0.6 0.7 1/2 3",
                 "--param", "reps=1", "--param", "mode=x", "--from-stdin", "--", "bench/stream-memory.sh",
                 "--reps", "1"], input=record, capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            doc = read_json(out)
        self.assertEqual(doc["bench"], "stream-memory")
        self.assertEqual(doc["command"], "bench/stream-memory.sh --reps 1")
        self.assertEqual(doc["date"], "2026-01-02T03:04:05Z")
        self.assertEqual(doc["load_before"], [0.5, 0.6, 0.7])
        self.assertEqual(doc["params"], {"reps": 1, "mode": "x"})
        self.assertEqual([r["config"] for r in doc["reps"]], ["on", "off"])
        self.assertEqual(doc["summary"]["rows"][0]["ratio"]["peak_anon_kib"], 2.0)
        self.assertEqual(doc["tables"][0]["rows"], [["streaming on", "2.0"]])

    def test_help(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "results.py"), "--help"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0)
        self.assertIn("--from-stdin", p.stdout)


if __name__ == "__main__":
    unittest.main()
