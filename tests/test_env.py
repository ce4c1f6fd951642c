import subprocess
import sys

from forge_megatron.utils import env


def test_env_report_runs_and_names_components():
    out = subprocess.run([sys.executable, "-m", "forge_megatron.env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for label in ("torch", "megatron-core", "CUDA device", "triton", "transformer-engine", "C++ tree builder"):
        assert label in out.stdout
    assert env.mcore_version() in out.stdout


def test_require_missing_component_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(env._PROBES, "te", lambda: env.Probe(False, None, "RuntimeError: cudnn not found"))
    try:
        env.require("te", "the TE layer spec")
    except RuntimeError as exc:
        msg = str(exc)
    else:
        raise AssertionError("require did not raise")
    assert "transformer-engine" in msg and "the TE layer spec" in msg and "cudnn" in msg


def test_te_runtime_error_is_reported_not_raised(monkeypatch):
    real_import = env.importlib.import_module

    def fake_import(name, *a, **k):
        if name == "transformer_engine":
            raise RuntimeError("cudnn shared object not found")
        return real_import(name, *a, **k)

    monkeypatch.setattr(env.importlib, "import_module", fake_import)
    probe = env._import_probe("transformer_engine")
    assert not probe.available and "RuntimeError" in probe.detail
