"""Agents and tasks: task files, the gateway's session API, white-box and black-box agent runners, the rollout
driver that keeps the data pool fed, and the demo's calculator agent. Never imports Megatron."""
