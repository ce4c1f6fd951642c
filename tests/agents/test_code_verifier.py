"""--verifier code (agents/code_verifier.py): the program in an agent's answer runs against the task's unit tests in
real subprocesses, one per case; wrong, crashing, looping, exiting-early, memory-hungry and output-flooding programs
earn nothing and leave nothing running; the driver's secrets stay out of the case's environment. GPUs needed: 0."""

import glob
import os
import shutil
import sys
import tempfile
import time

import pytest

from forge_megatron.agents.code_verifier import (CodeTaskError, CodeVerifier, code_verifier_from_args,
                                                 extract_program, extract_program_and_language)
from forge_megatron.agents.tasks import Task

ADD_STDIO = {"stdio": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
                       {"input": "0 0\n", "output": "0\n\n"}]}
ADD_ASSERTS = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}


def _task(tests, task_id="t1"):
    return Task(task_id=task_id, prompt="add two numbers", domain="code", metadata={"tests": tests})


def _answer(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt reads two numbers."


@pytest.fixture
def verifier():
    return CodeVerifier(timeout_s=3.0, total_timeout_s=20.0, workers=2)


def test_stdio_programs_are_scored_by_their_output(verifier):
    right = "a, b = map(int, input().split())\nprint(a + b)"
    assert verifier(_task(ADD_STDIO), _answer(right)) == 1.0
    assert verifier(_task(ADD_STDIO), _answer("a, b = map(int, input().split())\nprint(a - b)")) == 0.0
    half = "a, b = map(int, input().split())\nprint(a + b if a >= 0 and b >= 0 else 0)"
    rate = CodeVerifier(reward="pass_rate", timeout_s=3.0)
    assert rate(_task(ADD_STDIO), _answer(half)) == pytest.approx(2 / 3)
    assert rate(_task(ADD_STDIO), _answer("print(")) == 0.0  # a syntax error fails its cases, nothing raises
    assert rate(_task(ADD_STDIO), None) == 0.0


def test_assert_tests_run_after_the_program_and_count_per_case(verifier):
    assert verifier(_task(ADD_ASSERTS), _answer("def add(a, b):\n    return a + b")) == 1.0
    rate = CodeVerifier(reward="pass_rate", timeout_s=3.0)
    assert rate(_task(ADD_ASSERTS), _answer("def add(a, b):\n    return a + b if a != 2 else 0")) \
        == pytest.approx(2 / 3)
    # a main block does not run (the program's __name__ is not __main__); setup code runs before each case
    main = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    raise SystemExit(3)"
    assert verifier(_task(ADD_ASSERTS), _answer(main)) == 1.0
    with_setup = {"asserts": ["assert add(BASE, 1) == 101"], "setup": "BASE = 100"}
    assert verifier(_task(with_setup), _answer("def add(a, b):\n    return a + b")) == 1.0


def test_function_calls_by_json_arguments_plain_or_on_a_solution_class(verifier):
    """The ``calls`` form (APPS / TACO's fn_name): JSON arguments and results (lists, strings, true / null), a plain
    function or a LeetCode-style ``class Solution`` method."""
    tests = {"fn_name": "merge", "calls": [{"args": [[1, 3], [2]], "output": [1, 2, 3]},
                                           {"args": [[], []], "output": []},
                                           {"args": [["b"], ["a"]], "output": ["a", "b"]}]}
    plain = "def merge(a, b):\n    return sorted(a + b)"
    method = "class Solution:\n    def merge(self, a, b):\n        return sorted(a + b)"
    assert verifier(_task(tests), _answer(plain)) == 1.0
    assert verifier(_task(tests), _answer(method)) == 1.0
    rate = CodeVerifier(reward="pass_rate", timeout_s=3.0)
    assert rate(_task(tests), _answer("def merge(a, b):\n    return a + b")) == pytest.approx(1 / 3)  # ([] + [] only)
    flags = {"fn_name": "f", "calls": [{"args": [True, None], "output": None}]}
    assert verifier(_task(flags), _answer("def f(x, y):\n    return y if x else 1")) == 1.0


@pytest.mark.parametrize("hack", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                  "import builtins\nbuiltins.print = lambda *a, **k: None\ndef add(a, b):\n    return -99"])
def test_a_program_that_exits_early_or_silences_output_passes_nothing(verifier, hack):
    """Exit status 0 alone is no pass: the harness's token printed after the case is."""
    assert CodeVerifier(reward="pass_rate", timeout_s=3.0)(_task(ADD_ASSERTS), _answer(hack)) == 0.0


