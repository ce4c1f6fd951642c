"""Fixtures shared by the middleware tests: a database path under tmp_path and a pool factory that closes its pools
(data pool); the tiny model fine-tuned on the gateway tests' scripted chats and a gateway over two in-process
engines serving it (gateway, one per test module)."""

import os

import pytest

from forge_megatron.middleware.pool import DataPool, PoolConfig


@pytest.fixture
def db(tmp_path):
    return os.fspath(tmp_path / "pool.sqlite")


@pytest.fixture
def make_pool(db):
    pools = []

    def make(**kw):
        pools.append(DataPool(PoolConfig(db_path=db, **kw)))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model, finetune_on_chats
    from tests.middleware.test_gateway import TOOLS, scripted_chats

    d = build_tiny_model(str(tmp_path_factory.mktemp("scripted")), seed=0)
    return finetune_on_chats(d, scripted_chats(), tools=TOOLS, steps=100, lr=5e-3)


@pytest.fixture(scope="module")
def stack(model_dir):
    from forge_megatron.rollout.launch import start_engine, start_gateway

    engines = [start_engine(model_dir, in_process=True) for _ in range(2)]
    gw = start_gateway(model_dir, [e.url for e in engines], in_process=True)
    yield gw, engines
    gw.stop()
    for e in engines:
        e.stop()
