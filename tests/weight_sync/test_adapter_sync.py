"""--weight-sync-lora adapter (weight_sync/adapters.py): a LoRA trainer (TP / PP / EP, 2 gloo ranks) sends its
adapters alone; forge-engine, serving LoRA as SGLang does, loads each version beside the unchanged base weights and,
with the adapter named, scores as the trainer does; the gateway is told the adapter's name and is never paused; old
adapters are unloaded and their directories removed; an engine that fails a load is excluded and paused, and comes
back with the next version."""

import json
import os
import time
import urllib.request

import pytest
import torch

from forge_megatron.bridge import ParallelLayout
from forge_megatron.convert import checkpoint as ckpt
from forge_megatron.mcore.parallel import ParallelConfig
from forge_megatron.rollout.lora_serving import policy_adapter_version
from tests.convert.mcore_forward import load_converted
from tests.dist_utils import run_distributed
from tests.weight_sync.test_weight_sync import _engine_vs_trainer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("adapter_sync")
    return {arch: build_tiny_model(str(root / arch), arch=arch, seed=seed)
            for arch, seed in (("qwen2", 3), ("qwen3", 4), ("qwen3_moe", 5), ("deepseek_v3", 7), ("qwen3_vl", 14))}


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _move_adapters(model, step):
    """Move every adapter factor by a function of its position and ``step`` (equal on every rank holding it)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                p.add_(0.2 * torch.cos(torch.arange(p.numel(), dtype=torch.float32) * 0.7 + step).view_as(p))


def _adapter_sync_body(rank, world_size, mcore_dir, engine_url, gateway_url, disk_dir, targets):
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge, model = load_converted(mcore_dir)
    install([model], LoraConfig(rank=4, alpha=8.0, targets=targets))
    results = {"base": _engine_vs_trainer(model, engine_url)}  # B = 0: version 0 is the checkpoint
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[engine_url], lora="adapter", disk_dir=disk_dir,
                                           gateway_url=gateway_url, timeout_s=60), bridge)
    try:
        for version in (1, 2, 3):
            _move_adapters(model, version)
            report = syncer.sync([model], version)
            state = _get(gateway_url + "/forge/admin/state") if rank == 0 else {}
            results[version] = (report, state, _engine_vs_trainer(model, engine_url, state.get("policy_adapter")))
    finally:
        syncer.close()
    results["base after"] = _engine_vs_trainer(model, engine_url)
    return results


@pytest.mark.parametrize("arch,parallel", [
    ("qwen2", ParallelConfig(tp=2)),  # B of column-parallel / A of row-parallel linears joined over TP
    ("qwen3", ParallelConfig(pp=2)),  # stage 1's adapters sent to rank 0, which writes the one adapter
    ("qwen3_moe", ParallelConfig(ep=2)),  # attention adapted, experts untouched
    ("deepseek_v3", ParallelConfig(tp=2)),  # multi-latent attention's up projections, a dense MLP
    ("qwen3_vl", ParallelConfig(tp=2)),  # a vision-language model's language model (model.language_model.*)
], ids=["tp2", "pp2", "ep2-moe", "tp2-mla", "tp2-vl"])
def test_adapters_reach_the_engine_without_their_base_weights(models, tmp_path, arch, parallel):
    from forge_megatron.mcore.lora import TARGETS
    from forge_megatron.rollout.launch import start_engine, start_gateway

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models[arch], mcore, ParallelLayout(parallel.tp, parallel.pp, parallel.ep))
    engine = start_engine(models[arch], in_process=True, extra_args=["--enable-lora", "--max-lora-rank", "8"])
    gateway = start_gateway(models[arch], [engine.url], in_process=True)
    disk = tmp_path / "adapters"
    try:
        results = run_distributed(_adapter_sync_body, world_size=2, parallel=parallel, mcore_dir=mcore,
                                  engine_url=engine.url, gateway_url=gateway.url, disk_dir=str(disk), targets=TARGETS)
        r0 = results[0]
        (base_lps, base_version), trainer = r0["base"]
        assert max(abs(a - b) for a, b in zip(base_lps, trainer)) <= 1e-5 and base_version == "default"
        names = []
        for version in (1, 2, 3):
            report, state, ((lps, engine_version), trainer) = r0[version]
            assert report.policy_version == version and report.updated == [engine.url] and report.excluded == []
            assert 0 < report.bytes < 200_000  # the adapters only
            assert state["policy_version"] == version and not state["paused"] and state["aborts"] == 0
            name = state["policy_adapter"]
            assert policy_adapter_version(name) == version and name not in names
            names.append(name)
            assert engine_version == "default"  # the base weights were never touched
            assert max(abs(a - b) for a, b in zip(lps, trainer)) <= 1e-5, (version, lps, trainer)
            assert max(abs(a - b) for a, b in zip(lps, base_lps)) > 1e-3  # (the adapter moved the scores)
        (lps, _), _ = r0["base after"]
        assert lps == base_lps  # without the adapter: the checkpoint, as before
        # version 1 retired in the background (the one before the current stays for calls starting with it)
        deadline = time.monotonic() + 20
        while True:
            held = [c["id"] for c in _get(engine.url + "/v1/models")["data"] if c.get("parent")]
            if sorted(held) == sorted(names[1:]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sorted(held) == sorted(names[1:])
        assert sorted(os.listdir(disk)) == sorted(names[1:])
        config = json.loads((disk / names[2] / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8.0 and "o_proj" in config["target_modules"]
    finally:
        gateway.stop()
        engine.stop()


def _failing_engine_body(rank, world_size, mcore_dir, engine_urls, disk_dir, flag_file):
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge, model = load_converted(mcore_dir)
    install([model], LoraConfig(rank=4, alpha=8.0))
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=engine_urls, lora="adapter", disk_dir=disk_dir,
                                           timeout_s=60), bridge)
    reports = []
    try:
        for version in (1, 2):
            _move_adapters(model, version)
            reports.append(syncer.sync([model], version))
            if version == 1:  # the test widens the refusing engine's targets meanwhile
                while not os.path.exists(flag_file):
                    time.sleep(0.05)
    finally:
        syncer.close()
    return reports


def test_an_engine_that_refuses_the_adapter_is_excluded_and_paused_then_comes_back(models, tmp_path):
    """One engine serves LoRA on q_proj only (SGLang refuses an adapter of other modules): excluded from version 1
    and paused (the gateway will name an adapter it does not hold); the other gets version 1. Once it accepts them,
    version 2 reaches both and the paused one is continued."""
    import threading

    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout())
    good = start_engine(models["qwen2"], in_process=True, extra_args=["--enable-lora"])
    narrow = start_engine(models["qwen2"], in_process=True,
                          extra_args=["--enable-lora", "--lora-target-modules", "q_proj"])
    flag = tmp_path / "widened"
    seen = {}

    def widen_after_version_1():
        deadline = time.monotonic() + 120  # (the sync pauses the refusing engine after the loads)
        while time.monotonic() < deadline and narrow.engine.pause_mode is None:
            time.sleep(0.05)
        seen["paused"] = narrow.engine.pause_mode
        seen["held"] = [c["id"] for c in _get(good.url + "/v1/models")["data"] if c.get("parent")]
        narrow.engine.lora.targets = None  # as if restarted with --lora-target-modules all
        flag.write_text("")

    helper = threading.Thread(target=widen_after_version_1, daemon=True)
    helper.start()
    try:
        (first, second), = run_distributed(_failing_engine_body, world_size=1, mcore_dir=mcore,
                                           engine_urls=[good.url, narrow.url], disk_dir=str(tmp_path / "adapters"),
                                           flag_file=str(flag))
        helper.join(timeout=10)
        assert first.policy_version == 1 and first.updated == [good.url] and first.excluded == [narrow.url]
        assert seen["paused"] == "abort" and [policy_adapter_version(n) for n in seen["held"]] == [1]
        assert second.policy_version == 2 and sorted(second.updated) == sorted([good.url, narrow.url])
        assert second.excluded == [] and narrow.engine.pause_mode is None
        held = [c["id"] for c in _get(narrow.url + "/v1/models")["data"] if c.get("parent")]
        assert [policy_adapter_version(n) for n in held] == [2]
    finally:
        good.stop()
        narrow.stop()


def _settled(url, names, timeout_s=20.0):
    """The adapters the engine holds once its background unloads leave only ``names`` (or at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sorted(c["id"] for c in _get(url + "/v1/models")["data"] if c.get("parent"))
        if held == sorted(names) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def _restart_body(rank, world_size, mcore_dir, engine_url, disk_dir):
    """Two trainer runs one after the other (a restart): each syncer names its adapters with its own run token."""
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge, model = load_converted(mcore_dir)
    install([model], LoraConfig(rank=4, alpha=8.0))
    held, named = [], []
    for versions in ((1, 2, 3), (4, 5)):
        syncer = WeightSyncer(WeightSyncConfig(engine_urls=[engine_url], lora="adapter", disk_dir=disk_dir,
                                               timeout_s=60), bridge)
        try:
            for version in versions:
                _move_adapters(model, version)
                assert syncer.sync([model], version).policy_version == version
                named.append(syncer.adapters.current)
                held.append((_settled(engine_url, named[-2:]), sorted(os.listdir(disk_dir))))
        finally:
            syncer.close()
    return named, held


def test_a_restarted_trainer_keeps_the_newest_adapter_of_the_run_before_for_one_sync(models, tmp_path):
    """The first sync of a restarted trainer cannot know which adapter the gateway names: it keeps the newest one
    the engine holds (the run before's last) beside its own, and unloads the rest; its next sync retires that one."""
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout())
    engine = start_engine(models["qwen2"], in_process=True, extra_args=["--enable-lora"])
    try:
        ((named, held),) = run_distributed(_restart_body, world_size=1, mcore_dir=mcore, engine_url=engine.url,
                                           disk_dir=str(tmp_path / "adapters"))
    finally:
        engine.stop()
    assert [policy_adapter_version(n) for n in named] == [1, 2, 3, 4, 5]
    runs = [n.rsplit("-", 1)[0] for n in named]  # forge-<run>
    assert len(set(runs[:3])) == 1 and len(set(runs[3:])) == 1 and runs[3] != runs[2]
    for i, (on_engine, on_disk) in enumerate(held):
        want = sorted(named[max(0, i - 1):i + 1])  # the new one and the one before (the run before's last, at 4)
        assert on_engine == want and on_disk == want, (i + 1, on_engine, on_disk)


