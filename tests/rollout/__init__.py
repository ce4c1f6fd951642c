"""Tests of the rollout side (tiny model assets, forge-engine, SGLang client and fleet)."""