def test_runaway_programs_are_stopped_and_leave_nothing_behind(tmp_path):
    """An endless loop times out (the episode's score is 0 well before the runner's 60 s), its whole process group is
    killed (a child it started, when it may start one, is gone too); a memory bomb fails on its limit; an output flood
    is cut at its file limit."""
    verifier = CodeVerifier(timeout_s=1.5, total_timeout_s=10.0, memory_mb=256, output_mb=1)
    t0 = time.monotonic()
    assert verifier(_task(ADD_STDIO), _answer("while True:\n    pass")) == 0.0
    assert time.monotonic() - t0 < 6.0 and verifier.stats["timed_out"] >= 1
    pid_file = tmp_path / "child.pid"
    spawner = (f"import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
               f"open({str(pid_file)!r}, 'w').write(str(p.pid))\nwhile True:\n    pass")
    CodeVerifier(timeout_s=1.5).run_case("stdio", spawner, {"input": "", "output": ""})
    if pid_file.exists():  # root may fork (RLIMIT_NPROC does not hold it): the child must be dead then
        pid = int(pid_file.read_text())
        time.sleep(0.2)
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split()[2] == "Z", "the case's child outlived it"
        except ProcessLookupError:
            pass
    bomb = verifier.run_case("stdio", "x = bytearray(512 * 1024 * 1024)\nprint(3)", {"input": "", "output": "3"})
    assert not bomb.passed and bomb.reason.startswith("exit status")
    flood = verifier.run_case("stdio", "while True:\n    print('x' * 1000)", {"input": "", "output": "x"})
    assert not flood.passed and flood.reason != "timed out" and flood.seconds < 1.5


def test_the_case_sees_none_of_the_drivers_environment(verifier, monkeypatch):
    monkeypatch.setenv("FORGE_ADMIN_TOKEN", "secret-token")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    leak = "import os\nprint(os.environ.get('FORGE_ADMIN_TOKEN'), os.environ.get('OPENAI_API_KEY'))"
    assert verifier(_task({"stdio": [{"input": "", "output": "None None"}]}), _answer(leak)) == 1.0
    cwd = "import os\nprint(sorted(os.listdir('.')) == ['.stdout', 'program.py'], os.getcwd() == os.environ['HOME'])"
    assert verifier(_task({"stdio": [{"output": "True True"}]}), _answer(cwd)) == 1.0  # a fresh directory


def test_all_stops_at_the_first_failure_and_the_total_budget_bounds_an_episode():
    slow = "import time\ntime.sleep(0.8)\nprint(1)"
    cases = {"stdio": [{"input": "", "output": "2"}] * 4}
    verifier = CodeVerifier(timeout_s=3.0)
    verifier(_task(cases), _answer(slow))
    assert verifier.stats["cases"] == 1  # "all": the first failure decides
    budget = CodeVerifier(reward="pass_rate", timeout_s=3.0, total_timeout_s=2.0)
    t0 = time.monotonic()
    assert budget(_task({"stdio": [{"input": "", "output": "1"}] * 6}), _answer(slow)) < 1.0
    assert time.monotonic() - t0 < 4.0 and budget.stats["cases"] < 6