def _late_retire_body(rank, world_size, mcore_dir, engine_url, disk_dir):
    """Three syncs, then sync 2's background retirement run late (after sync 3 loaded its adapter)."""
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge, model = load_converted(mcore_dir)
    install([model], LoraConfig(rank=4, alpha=8.0))
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[engine_url], lora="adapter", disk_dir=disk_dir,
                                           timeout_s=60), bridge)
    named = []
    try:
        for version in (1, 2, 3):
            _move_adapters(model, version)
            syncer.sync([model], version)
            named.append(syncer.adapters.current)
        before = _settled(engine_url, named[1:])
        syncer.adapters._unload_stale(engine_url, named[1], named[0])  # (what sync 2 scheduled, running now)
        return named, before, _settled(engine_url, named[1:], timeout_s=1.0)
    finally:
        syncer.close()


def test_a_late_retirement_never_unloads_a_newer_adapter(models, tmp_path):
    """The retirement of old adapters runs in the background: one that runs after the next sync has loaded its
    adapter leaves that adapter (the one the gateway now names) loaded."""
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout())
    engine = start_engine(models["qwen2"], in_process=True, extra_args=["--enable-lora"])
    try:
        ((named, before, after),) = run_distributed(_late_retire_body, world_size=1, mcore_dir=mcore,
                                                    engine_url=engine.url, disk_dir=str(tmp_path / "adapters"))
    finally:
        engine.stop()
    assert before == after == sorted(named[1:])


