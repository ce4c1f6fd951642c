"""benchmarks/gpu_check.sh is run on a lent GPU a few minutes at a time: a step whose command line its benchmark does
not accept would waste that time. Every benchmark command in the script is parsed here by the benchmark's own
argument parser, and the script's syntax and step keys are checked. GPUs needed: 0."""

import argparse
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _commands() -> list[tuple[str, list[str]]]:
    """(benchmark name, its arguments) of every ``"$PY" benchmarks/NAME.py ...`` in the script."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        for match in re.finditer(r'"\$PY" benchmarks/(\w+)\.py([^\n]*)', line):
            found.append((match.group(1), shlex.split(match.group(2))))
    return found


class _Parsed(Exception):
    pass


def test_the_script_parses_and_names_its_steps():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    keys = re.findall(r'^\s*step (\w+) "', SCRIPT.read_text(), re.M)
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    for key in set(keys):
        assert re.search(rf"#\s+(\w+, )*{key}\b", header), f"step key {key!r} is not described in the header"


@pytest.mark.parametrize("name,args", _commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_every_benchmark_command_is_accepted_by_its_parser(monkeypatch, name, args):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        original(self, argv, namespace)  # exits with status 2 on an argument it does not accept
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr("sys.argv", [f"{name}.py", *args])
    with pytest.raises(_Parsed):
        module.parse_args(args) if hasattr(module, "parse_args") else module.main()
