"""Benchmarks: `spd bench run` (harness, methods, report, costs) and `spd bench wallclock`."""

# `spd bench run`'s default methods, the paper's comparison (issue 24): SPD with and without
# retrieval, PPSD, EAGLE-style chains and trees. Here so the CLI's options need not import the harness.
DEFAULT_METHODS = ("ar,spd-n2,spd-n4,spd-n2+retrieval,spd-n4+retrieval,ppsd-n2,ppsd-n4,eagle-k3,eagle-k5,"
                   "eagle-k7,eagle-k5+retrieval,eagle-tree-b16,eagle-tree-b32")
# The dataset name of the summary rows over every dataset (report.py writes them, plots.py draws them).
OVERALL = "overall"