def _write_failure_body(rank, world_size, mcore_dir, engine_url, disk_dir):
    from forge_megatron.mcore.lora import LoraConfig, install
    from forge_megatron.weight_sync import WeightSyncConfig, WeightSyncer

    bridge, model = load_converted(mcore_dir)
    install([model], LoraConfig(rank=4, alpha=8.0))
    syncer = WeightSyncer(WeightSyncConfig(engine_urls=[engine_url], lora="adapter", disk_dir=disk_dir,
                                           timeout_s=60), bridge)
    try:
        first = syncer.sync([model], 1)  # disk_dir is a file: nothing can be written
        if rank == 0:
            os.remove(disk_dir)
            os.makedirs(disk_dir)
        torch.distributed.barrier()
        return first.policy_version, syncer.sync([model], 2).policy_version
    finally:
        syncer.close()


def test_an_adapter_that_cannot_be_written_fails_the_sync_on_every_rank_and_training_goes_on(models, tmp_path):
    from forge_megatron.rollout.launch import start_engine

    mcore = str(tmp_path / "mcore")
    ckpt.hf_to_megatron(models["qwen2"], mcore, ParallelLayout(tp=2))
    engine = start_engine(models["qwen2"], in_process=True, extra_args=["--enable-lora"])
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("")
    try:
        results = run_distributed(_write_failure_body, world_size=2, parallel=ParallelConfig(tp=2), mcore_dir=mcore,
                                  engine_url=engine.url, disk_dir=str(blocked), timeout_s=120)
    finally:
        engine.stop()
    assert results == [(None, 2), (None, 2)]  # no version advance anywhere, then the next sync works
