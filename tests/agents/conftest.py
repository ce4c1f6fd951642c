"""Shared by the agent tests: a real forge-engine (in process) serving a tiny model, a real forge-gateway in front of
it recording into a ListSink, and the calculator agent as an HTTP service; one stack for the whole package."""

import pytest

from forge_megatron.agents.gateway_api import GatewayClient
from forge_megatron.middleware.schema import ListSink


@pytest.fixture(scope="package")
def stack(tmp_path_factory):
    from forge_megatron.models.tiny import build_tiny_model
    from forge_megatron.rollout.launch import ProcessServer, start_engine, start_gateway

    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    engine = start_engine(model_dir, in_process=True)
    sink = ListSink()
    gateway = start_gateway(model_dir, [engine.url], in_process=True, sink=sink)
    agent_service = ProcessServer("forge_megatron.agents.calculator", ["--serve"])
    yield {"gateway": GatewayClient(gateway.url), "sink": sink, "agent_url": agent_service.url + "/",
           "server": gateway.gateway}
    agent_service.stop()
    gateway.stop()
    engine.stop()
