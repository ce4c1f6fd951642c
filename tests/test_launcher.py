"""tests/dist_utils.run_script: the ranks forked from the pre-imported server behave as the same program started by
python (one rank) or torchrun (several): what each rank is told, its output, its exit status, a failing rank
stopping the others, the time limit; the same script under FORGE_TEST_LAUNCH=exec prints the same."""

import os
import subprocess
import textwrap
import time

import pytest

from tests.dist_utils import LAUNCH_ENV, run_script

SCRIPT = textwrap.dedent("""\
    import atexit, os, sys, threading, time
    rank = os.environ.get("RANK", "-")
    print(f"rank {rank} of {os.environ.get('WORLD_SIZE', '-')} local {os.environ.get('LOCAL_RANK', '-')} "
          f"argv {sys.argv[1:]} name {__name__} marker {os.environ.get('FORGE_LAUNCH_MARKER')}")
    print(f"rank {rank} to stderr", file=sys.stderr)
    mode = sys.argv[1]
    if mode == "fail" and rank in ("1", "-"):
        sys.exit(3)
    if mode == "raise":
        raise ValueError("raised in the script")
    if mode in ("fail", "hang"):
        time.sleep(600)
    if mode == "exits":  # a worker thread's output and an atexit handler's, as the interpreter's own exit runs them
        threading.Thread(target=lambda: (time.sleep(0.2), print(f"rank {rank} thread done"))).start()
        atexit.register(lambda: print(f"rank {rank} atexit"))
    """)


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text(SCRIPT)
    return str(path)


def _env():
    """The test's environment less torch.distributed's variables (a one-rank run is told none), with a marker."""
    dist = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in dist}, "FORGE_LAUNCH_MARKER": "set-by-the-test"}


def test_ranks_are_told_what_torchrun_tells_them_and_their_output_comes_back(script):
    one = run_script(script, ["ok", "x y"], env=_env())
    assert one.returncode == 0, one.stderr
    assert one.stdout == "rank - of - local - argv ['ok', 'x y'] name __main__ marker set-by-the-test\n"
    assert one.stderr == "rank - to stderr\n"
    two = run_script(script, ["ok"], nproc=2, env=_env())
    assert two.returncode == 0, two.stderr
    assert two.stdout.splitlines() == [f"rank {r} of 2 local {r} argv ['ok'] name __main__ marker set-by-the-test"
                                       for r in (0, 1)]
    assert two.stderr.splitlines() == ["rank 0 to stderr", "rank 1 to stderr"]
    exits = run_script(script, ["exits"], env=_env())
    assert exits.returncode == 0 and exits.stdout.splitlines()[1:] == ["rank - thread done", "rank - atexit"]


def test_exit_status_exceptions_and_a_failing_rank_stop_the_run(script):
    raised = run_script(script, ["raise"], env=_env())
    assert raised.returncode == 1 and "ValueError: raised in the script" in raised.stderr
    assert run_script(script, ["fail"], env=_env()).returncode == 3
    start = time.monotonic()
    failed = run_script(script, ["fail"], nproc=2, env=_env())  # rank 1 exits 3, rank 0 would sleep 600 s
    assert failed.returncode == 3 and time.monotonic() - start < 60
    with pytest.raises(subprocess.TimeoutExpired):
        run_script(script, ["hang"], nproc=2, env=_env(), timeout_s=3)


def test_module_runs_and_a_new_interpreter_per_rank_prints_the_same(script, tmp_path, monkeypatch):
    pkg = tmp_path / "launcher_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "prog.py").write_text(SCRIPT)
    env = {**_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    monkeypatch.syspath_prepend(str(tmp_path))
    forked = [run_script(script, ["ok"], nproc=2, env=_env()),
              run_script("launcher_pkg.prog", ["ok"], nproc=2, env=env, module=True)]
    monkeypatch.setenv(LAUNCH_ENV, "exec")
    started = [run_script(script, ["ok"], nproc=2, env=_env()),
               run_script("launcher_pkg.prog", ["ok"], nproc=2, env=env, module=True)]
    for a, b in zip(forked, started):
        assert a.returncode == b.returncode == 0, b.stderr
        assert a.stdout == b.stdout  # (rank 0's output first, in both)
