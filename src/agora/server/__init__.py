"""A stage server: ``node`` (lifecycle, composition), ``handler`` (RPCs), ``runtime`` (compute), ``downstream``,
``screening`` (SENTINEL), ``rebalance``, ``checkpoint``, ``observers`` and ``averaging/`` (replica sync).

Layer: above ``net`` and ``client``, below ``ops`` and ``roles``. See docs/ARCHITECTURE.md and docs/AVERAGING.md.
"""