def test_a_sandbox_prefix_wraps_every_case(tmp_path):
    """--code-sandbox: the prefix (with {dir} filled in) runs each case, the program as its last arguments."""
    wrapper = tmp_path / "wrap.py"
    log = tmp_path / "wrapped.txt"
    wrapper.write_text(f"import os, sys\nopen({str(log)!r}, 'a').write(sys.argv[1] + '\\n')\n"
                       "os.execvp(sys.argv[2], sys.argv[2:])\n")
    # (two interpreter start-ups a case, the wrapper's and the program's: 10 s, not the 3 s the timing tests use, so a
    # loaded CI machine does not time a case out; what is asserted is the wrapping)
    verifier = CodeVerifier(timeout_s=10.0, sandbox=f"{sys.executable} {wrapper} {{dir}}")
    assert verifier(_task(ADD_STDIO), _answer("a, b = map(int, input().split())\nprint(a + b)")) == 1.0
    dirs = log.read_text().split()
    assert len(dirs) == 3 and all(d.startswith(os.path.join(os.path.realpath("/tmp"), "forge-code-"))
                                  or "forge-code-" in d for d in dirs)
    assert not any(os.path.exists(d) for d in dirs)  # each case's directory is removed


def test_program_extraction():
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("text ```py\na = 1\n``` more ```python\nb = 2\n``` and ```\nc\n```") == "b = 2\n"
    assert extract_program("print(2)") == "print(2)"
    assert extract_program(None) == ""


ADD_CPP = "#include <iostream>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n"
ADD_C = ("#include <stdio.h>\n#include <math.h>\n"
         "int main(void) { long a, b; scanf(\"%ld %ld\", &a, &b); printf(\"%ld\\n\", a + b + (long) sqrt(0.0)); }\n")
ADD_RUST = ("use std::io::Read;\n"
            "fn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();\n"
            "  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
            "  println!(\"{}\", v[0] + v[1]); }\n")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) here")


def test_program_language_from_the_task_or_the_fence():
    both = "```python\nprint(1)\n```\nor in C++:\n```cpp\nint main() {}\n```"
    assert extract_program_and_language(both) == ("print(1)\n", "python")  # (a Python block preferred)
    assert extract_program_and_language(both, "cpp") == ("int main() {}\n", "cpp")
    assert extract_program_and_language("```c++\nint main() {}\n```") == ("int main() {}\n", "cpp")
    assert extract_program_and_language("```\nint main() {}\n```", "cpp") == ("int main() {}\n", "cpp")
    assert extract_program_and_language("```go\nx\n```") == ("x\n", "python")  # (unknown tags: Python)
    assert extract_program_and_language("```js\nx\n```") == ("x\n", "javascript")
    assert extract_program_and_language("```java\nclass A {}\n```")[1] == "java"
    assert extract_program_and_language("```rs\nfn main() {}\n```")[1] == "rust"
    assert extract_program_and_language("```c\nint main(void) {}\n```")[1] == "c"


def _builds():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "forge-code-build-*")))


@needs_cxx
def test_cpp_programs_compile_once_and_run_against_stdio_tests(verifier):
    """C++ (the task's language, or the answer's fence): compiled once per episode, the binary run per case; a wrong
    program, one that does not compile and one that loops earn nothing, leaving no build directory behind."""
    before = _builds()
    tagged = f"My solution:\n```cpp\n{ADD_CPP}```"
    assert verifier(_task(ADD_STDIO), tagged) == 1.0
    task = Task(task_id="c1", prompt="add", domain="code", metadata={"tests": ADD_STDIO, "language": "c++"})
    assert verifier(task, f"```\n{ADD_CPP}```") == 1.0  # (untagged: the task's language)
    assert verifier(task, f"```\n{ADD_CPP.replace('a + b', 'a - b')}```") == 0.0
    rate = CodeVerifier(reward="pass_rate", timeout_s=3.0)
    half = ADD_CPP.replace("a + b", "(a >= 0 && b >= 0 ? a + b : 0)")
    assert rate(task, f"```cpp\n{half}```") == pytest.approx(2 / 3)
    errors = verifier.stats["compile_errors"]
    assert verifier(task, "```cpp\nint main() { return undefined_name; }\n```") == 0.0
    assert verifier.stats["compile_errors"] == errors + 1
    t0 = time.monotonic()
    looping = CodeVerifier(timeout_s=1.0)
    assert looping(task, "```cpp\nint main() { volatile long x = 0; for (;;) ++x; }\n```") == 0.0
    assert time.monotonic() - t0 < 15 and looping.stats["timed_out"] == 1
    assert _builds() <= before  # every build directory removed
    with pytest.raises(RuntimeError, match="--code-cxx 'no-such-cxx' is not a compiler found here"):
        CodeVerifier(cxx="no-such-cxx")(task, f"```cpp\n{ADD_CPP}```")


