"""Paper figures for the bench scripts: SVGs under docs/figures (bench/report.py owns
docs/plots, one plot per results file; a script draws its paper's figures itself)."""
import os
import subprocess
import sys

FIGURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "docs", "figures")


def pyplot(script, plot_only_arg):
    """matplotlib.pyplot with the Agg backend and reproducible SVGs, the figures directory
    made; or None when this interpreter has no matplotlib: then SCRIPT --plot-only
    PLOT_ONLY_ARG has run under /usr/bin/python3 (Debian's python3-matplotlib) instead, or
    the figures are skipped with a message."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if sys.executable != "/usr/bin/python3" and os.path.exists("/usr/bin/python3"):
            subprocess.run(["/usr/bin/python3", script, "--plot-only", plot_only_arg], check=False)
        else:
            print("plots skipped: matplotlib is missing (Debian python3-matplotlib)", file=sys.stderr)
        return None
    plt.rcParams["svg.hashsalt"] = "vmsight-bench"  # the same SVG for the same data
    os.makedirs(FIGURES, exist_ok=True)
    return plt
