from agora.sentinel.monitor import *  # noqa: F401,F403
from agora.sentinel.monitor import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config, version_key  # noqa: F401
