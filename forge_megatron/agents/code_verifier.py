"""Unit-test rewards for coding tasks (``--verifier code``): the agent's program runs against the task's tests.

A task carries its tests in ``metadata["tests"]``, in one of two forms::

    {"stdio": [{"input": "1 2\\n", "output": "3\\n"}, ...]}    a program that reads stdin and writes stdout
                                                                (CodeContests, APPS, LiveCodeBench): each case runs
                                                                it once, its output compared with the expected one
                                                                line by line, trailing blanks and blank final lines
                                                                ignored
    {"asserts": ["assert add(1, 2) == 3", ...], "setup": "..."} statements run after the program's definitions
                                                                (HumanEval, MBPP): each is a case, run in a process
                                                                of its own after the program (and the optional setup
                                                                code), the program's ``__name__`` not ``"__main__"``
    {"fn_name": "add", "calls": [{"args": [1, 2], "output": 3}]} calls of a function by JSON arguments, its result
                                                                compared with ``==`` (APPS / TACO's "fn_name" form;
                                                                a ``class Solution`` method of that name, LeetCode
                                                                style, is called on a new instance): asserts made
                                                                of them, run as the form above

The program is the last fenced code block of the agent's answer (```` ```python ```` or plain ```` ``` ````), else
the whole answer. The reward is 1.0 when every case passes and 0.0 otherwise (``--code-reward all``, the default:
the first failure ends the check), or the fraction of cases passed (``pass_rate``).

Languages: Python, and C++, C, Rust, Java and JavaScript for ``stdio`` tests (competitive programming: CodeContests,
CodeForces). A task's ``metadata["language"]`` (``python``, ``cpp`` / ``c++``, ``c``, ``rust`` / ``rs``, ``java``,
``javascript`` / ``js`` / ``node``) says which its answers are written in, and its answer's last block fenced in that
language is the program (else its last block); without it, the language is the chosen block's fence tag
(```` ```cpp ````, ```` ```c ````, ```` ```rust ````, ```` ```java ````, ```` ```js ````; anything else: Python). A
compiled language's program is compiled once per episode (``--code-cxx`` g++ with ``--code-cxx-flags``
"-O2 -std=c++17", ``--code-cc`` gcc with ``--code-cc-flags`` "-O2 -std=c11" and libm, ``--code-rustc`` rustc with
``--code-rustc-flags`` "-O --edition 2021", ``--code-javac`` javac with ``--code-javac-flags``), under the same limits
as a case (``--code-compile-timeout-s``, default 20 s, its time counted in the episode's budget; the compiler's memory
``--code-compile-memory-mb``, default 2048), then each case runs the binary (Java: ``--code-java`` on the class that
declares ``main``, with ``--code-java-flags`` "-Xss64m -XX:+UseSerialGC") in a fresh directory of its own;
JavaScript runs under ``--code-node``. A Java source is saved under its public class's name (``Main.java`` without
one). A program that does not compile fails every case (its first error lines logged); a compiler or runtime that is
not installed fails the episode by name. ``asserts`` and ``calls`` tests are Python's: a task that pairs them with
another language fails its episode naming the task.

Managed runtimes (the JVM, V8) reserve address space far beyond what they use: their heap is bounded by their own
flag instead (``-Xmx`` / ``--max-old-space-size`` = ``--code-memory-mb``; javac's ``-J-Xmx`` =
``--code-compile-memory-mb``) and their address-space limit is that plus :data:`RUNTIME_RESERVE_MB` for code caches,
class metadata and thread stacks. They start threads, which count as processes to the no-new-processes limit: it is
off for them (a sandbox prefix confines them instead).

Each case is a new ``python -I`` process (isolated mode: no user site, no ``PYTHON*`` variables) in a fresh
temporary directory that is deleted afterwards, in its own session (the whole process group is killed when the case
is over or out of time), with an environment holding nothing of the driver's (``PATH``, ``HOME`` and ``TMPDIR`` the
directory, ``LANG``, ``PYTHONHASHSEED=0``: no API keys, no tokens), and POSIX limits: CPU seconds (the case's
timeout), address space (``--code-memory-mb``), file size (``--code-output-mb``: also what its output may fill, as
stdout goes to a file there), no core files, and no new processes for a non-root user. An assert case passes only when
the process exits 0 **and** prints, last, a random token the harness read from stdin before running the program, so a
program that exits early (``sys.exit(0)``, ``os._exit(0)``) passes nothing; the program runs in a namespace of its own.

These limits keep a runaway program from taking the machine down; they are not a security boundary against code
written to escape (it runs as the driver's user and can read what that user can). For untrusted code in production
give a sandbox prefix, ``--code-sandbox "bwrap --unshare-all --die-with-parent --ro-bind / / --bind {dir} {dir}
--chdir {dir} --"`` (``{dir}``: the case's directory), or nsjail / firejail alike: the command runs as its last
arguments.

At most ``--code-workers`` cases run at once over all the driver's episodes (default: the CPU count); an episode's
cases share ``--code-total-timeout-s`` (default 50 s, inside the 60 s the runner gives a verifier): the cases left
when it runs out count as failed (logged). A task without tests, or with tests of another shape, fails its episode
naming the task and the field; a program that cannot run (a syntax error) simply fails its cases.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("forge.agents")

REWARDS = ("all", "pass_rate")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)

LANGUAGES = {"python": ("python", "py", "python3"), "cpp": ("cpp", "c++", "cxx", "cc"), "c": ("c",),
             "rust": ("rust", "rs"), "java": ("java",), "javascript": ("javascript", "js", "node", "nodejs")}
"""The languages programs may be written in and the fence tags (and task ``language`` values) naming each."""

COMPILED = {"cpp": ("program.cpp", "cxx", "C++"), "c": ("program.c", "cc", "C"),
            "rust": ("program.rs", "rustc", "Rust"), "java": ("Main.java", "javac", "Java")}
"""Compiled languages: (source file, the :class:`CodeVerifier` fields ``<tool>`` / ``<tool>_flags`` and
``--code-<tool>`` flags of the compiler, the language's name). A Java source takes its public class's name."""

RUNTIME_RESERVE_MB = 1536
"""Address space a managed runtime (the JVM, node) gets beyond its heap limit (measured: java 17 needs about 1 GB more
than -Xmx with glibc's malloc arenas capped at 2, node 20 about 600 MB)."""

# the JVM's own reservations, bounded (the defaults reserve a 1 GB class space and a 240 MB code cache)
_JVM_LIMITS = ("-XX:CompressedClassSpaceSize=64m", "-XX:MaxMetaspaceSize=256m", "-XX:ReservedCodeCacheSize=64m")
_JAVA_PACKAGE = re.compile(r"^\s*package\s+([A-Za-z_$][\w$]*(?:\s*\.\s*[A-Za-z_$][\w$]*)*)\s*;", re.M)
_JAVA_TOKENS = re.compile(r"\b(?:class|interface|enum|record)\s+([A-Za-z_$][\w$]*)|[{}]|\bstatic\s+void\s+main\s*\(")
_JAVA_PUBLIC = re.compile(r"\bpublic\s+(?:(?:final|abstract|sealed|non-sealed|strictfp)\s+)*"
                          r"(?:class|interface|enum|record)\s+([A-Za-z_$][\w$]*)")

# The assert harness: reads the pass token first, runs the program and the case in namespaces of their own, prints
# the token last. Its file is written next to program.py and case.py in the case's directory.
_HARNESS = """\
import os, sys
def _forge_main():
    token = sys.stdin.readline().strip()
    sys.stdin = open(os.devnull)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    for name in ("program.py", "setup.py", "case.py"):
        with open(name) as f:
            exec(compile(f.read(), name, "exec"), namespace)
    sys.stdout.flush()
    sys.stdout.write("\\n" + token + "\\n")
    sys.stdout.flush()
_forge_main()
"""


# Sets the case's limits and execs the rest of its arguments: a process of its own rather than a preexec_fn, which
# is not safe in the driver's threads (a lock held by another thread at the fork stays held in the child).
_LAUNCHER = """\
import os, resource, sys
cpu, memory, output, nproc = map(int, sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, output),
                     (resource.RLIMIT_CORE, 0)) + (((resource.RLIMIT_NPROC, nproc),) if nproc >= 0 else ()):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass  # (a lower hard limit already set: kept)
os.execvp(sys.argv[5], sys.argv[5:])
"""


class CodeTaskError(ValueError):
    """A task's tests are missing or malformed (the episode fails naming the task)."""


def language_of(tag: str | None) -> str | None:
    """The language a fence tag or a task's ``language`` names (None: none of :data:`LANGUAGES`)."""
    tag = (tag or "").strip().lower()
    return next((name for name, tags in LANGUAGES.items() if tag in tags), None)


def extract_program(output: str | None, language: str | None = None) -> str:
    """The last fenced code block of ``output`` (one fenced in ``language``, default Python, preferred over others),
    else all of it."""
    return extract_program_and_language(output, language)[0]


def extract_program_and_language(output: str | None, language: str | None = None) -> tuple[str, str]:
    """(program, its language): the last block fenced in ``language`` (the task's; default Python), else the last
    block, whose language is then ``language`` if given, else its fence tag's (Python unless it names another)."""
    if not output:
        return "", language or "python"
    blocks = _FENCE.findall(output)
    if not blocks:
        return output, language or "python"
    tagged = [code for tag, code in blocks if language_of(tag) == (language or "python")]
    if tagged:
        return tagged[-1], language or "python"
    tag, code = blocks[-1]
    return code, language or (language_of(tag) or "python")


def _normalise(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def task_language(task) -> str | None:
    """The task's ``metadata["language"]`` as one of :data:`LANGUAGES` (None when it names none); CodeTaskError for
    one this verifier does not run."""
    value = (task.metadata or {}).get("language")
    if value is None:
        return None
    language = language_of(value) if isinstance(value, str) else None
    if language is None:
        raise CodeTaskError(f"task {task.task_id}: metadata.language {value!r}: --verifier code runs "
                            f"{', '.join(t[0] for t in LANGUAGES.values())} programs")
    return language


def parse_tests(task) -> tuple[str, list, str]:
    """(kind, cases, setup) of ``task.metadata["tests"]``; CodeTaskError naming the task and the field."""
    tests = (task.metadata or {}).get("tests")
    where = f"task {task.task_id}: metadata.tests"
    if not isinstance(tests, dict):
        raise CodeTaskError(f"{where} must be an object with 'stdio', 'asserts' or 'calls' (got "
                            f"{type(tests).__name__ if tests is not None else 'none'}): --verifier code needs tests")
    kinds = [k for k in ("stdio", "asserts", "calls") if k in tests]
    if len(kinds) != 1:
        raise CodeTaskError(f"{where} must have exactly one of 'stdio', 'asserts' and 'calls', got {sorted(tests)}")
    if kinds == ["calls"]:
        return "asserts", _call_asserts(tests, where), ""
    kind, cases = kinds[0], tests[kinds[0]]
    if not isinstance(cases, list) or not cases:
        raise CodeTaskError(f"{where}.{kind} must be a non-empty list")
    setup = tests.get("setup", "")
    if not isinstance(setup, str) or (setup and kind != "asserts"):
        raise CodeTaskError(f"{where}.setup must be a string, and is for 'asserts' tests")
    for i, case in enumerate(cases):
        ok = isinstance(case, str) if kind == "asserts" else (
            isinstance(case, dict) and isinstance(case.get("input", ""), str) and isinstance(case.get("output"), str))
        if not ok:
            want = "a statement (string)" if kind == "asserts" else "an object with 'output' (and 'input') strings"
            raise CodeTaskError(f"{where}.{kind}[{i}] must be {want}, got {case!r:.80}")
    return kind, cases, setup


def _call_asserts(tests: dict, where: str) -> list[str]:
    """The ``calls`` form as assert statements: ``assert F(*args) == output`` with F the function ``fn_name`` or, when
    the program defines ``class Solution`` with such a method, ``Solution().fn_name``; the JSON values written as
    Python literals."""
    fn, calls = tests.get("fn_name"), tests["calls"]
    if not isinstance(fn, str) or not fn.isidentifier():
        raise CodeTaskError(f"{where}.fn_name must name a function (an identifier), got {fn!r}")
    if not isinstance(calls, list) or not calls:
        raise CodeTaskError(f"{where}.calls must be a non-empty list")
    target = f"(Solution().{fn} if 'Solution' in dir() and hasattr(Solution, {fn!r}) else {fn})"
    out = []
    for i, case in enumerate(calls):
        if not (isinstance(case, dict) and isinstance(case.get("args", []), list) and "output" in case):
            raise CodeTaskError(f"{where}.calls[{i}] must be an object with 'output' (and an 'args' list), got "
                                f"{case!r:.80}")
        out.append(f"assert {target}(*{case.get('args', [])!r}) == {case['output']!r}")
    return out


def _java_code(source: str) -> str:
    """``source`` without comments and with empty string / char literals (for the searches below)."""
    source = re.sub(r"//[^\n]*|/\*.*?\*/", " ", source, flags=re.S)
    return re.sub(r'"""(?:.|\n)*?"""|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', '""', source)


def java_file_name(source: str) -> str:
    """The file a Java program must be saved in: its (first) public type's name, ``Main.java`` without one."""
    m = _JAVA_PUBLIC.search(_java_code(source))
    return f"{m.group(1) if m else 'Main'}.java"


def java_main_class(source: str) -> str | None:
    """The class whose body declares ``static void main(``: the innermost type around the first such declaration
    (nested helper classes before it do not count; a nested class as ``Outer$Inner``), qualified by the source's
    ``package``; None when there is none."""
    code = _java_code(source)
    open_types: list[str | None] = []  # per open brace: the type it opens (None: a method, block, ...)
    pending = None
    for m in _JAVA_TOKENS.finditer(code):
        token = m.group(0)
        if token == "{":
            open_types.append(pending)
            pending = None
        elif token == "}":
            if open_types:
                open_types.pop()
        elif m.group(1):
            pending = m.group(1)
        else:
            names = [n for n in open_types if n]
            if not names:
                return None
            package = _JAVA_PACKAGE.search(code)
            prefix = re.sub(r"\s+", "", package.group(1)) + "." if package else ""
            return prefix + "$".join(names)
    return None


@dataclass
class CaseResult:
    passed: bool
    reason: str = ""  # why not: "wrong output", "exit status 1", "timed out", ...
    seconds: float = 0.0


@dataclass
class CodeVerifier:
    """``(task, output) -> reward`` from running the program in ``output`` against ``task.metadata["tests"]``."""

    reward: str = "all"
    timeout_s: float = 5.0  # per case (wall clock; its CPU limit too)
    total_timeout_s: float = 50.0  # per episode
    memory_mb: int = 1024
    output_mb: int = 16
    workers: int = 0  # cases at once over all episodes (0: the CPU count)
    python: str = sys.executable
    sandbox: str = ""  # a command prefix ("{dir}": the case's directory)
    cxx: str = "g++"  # the compilers of C++, C and Rust programs, and their flags
    cxx_flags: str = "-O2 -std=c++17"
    cc: str = "gcc"
    cc_flags: str = "-O2 -std=c11"
    rustc: str = "rustc"
    rustc_flags: str = "-O --edition 2021"
    javac: str = "javac"  # Java's compiler and runtime, and JavaScript's
    javac_flags: str = ""
    java: str = "java"
    java_flags: str = "-Xss64m -XX:+UseSerialGC"
    node: str = "node"
    compile_timeout_s: float = 20.0
    compile_memory_mb: int = 2048
    stats: dict = field(default_factory=lambda: {"cases": 0, "passed": 0, "timed_out": 0, "compile_errors": 0})

    def __post_init__(self):
        if self.reward not in REWARDS:
            raise ValueError(f"--code-reward must be one of {REWARDS}, got {self.reward!r}")
        if not (self.timeout_s > 0 and self.total_timeout_s > 0 and self.memory_mb > 0 and self.output_mb > 0
                and self.workers >= 0 and self.compile_timeout_s > 0 and self.compile_memory_mb > 0):
            raise ValueError("--code-timeout-s, --code-total-timeout-s, --code-memory-mb, --code-output-mb, "
                             "--code-compile-timeout-s and --code-compile-memory-mb must be > 0 and --code-workers "
                             ">= 0")
        self.prefix = shlex.split(self.sandbox) if self.sandbox else []
        self._slots = threading.BoundedSemaphore(self.workers or os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._resolved: dict[str, str] = {}  # (rustup proxies -> the toolchain's rustc)

    def __call__(self, task, output) -> float:
        kind, cases, setup = parse_tests(task)
        language = task_language(task)
        if language not in (None, "python") and kind != "stdio":
            raise CodeTaskError(f"task {task.task_id}: metadata.tests 'asserts' / 'calls' are Python statements: a "
                                f"{language} task takes 'stdio' tests")
        # (Python-statement tests take the answer as Python whatever its fence says: another language scores nothing)
        program, language = extract_program_and_language(output, language or (None if kind == "stdio" else "python"))
        runtime = {"java": ("java", "Java"), "javascript": ("node", "JavaScript")}.get(language)
        if runtime is not None and shutil.which(getattr(self, runtime[0])) is None:
            raise RuntimeError(f"--code-{runtime[0]} {getattr(self, runtime[0])!r} is not found here: {runtime[1]} "
                               "programs cannot be checked")
        deadline = time.monotonic() + self.total_timeout_s
        binary_dir = None
        try:
            if language in COMPILED:
                binary_dir, error = self.compile(language, program,
                                                 min(self.compile_timeout_s, self.total_timeout_s))
                if binary_dir is None:
                    log.info("task %s: the %s program does not compile: %s", task.task_id, COMPILED[language][2],
                             error)
                    return 0.0
            passed = 0
            for i, case in enumerate(cases):
                left = deadline - time.monotonic()
                if left <= 0.05:
                    log.warning("task %s: --code-total-timeout-s %gs ran out after %d of %d cases: the rest count as "
                                "failed", task.task_id, self.total_timeout_s, i, len(cases))
                    break
                result = self.run_case(kind, program, case, setup, min(self.timeout_s, left), binary_dir,
                                       language)
                passed += result.passed
                if not result.passed and self.reward == "all":
                    break
        finally:
            if binary_dir is not None:
                shutil.rmtree(binary_dir, ignore_errors=True)
        return passed / len(cases) if self.reward == "pass_rate" else float(passed == len(cases))

    def compile(self, language: str, program: str, timeout_s: float) -> tuple[str | None, str]:
        """Compile a program of a :data:`COMPILED` language under the case limits (the compiler's own memory limit; it
        may start processes): (the directory holding ``program``, the binary, or None; the compiler's first error
        lines)."""
        source, tool, name = COMPILED[language]
        compiler = getattr(self, tool)
        if shutil.which(compiler) is None:
            raise RuntimeError(f"--code-{tool} {compiler!r} is not a compiler found here: {name} programs cannot be "
                               "checked")
        if language == "rust":
            compiler = self._real_rustc(compiler)
        workdir = tempfile.mkdtemp(prefix="forge-code-build-")
        memory = self.compile_memory_mb
        if language == "java":
            source = java_file_name(program)
            main = java_main_class(program)
            command = [compiler, f"-J-Xmx{memory}m", "-J-XX:+UseSerialGC", *(f"-J{x}" for x in _JVM_LIMITS),
                       *shlex.split(self.javac_flags), "-d", ".", source]
            memory += RUNTIME_RESERVE_MB
        else:
            command = [compiler, *shlex.split(getattr(self, f"{tool}_flags")), source, "-o", "program"]
        if language == "c":
            command.append("-lm")  # (libm after the source: sqrt, pow, ...)
        with open(os.path.join(workdir, source), "w") as f:
            f.write(program)
        with self._slots:
            timed_out, status, output = self._spawn(command, "", timeout_s, workdir, memory_mb=memory, may_fork=True,
                                                    keep_stderr=True)
        if language == "java" and not timed_out and status == 0:
            os.remove(os.path.join(workdir, source))
            if main is None or not os.path.isfile(os.path.join(workdir, *main.split(".")) + ".class"):
                shutil.rmtree(workdir, ignore_errors=True)
                with self._lock:
                    self.stats["compile_errors"] += 1
                return None, "no class declares static void main(String[])"
            with open(os.path.join(workdir, ".main"), "w") as f:
                f.write(main)
            return workdir, ""
        if not timed_out and status == 0 and os.path.isfile(os.path.join(workdir, "program")):
            return workdir, ""
        shutil.rmtree(workdir, ignore_errors=True)
        with self._lock:
            self.stats["compile_errors"] += 1
        if timed_out:
            return None, f"the compiler ran out of its {timeout_s:g} s"
        return None, " | ".join(line for line in output.splitlines() if line.strip())[:500] or f"exit status {status}"

    def _real_rustc(self, rustc: str) -> str:
        """The toolchain's own rustc behind a rustup proxy (which needs the driver's HOME, kept from the compile's
        environment): ``<sysroot>/bin/rustc``, asked once; ``rustc`` itself when it is not a proxy or cannot say."""
        with self._lock:
            if rustc in self._resolved:
                return self._resolved[rustc]
        real = rustc  # (asked outside the lock: the cases' bookkeeping does not wait for it)
        try:
            out = subprocess.run([rustc, "--print", "sysroot"], capture_output=True, text=True, timeout=60)
            candidate = os.path.join(out.stdout.strip(), "bin", "rustc")
            if out.returncode == 0 and os.path.isfile(candidate):
                real = candidate
        except (OSError, subprocess.TimeoutExpired):
            pass
        with self._lock:
            return self._resolved.setdefault(rustc, real)

    def run_case(self, kind: str, program: str, case, setup: str = "", timeout_s: float | None = None,
                 binary_dir: str | None = None, language: str = "python") -> CaseResult:
        """One case in a fresh directory and process (see the module docstring); ``binary_dir``: a compiled
        program's directory (:meth:`compile`), whose binary (or Java classes) the case runs instead of the Python
        ``program``; ``language`` "javascript": ``program`` runs under node."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._slots:
            workdir = tempfile.mkdtemp(prefix="forge-code-")
            try:
                result = self._run(kind, program, case, setup, timeout_s, workdir, binary_dir, language)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        with self._lock:
            self.stats["cases"] += 1
            self.stats["passed"] += result.passed
            self.stats["timed_out"] += result.reason == "timed out"
        return result

    def _run(self, kind, program, case, setup, timeout_s, workdir, binary_dir=None,
             language="python") -> CaseResult:
        def write(name: str, text: str) -> None:
            with open(os.path.join(workdir, name), "w") as f:
                f.write(text)

        token = secrets.token_hex(16)  # (the assert harness's pass token)
        memory, runtime = None, False  # (a managed runtime: its heap flag, more address space, threads)
        if binary_dir is not None and language == "java":  # the classes copied in (a sandbox may bind this dir alone)
            shutil.copytree(binary_dir, workdir, dirs_exist_ok=True)  # (a package's classes in its directories)
            with open(os.path.join(workdir, ".main")) as f:
                main = f.read()
            command = [self.java, f"-Xmx{self.memory_mb}m", *_JVM_LIMITS, *shlex.split(self.java_flags), "-cp", ".",
                       main]
            stdin, memory, runtime = case.get("input", ""), self.memory_mb + RUNTIME_RESERVE_MB, True
        elif binary_dir is not None:  # a compiled program: its binary copied in
            shutil.copy2(os.path.join(binary_dir, "program"), os.path.join(workdir, "program"))
            command, stdin = ["./program"], case.get("input", "")
        elif language == "javascript":
            write("program.js", program)
            command = [self.node, f"--max-old-space-size={self.memory_mb}", "program.js"]
            stdin, memory, runtime = case.get("input", ""), self.memory_mb + RUNTIME_RESERVE_MB, True
        elif kind == "stdio":
            write("program.py", program)
            command, stdin = [self.python, "-I", "program.py"], case.get("input", "")
        else:
            write("program.py", program)
            write("setup.py", setup)
            write("case.py", case)
            write("harness.py", _HARNESS)
            command, stdin = [self.python, "-I", "harness.py"], token + "\n"
        t0 = time.monotonic()
        timed_out, status, stdout = self._spawn(command, stdin, timeout_s, workdir, memory_mb=memory,
                                                may_fork=runtime)
        seconds = time.monotonic() - t0
        if timed_out:
            return CaseResult(False, "timed out", seconds)
        if status != 0:
            return CaseResult(False, f"exit status {status}", seconds)
        if kind == "stdio":
            ok = _normalise(stdout) == _normalise(case["output"])
            return CaseResult(ok, "" if ok else "wrong output", seconds)
        ok = _normalise(stdout)[-1:] == [token]
        return CaseResult(ok, "" if ok else "no pass token (the program exited early?)", seconds)

    def _spawn(self, command: list[str], stdin: str, timeout_s: float, workdir: str, memory_mb: int | None = None,
               may_fork: bool = False, keep_stderr: bool = False) -> tuple[bool, int, str]:
        """Run ``command`` in ``workdir`` under the limits, the sandbox prefix and a clean environment, its session
        killed at the end: (timed out, exit status, its stdout, with its stderr after when ``keep_stderr``)."""
        nproc = 0 if not self.prefix and os.getuid() != 0 and not may_fork else -1  # (a sandbox forks; root ignores)
        limits = [str(int(timeout_s) + 1), str((memory_mb or self.memory_mb) << 20), str(self.output_mb << 20),
                  str(nproc)]
        cmd = [self.python, "-I", "-c", _LAUNCHER, *limits,
               *[a.replace("{dir}", workdir) for a in self.prefix], *command]
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "MALLOC_ARENA_MAX": "2"}  # (glibc's 64 MB arena per thread would eat a threaded runtime's limit)
        out_path = os.path.join(workdir, ".stdout")
        with open(out_path, "wb") as out:
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out,
                                        stderr=out if keep_stderr else subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise RuntimeError(f"--verifier code could not start {cmd[0]!r}: {exc}") from exc
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except (BrokenPipeError, OSError):  # the program exited without reading its input
                pass
            finally:
                _kill_group(proc)
                proc.wait()
        with open(out_path, "rb") as f:
            stdout = f.read(self.output_mb << 20).decode("utf-8", "replace")
        return timed_out, proc.returncode, stdout


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the case's whole process group (its session): whatever it started dies with it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def add_code_arguments(p) -> None:
    g = p.add_argument_group("unit-test rewards (--verifier [DOMAIN=]code)")
    g.add_argument("--code-reward", choices=REWARDS, default="all",
                   help="all: 1 when every case of the task's metadata.tests passes, else 0; pass_rate: the "
                        "fraction passed")
    g.add_argument("--code-timeout-s", type=float, default=5.0, help="wall-clock (and CPU) seconds per case")
    g.add_argument("--code-total-timeout-s", type=float, default=50.0,
                   help="seconds for all of an episode's cases (within the 60 s the runner gives a verifier); cases "
                        "left when it runs out count as failed")
    g.add_argument("--code-memory-mb", type=int, default=1024, help="address-space limit of a case's process")
    g.add_argument("--code-output-mb", type=int, default=16, help="largest file, and stdout, a case may write")
    g.add_argument("--code-workers", type=int, default=0,
                   help="cases running at once over all episodes (default 0: the CPU count)")
    g.add_argument("--code-python", default=sys.executable, help="the interpreter that runs the programs")
    g.add_argument("--code-cxx", default="g++", help="the compiler of C++ programs (tasks whose metadata.language, or "
                   "whose answer's fence, says cpp)")
    g.add_argument("--code-cxx-flags", default="-O2 -std=c++17", help="its flags")
    g.add_argument("--code-cc", default="gcc", help="the compiler of C programs (linked with libm)")
    g.add_argument("--code-cc-flags", default="-O2 -std=c11", help="its flags")
    g.add_argument("--code-rustc", default="rustc", help="the compiler of Rust programs")
    g.add_argument("--code-rustc-flags", default="-O --edition 2021", help="its flags")
    g.add_argument("--code-javac", default="javac", help="the compiler of Java programs")
    g.add_argument("--code-javac-flags", default="", help="its flags (its heap: --code-compile-memory-mb)")
    g.add_argument("--code-java", default="java", help="the runtime of Java programs (the class declaring main)")
    g.add_argument("--code-java-flags", default="-Xss64m -XX:+UseSerialGC",
                   help="its flags (its heap, -Xmx: --code-memory-mb)")
    g.add_argument("--code-node", default="node",
                   help="the runtime of JavaScript programs (its heap: --code-memory-mb)")
    g.add_argument("--code-compile-timeout-s", type=float, default=20.0,
                   help="seconds to compile a program of a compiled language (once per episode, within "
                        "--code-total-timeout-s)")
    g.add_argument("--code-compile-memory-mb", type=int, default=2048, help="address-space limit of the compiler")
    g.add_argument("--code-sandbox", default="", metavar="PREFIX",
                   help="a command prefix every case runs under, e.g. \"bwrap --unshare-all --die-with-parent "
                        "--ro-bind / / --bind {dir} {dir} --chdir {dir} --\" ({dir}: the case's directory); "
                        "without it a case is a resource-limited process of the driver's user, not a sandbox")


def code_verifier_from_args(args) -> CodeVerifier:
    python = getattr(args, "code_python", sys.executable)
    if shutil.which(python) is None and not os.path.isfile(python):
        raise ValueError(f"--code-python {python!r} is not an interpreter found here")
    return CodeVerifier(reward=getattr(args, "code_reward", "all"), timeout_s=getattr(args, "code_timeout_s", 5.0),
                        total_timeout_s=getattr(args, "code_total_timeout_s", 50.0),
                        memory_mb=getattr(args, "code_memory_mb", 1024), output_mb=getattr(args, "code_output_mb", 16),
                        workers=getattr(args, "code_workers", 0), python=python,
                        sandbox=getattr(args, "code_sandbox", ""), cxx=getattr(args, "code_cxx", "g++"),
                        cxx_flags=getattr(args, "code_cxx_flags", "-O2 -std=c++17"), cc=getattr(args, "code_cc", "gcc"),
                        cc_flags=getattr(args, "code_cc_flags", "-O2 -std=c11"),
                        rustc=getattr(args, "code_rustc", "rustc"),
                        rustc_flags=getattr(args, "code_rustc_flags", "-O --edition 2021"),
                        javac=getattr(args, "code_javac", "javac"), javac_flags=getattr(args, "code_javac_flags", ""),
                        java=getattr(args, "code_java", "java"),
                        java_flags=getattr(args, "code_java_flags", "-Xss64m -XX:+UseSerialGC"),
                        node=getattr(args, "code_node", "node"),
                        compile_timeout_s=getattr(args, "code_compile_timeout_s", 20.0),
                        compile_memory_mb=getattr(args, "code_compile_memory_mb", 2048))
