"""Trust: identity keys, owner-signed self-certifying DHT records, allow-list certificates, a peer's run
credentials and per-caller rate limits.

Layer: a pure building block (beside model, wire, optim, ...), above ``config``, below ``net``. See docs/TRUST.md.
"""
