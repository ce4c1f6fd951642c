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


def test_cuda_probe_never_initialises_cuda(monkeypatch):
    """A process that initialised CUDA cannot fork children that use it (the test ranks' fork server imports modules
    that probe): the probe counts devices (NVML where the driver has it) and touches nothing that initialises."""
    import torch

    def initialises(*args, **kwargs):
        raise AssertionError("the CUDA probe initialised CUDA")

    for name in ("_lazy_init", "init", "get_device_name", "get_device_properties", "is_available",
                 "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, initialises)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    for count, available in ((2, True), (0, False)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        env.probe_cuda.cache_clear()
        try:
            probe = env.probe_cuda()
        finally:
            env.probe_cuda.cache_clear()
        assert probe.available is available and probe.version == "13.0"
        assert probe.detail == ("2 device(s)" if available else
                                "no CUDA device visible (torch.cuda.device_count() is 0)")
