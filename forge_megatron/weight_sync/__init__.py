"""Weight sync from a TP/PP/EP-sharded Megatron trainer to SGLang-compatible engines (see ``syncer``)."""

from forge_megatron.weight_sync.syncer import SyncReport, WeightSyncConfig, WeightSyncer
from forge_megatron.weight_sync.transport import EngineFailure

__all__ = ["EngineFailure", "SyncReport", "WeightSyncConfig", "WeightSyncer"]
