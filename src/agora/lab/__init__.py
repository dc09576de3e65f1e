"""The local test bed: the demo swarm, network namespaces and link emulation, the attack simulator, the
centralized baseline (``train_local``) and run reports.

Layer: above ``roles`` (it starts role processes), below ``bench`` and ``cli``. See docs/ARCHITECTURE.md.
"""
