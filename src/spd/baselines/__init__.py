"""Baselines measured in the same harness as SPD: AR (here), EAGLE-style drafting, PPSD."""
