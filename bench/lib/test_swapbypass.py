"""Tests of bench/swapbypass.py's parsing of the guest's output (no VMs):
python3 -m unittest bench/lib/test_swapbypass.py"""
import importlib.util
import os
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("swapbypass", os.path.join(HERE, "..", "swapbypass.py"))
swapbypass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(swapbypass)

# What the guest prints around a bypass run: the probes before, the workload, the probes after
# (the state line of swap_stats has several words before its KEY VALUE pairs).
STDOUT = """swapbench vmstat pswpin 0 pswpout 0
swapbench meminfo MemTotal: 222352 kB SwapTotal: 524284 kB SwapFree: 524284 kB
swapbench cpu cpu 40 0 408 315 2 0 3 0 0 0
swapbench tlb 100
swapbench kswapd 0 0
swapbench symswap state active /dev/vdb 130559 vmm_state 1 stores 1 loads 2 store_ns 10 load_ns 20 copy_ns 5
stream mib=300 iters=4 seconds=75.5 MBps=52.0 valid=1 errors=0
swapbench latency swb_fault 1099254 36000000000
swapbench latency swb_dreclaim 252 1848954106
swapbench vmstat pswpin 1000 pswpout 1200
swapbench meminfo MemTotal: 222352 kB SwapTotal: 524284 kB SwapFree: 523516 kB
swapbench cpu cpu 2440 0 13408 3815 12 1 4 0 0 0
swapbench tlb 5100
swapbench kswapd 100 5000
swapbench symswap state active /dev/vdb 130559 vmm_state 1 stores 1201 loads 1002 store_ns 5000000010 load_ns 4000000020 copy_ns 3000000005
"""


class ParseOutput(unittest.TestCase):
    def test_the_breakdown_is_the_difference_of_the_probes_around_the_workload(self):
        out = swapbypass.parse_output("stream", STDOUT)
        self.assertEqual(out["pswpin"], 1000)
        self.assertEqual(out["pswpout"], 1200)
        self.assertEqual(out["result"]["seconds"], 75.5)
        b = out["breakdown"]
        self.assertAlmostEqual(b["user_s"], 24.0)
        self.assertAlmostEqual(b["system_s"], 130.0)
        self.assertAlmostEqual(b["idle_s"], 35.1)
        self.assertAlmostEqual(b["irq_s"], 0.02)
        self.assertAlmostEqual(b["kswapd_s"], 51.0)
        self.assertEqual(b["tlb_shootdowns"], 5000)
        self.assertAlmostEqual(b["store_s"], 5.0)
        self.assertAlmostEqual(b["load_s"], 4.0)
        self.assertAlmostEqual(b["copy_s"], 3.0)
        self.assertEqual((b["module_stores"], b["module_loads"]), (1200, 1000))
        self.assertAlmostEqual(b["kernel_path_s"], 121.0)
        self.assertAlmostEqual(b["swapin_fault_s"], 36.0)
        self.assertEqual(b["swapin_faults"], 1099254)
        self.assertEqual(b["direct_reclaims"], 252)

    def test_without_the_module_or_the_probes_the_breakdown_has_only_what_was_read(self):
        lines = [l for l in STDOUT.splitlines() if not l.startswith(("swapbench symswap", "swapbench latency"))]
        b = swapbypass.parse_output("stream", "\n".join(lines))["breakdown"]
        self.assertAlmostEqual(b["system_s"], 130.0)
        for k in ("store_s", "kernel_path_s", "swapin_fault_s"):
            self.assertNotIn(k, b)

    def test_a_run_that_printed_no_probe_has_no_breakdown(self):
        self.assertIsNone(swapbypass.parse_output("stream", "stream seconds=1 valid=1\n")["breakdown"])


if __name__ == "__main__":
    unittest.main()


class Configs(unittest.TestCase):
    def test_the_bio_variant_is_the_bypass_with_the_module_told_to_offer_no_rw_page(self):
        import argparse
        a = argparse.Namespace(configs=["bypass", "bypass-bio"], cache_sizes=[128], swap_size=512, mem=256,
                               ideal_mem=1024, zram_comp="")
        cfgs = swapbypass.configs(a)
        self.assertEqual([c[0] for c in cfgs], ["bypass-128M", "bypass-bio-128M"])
        plain, bio = cfgs[0][3], cfgs[1][3]
        self.assertNotIn("--append", plain)
        self.assertEqual(bio[:len(plain)], plain)
        self.assertEqual(bio[len(plain):], ["--append", "vmsight_sym.swap_rw_page=0"])
        self.assertEqual(cfgs[1][1], "bypass-bio")
