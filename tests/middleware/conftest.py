"""Fixtures shared by the data-pool tests: a database path under tmp_path and a pool factory that closes its pools."""

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
