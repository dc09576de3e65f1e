"""Networking: tensor RPCs (framing, errors, transport, protocol), DHT records and joining, run membership,
routing decisions, and the in-process link throttle and namespace entering.

Layer: above the pure building blocks (config, model, wire, ..., trust), below ``client`` and ``server``.
See docs/ARCHITECTURE.md and docs/TRANSPORT.md.
"""
