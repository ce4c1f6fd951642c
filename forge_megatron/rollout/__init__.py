"""Rollout side: SGLang HTTP client and engine fleet, the CPU reference engine (forge-engine), launch helpers."""