@pytest.mark.parametrize("language,tag,program,wrong,compiler", [
    ("c", "c", ADD_C, "a + b +", "gcc"),
    ("rust", "rust", ADD_RUST, "v[0] + v[1]", "rustc"),
])
def test_c_and_rust_programs_compile_and_run_likewise(verifier, language, tag, program, wrong, compiler):
    import subprocess

    if shutil.which(compiler) is None or subprocess.run([compiler, "--version"], capture_output=True).returncode:
        pytest.skip(f"no working {compiler} here")
    assert verifier(_task(ADD_STDIO), f"```{tag}\n{program}```") == 1.0  # (the fence names the language)
    task = Task(task_id="x1", prompt="add", domain="code", metadata={"tests": ADD_STDIO, "language": language})
    minus = program.replace(wrong, wrong.replace("+", "-", 1))
    assert minus != program and verifier(task, f"```\n{minus}```") == 0.0
    errors = verifier.stats["compile_errors"]
    assert verifier(task, "```\nthis is not a program\n```") == 0.0 and verifier.stats["compile_errors"] == errors + 1


ADD_JAVA = ("import java.util.*;\n"
            "public class Solution {\n"
            "  static class Reader { Scanner in = new Scanner(System.in); long next() { return in.nextLong(); } }\n"
            "  public static void main(String[] args) { Reader r = new Reader(); long a = r.next(), b = r.next();\n"
            "    System.out.println(a + b); }\n"
            "}\n"
            "class Unused { }\n")
ADD_JS = ("const v = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
          "console.log(v[0] + v[1]);\n")
needs_jvm = pytest.mark.skipif(shutil.which("javac") is None or shutil.which("java") is None, reason="no JDK here")
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="no node here")


@needs_jvm
def test_java_programs_compile_to_classes_and_run_their_main_class(verifier):
    """Java: saved under its public class's name (Solution.java), compiled once, the class declaring main run per case
    (not the nested helper before it; in its package when it has one) under its heap limit; wrong, uncompilable, main-less and memory-hungry programs
    earn nothing and leave no build directory."""
    before = _builds()
    task = Task(task_id="j1", prompt="add", domain="code", metadata={"tests": ADD_STDIO, "language": "java"})
    assert verifier(task, f"```java\n{ADD_JAVA}```") == 1.0
    assert verifier(_task(ADD_STDIO), f"```java\n{ADD_JAVA}```") == 1.0  # (the fence names the language)
    assert verifier(task, f"```\n{ADD_JAVA.replace('a + b', 'a - b')}```") == 0.0
    assert verifier(task, f"```java\npackage contest.sol;\n{ADD_JAVA}```") == 1.0  # (its classes under contest/sol/)
    errors = verifier.stats["compile_errors"]
    assert verifier(task, "```java\nclass Main { int f() { return undefined; } }\n```") == 0.0
    assert verifier(task, "```java\nclass Main { int f() { return 1; } }\n```") == 0.0  # (no main)
    assert verifier.stats["compile_errors"] == errors + 2
    hungry = ADD_JAVA.replace("Reader r = new Reader();", "long[][] x = new long[32][]; for (int i = 0; i < 32; i++) "
                              "x[i] = new long[1 << 20]; Reader r = new Reader();")  # 256 MB of arrays, then the sum
    assert hungry != ADD_JAVA and CodeVerifier(memory_mb=512, timeout_s=10.0)(task, f"```java\n{hungry}```") == 1.0
    small = CodeVerifier(memory_mb=64, timeout_s=10.0)
    assert small(task, f"```java\n{hungry}```") == 0.0  # a 64 MB heap: OutOfMemoryError
    assert small(task, f"```java\n{ADD_JAVA}```") == 1.0  # (the runtime itself fits its reserve)
    assert _builds() <= before
    with pytest.raises(RuntimeError, match="--code-javac 'no-such-javac' is not a compiler found here"):
        CodeVerifier(javac="no-such-javac")(task, f"```java\n{ADD_JAVA}```")


