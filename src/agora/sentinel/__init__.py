"""SENTINEL: statistics only, no networking. A receiver judges the tensors that cross stage boundaries.

``SentinelMonitor`` (``monitor``) screens activations and gradients from other peers; ``LossMonitor`` (``loss``)
attributes suspicious losses to the peers on a path. How it works and what was measured: ``docs/SENTINEL.md``.
"""

from agora.sentinel.config import AUDIT_RATE, Direction, SentinelConfig, Verdict, node_config, version_key
from agora.sentinel.features import BASE_FEATURES, TAIL_FEATURES, VECTORS, fingerprint
from agora.sentinel.loss import LossCheckConfig, LossMonitor, LossVerdict
from agora.sentinel.monitor import SentinelMonitor

__all__ = [
    "AUDIT_RATE", "BASE_FEATURES", "Direction", "LossCheckConfig", "LossMonitor", "LossVerdict", "SentinelConfig",
    "SentinelMonitor", "TAIL_FEATURES", "VECTORS", "Verdict", "fingerprint", "node_config", "version_key",
]
