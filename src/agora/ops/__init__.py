"""Watching a run: Prometheus ``/metrics`` for a node, a run snapshot read from the DHT (``status``), the dashboard.

Layer: above ``server`` (it subscribes to a node's events), below ``roles``. See docs/ARCHITECTURE.md.
"""