@needs_node
def test_javascript_programs_run_under_node(verifier):
    """JavaScript: each case runs the program under node (its heap bounded by --code-memory-mb: 300 MB of arrays pass
    under 1024, not under 64); a wrong program, one that throws and one that loops earn nothing."""
    task = Task(task_id="js1", prompt="add", domain="code", metadata={"tests": ADD_STDIO, "language": "js"})
    assert verifier(task, f"```javascript\n{ADD_JS}```") == 1.0
    assert verifier(_task(ADD_STDIO), f"```js\n{ADD_JS}```") == 1.0
    assert verifier(task, f"```\n{ADD_JS.replace('v[0] + v[1]', 'v[0] * v[1]')}```") == 0.0
    assert verifier(task, "```js\nthrow new Error('no');\n```") == 0.0
    hungry = "const a = []; for (let i = 0; i < 40; i++) a.push(new Array(1 << 20).fill(i));\n" + ADD_JS  # ~300 MB
    assert CodeVerifier(memory_mb=1024, timeout_s=10.0)(task, f"```js\n{hungry}```") == 1.0
    assert CodeVerifier(memory_mb=64, timeout_s=10.0)(task, f"```js\n{hungry}```") == 0.0  # the heap limit bites
    looping = CodeVerifier(timeout_s=1.0)
    t0 = time.monotonic()
    assert looping(task, "```js\nfor (;;) {}\n```") == 0.0
    assert time.monotonic() - t0 < 15 and looping.stats["timed_out"] == 1
    with pytest.raises(RuntimeError, match="--code-node 'no-such-node' is not found here: JavaScript"):
        CodeVerifier(node="no-such-node")(task, f"```js\n{ADD_JS}```")


def test_other_languages_and_cpp_asserts_fail_the_episode(verifier):
    with pytest.raises(CodeTaskError, match=r"task r1: metadata.language 'go': --verifier code runs python, cpp, "
                                            r"c, rust, java, javascript"):
        verifier(Task(task_id="r1", prompt="p", metadata={"tests": ADD_STDIO, "language": "go"}), "package main")
    with pytest.raises(CodeTaskError, match="'asserts' / 'calls' are Python statements: a cpp task takes 'stdio'"):
        verifier(Task(task_id="c2", prompt="p", metadata={"tests": ADD_ASSERTS, "language": "cpp"}), ADD_CPP)
    # a Python task's asserts against an answer in another language: the agent's mistake, scored 0 (no task error)
    assert verifier(_task(ADD_ASSERTS), f"```cpp\n{ADD_CPP}```") == 0.0


@pytest.mark.parametrize("tests,message", [
    (None, "metadata.tests must be an object with 'stdio', 'asserts' or 'calls'"),
    ({"stdio": [], "asserts": []}, "exactly one of 'stdio', 'asserts' and 'calls'"),
    ({"fn_name": "not valid", "calls": [{"output": 1}]}, "fn_name must name a function"),
    ({"fn_name": "f", "calls": [{"args": 3, "output": 1}]}, r"calls\[0\] must be an object with 'output'"),
    ({"stdio": []}, "metadata.tests.stdio must be a non-empty list"),
    ({"stdio": [{"input": "1"}]}, r"metadata.tests.stdio\[0\] must be an object with 'output'"),
    ({"asserts": [3]}, r"metadata.tests.asserts\[0\] must be a statement"),
    ({"stdio": [{"output": "1"}], "setup": "x = 1"}, "setup must be a string, and is for 'asserts' tests"),
])
def test_bad_tests_fail_the_episode_naming_the_task(verifier, tests, message):
    with pytest.raises(CodeTaskError, match=message):
        verifier(Task(task_id="bad-7", prompt="p", metadata={} if tests is None else {"tests": tests}), "print(1)")


def test_options_are_checked():
    import argparse

    from forge_megatron.agents.runner import add_verifier_argument, build_verifier

    p = argparse.ArgumentParser()
    add_verifier_argument(p)
    args = p.parse_args(["--verifier", "code=code", "--code-reward", "pass_rate", "--code-timeout-s", "2"])
    verifier = build_verifier(args.verifier, args)
    task = _task(ADD_STDIO)
    assert verifier(task, _answer("print(3)")) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="--code-python 'no-such-python' is not an interpreter"):
        code_verifier_from_args(p.parse_args(["--code-python", "no-such-python"]))
    with pytest.raises(ValueError, match="must be > 0"):
        CodeVerifier(timeout_s=0)
    with pytest.raises(ValueError, match="--code-reward must be one of"):
        CodeVerifier(reward="most")
    with pytest.raises(ValueError, match="--code-compile-timeout-s and --code-compile-memory-mb must be > 0"):
        code_verifier_from_args(p.parse_args(["--code-compile-timeout-s", "0"]))
    cpp = code_verifier_from_args(p.parse_args(["--code-cxx", "clang++", "--code-cxx-flags", "-O1 -std=c++20",
                                                "--code-cc", "clang", "--code-rustc-flags=-O"]))
    assert (cpp.cxx, cpp.cxx_flags, cpp.compile_timeout_s) == ("clang++", "-O1 -std=c++20", 20.0)
    assert (cpp.cc, cpp.cc_flags, cpp.rustc, cpp.rustc_flags) == ("clang", "-O2 -std=c11", "rustc", "-O")
    jvm = code_verifier_from_args(p.parse_args(["--code-java", "/opt/jdk/bin/java", "--code-java-flags=-Xss16m",
                                                "--code-node", "nodejs"]))
    assert (jvm.java, jvm.java_flags, jvm.javac, jvm.node) == ("/opt/jdk/bin/java", "-Xss16m", "javac", "nodejs")


def test_driver_records_the_tests_verdicts(stack):
    """The rollout driver with ``--verifier coin=code``: episodes through the real gateway (one engine call each, the
    right program on every second episode, ``wrong`` otherwise) reach the pool's sink with their tests' verdicts."""
    import argparse
    import threading

    from forge_megatron.agents.driver import RolloutDriver
    from forge_megatron.agents.runner import PythonAgent, add_verifier_argument, build_verifier
    from tests.agents.agent_cases import Scripted

    p = argparse.ArgumentParser()
    add_verifier_argument(p)
    args = p.parse_args(["--verifier", "coin=code", "--code-timeout-s", "3"])
    program = _answer("a, b = map(int, input().split())\nprint(a + b)")
    tasks = [Task(task_id=f"code-{i}", prompt="add", domain="coin", answer=program, metadata={"tests": ADD_STDIO})
             for i in range(2)]
    driver = RolloutDriver(stack["gateway"], PythonAgent(Scripted()), tasks, group_size=2, max_inflight_groups=1,
                           verifier=build_verifier(args.verifier, args))
    before = len(stack["sink"].episodes)
    driver.run(threading.Event(), max_groups=2)
    new = [e for e in stack["sink"].episodes[before:] if e.task_id.startswith("code-")]
    assert len(new) == 4 and sorted(e.reward for e in new) == [0.0, 0.0, 1.0, 1.0]
